"""The stand-in Hub (tests/standin_hub.py) is faithful: the real huggingface_hub works against it over real HTTP.

Nothing inside huggingface_hub is patched. In-process tests pass `endpoint=hub.endpoint` and run inside
`hub_online()`, which only flips the `HF_HUB_OFFLINE` config switch that tests/conftest.py turns on for the whole
test session. Subprocess tests configure a fresh import purely through the environment
(`hub.subprocess_env(hf_home)`: HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE=0, HF_HUB_DISABLE_XET=1, ...; all read at
import time by `huggingface_hub.constants`). The behaviours pinned here (exception classes, no sha256 check,
no cross-process resume, in-call Range resume) are summarised in tests/standin_hub.py's docstring.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import huggingface_hub as hf
import pytest
from huggingface_hub import errors

from standin_hub import HubRepo, StandinHub, git_blob_sha1, hub_online

MiB = 1024 * 1024
SMALL = {
    "config.json": b'{"model_type": "llama", "vocab_size": 97}',
    "tokenizer.json": b'{"version": "1.0"}',
    "README.md": b"# tiny\n",
    "model.safetensors": bytes(range(256)) * 8,
    "extra/weights.bin": b"\x00\x01\x02\x03" * 10,
}


@pytest.fixture
def online():
    with hub_online():
        yield


@pytest.fixture
def tiny():
    return HubRepo("org/tiny", dict(SMALL))


def snapshot(hub, repo_id, cache, **kw):
    kw.setdefault("token", False)
    return hf.snapshot_download(repo_id, cache_dir=cache, endpoint=hub.endpoint, **kw)


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_snapshot_allow_patterns_exact_and_byte_identical(tmp_path, tiny, online):
    with StandinHub([tiny]) as hub:
        path = Path(snapshot(hub, "org/tiny", tmp_path, allow_patterns=["*.json", "*.safetensors"]))
    assert path.name == tiny.sha and path.parent.name == "snapshots"
    want = {k: v for k, v in SMALL.items() if k.endswith((".json", ".safetensors"))}
    assert read_tree(path) == want
    storage = tmp_path / "models--org--tiny"
    assert (storage / "refs" / "main").read_text() == tiny.sha
    # blobs are named by the ETag: sha256 for LFS files, git blob sha1 for the others
    assert {p.name for p in (storage / "blobs").iterdir()} == {tiny.etag(k) for k in want}
    assert tiny.etag("model.safetensors") == hashlib.sha256(SMALL["model.safetensors"]).hexdigest()
    assert tiny.etag("config.json") == git_blob_sha1(SMALL["config.json"])
    # explicit commit sha as revision: no repo_info call, same snapshot
    with StandinHub([tiny]) as hub:
        assert snapshot(hub, "org/tiny", tmp_path, revision=tiny.sha, allow_patterns="*.json") == str(path)
        assert not any("/api/models/org/tiny/revision" in r.path for r in hub.request_log)


def test_hf_hub_download_then_cached_snapshot_fetches_no_bodies(tmp_path, tiny, online):
    with StandinHub([tiny]) as hub:
        one = hf.hf_hub_download("org/tiny", "config.json", cache_dir=tmp_path, endpoint=hub.endpoint, token=False)
        assert Path(one).read_bytes() == SMALL["config.json"]
        assert [r.method for r in hub.request_log] == ["HEAD", "GET"]
        first = Path(snapshot(hub, "org/tiny", tmp_path))
        assert read_tree(first) == SMALL
        assert len(hub.gets()) == len(SMALL)  # config.json was not fetched twice
        assert not hub.gets("org/tiny/config.json")[1:]
        mark = len(hub.request_log)
        again = Path(snapshot(hub, "org/tiny", tmp_path))
        assert again == first
        # only the branch -> commit resolution; tree listing cached on disk, files found in the snapshot
        assert hub.request_log[mark:] == [("GET", "/api/models/org/tiny/revision/main", None)]


def test_api_info_tree_pagination_and_raw_http(tmp_path, tiny, online):
    with StandinHub([tiny], page_size=2) as hub:
        api = hf.HfApi(endpoint=hub.endpoint, token=False)
        info = api.model_info("org/tiny", files_metadata=True)
        assert info.sha == tiny.sha and info.gated is False
        siblings = {s.rfilename: s for s in info.siblings}
        assert set(siblings) == set(SMALL)
        assert siblings["model.safetensors"].lfs.sha256 == tiny.etag("model.safetensors")
        assert siblings["config.json"].lfs is None and siblings["config.json"].size == len(SMALL["config.json"])
        tree = list(api.list_repo_tree("org/tiny", recursive=True))
        assert sum("/tree/" in r.path for r in hub.request_log) == 3  # 6 entries, 2 per page
        files = {e.path: e for e in tree if isinstance(e, hf.hf_api.RepoFile)}
        assert set(files) == set(SMALL)
        assert [e.path for e in tree if isinstance(e, hf.hf_api.RepoFolder)] == ["extra"]
        assert files["extra/weights.bin"].lfs.size == 40 and files["README.md"].lfs is None
        assert [e.path for e in api.list_repo_tree("org/tiny", path_in_repo="extra")] == ["extra/weights.bin"]

        url = hf.hf_hub_url("org/tiny", "model.safetensors", endpoint=hub.endpoint)
        data = SMALL["model.safetensors"]
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD")) as r:
            headers = r.headers
        assert headers["ETag"] == f'"{tiny.etag("model.safetensors")}"' == headers["X-Linked-Etag"]
        assert headers["X-Linked-Size"] == str(len(data)) and headers["X-Repo-Commit"] == tiny.sha
        assert not [h for h in headers if h.lower().startswith("x-xet") or h.lower() == "link"]
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=100-"})) as r:
            assert r.status == 206 and r.headers["Content-Range"] == f"bytes 100-{len(data) - 1}/{len(data)}"
            assert r.read() == data[100:]
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=-10"})) as r:
            assert r.read() == data[-10:]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, headers={"Range": f"bytes={len(data)}-"}))
        assert e.value.code == 416 and e.value.headers["Content-Range"] == f"bytes */{len(data)}"


def test_gated_repo(tmp_path, online):
    gated = HubRepo("org/gated", {"config.json": b"{}", "model.safetensors": b"w" * 100}, gated=True)
    with StandinHub([gated]) as hub:
        with pytest.raises(errors.GatedRepoError) as anonymous:
            snapshot(hub, "org/gated", tmp_path / "a", token=False)
        assert anonymous.value.response.status_code == 401
        with pytest.raises(errors.GatedRepoError) as wrong:
            hf.hf_hub_download("org/gated", "config.json", cache_dir=tmp_path / "b", endpoint=hub.endpoint,
                               token="hf_not_the_right_one")
        assert wrong.value.response.status_code == 403
        assert hf.HfApi(endpoint=hub.endpoint, token=False).model_info("org/gated").gated == "auto"  # info is public
        path = Path(snapshot(hub, "org/gated", tmp_path / "c", token=StandinHub.token))
        assert read_tree(path) == gated.files


def test_not_found_errors(tmp_path, tiny, online):
    with StandinHub([tiny]) as hub:
        for token in (False, "hf_some_token"):  # anonymous: 401, authenticated: 404; same class
            with pytest.raises(errors.RepositoryNotFoundError) as e:
                snapshot(hub, "org/missing", tmp_path, token=token)
            assert type(e.value) is errors.RepositoryNotFoundError
            with pytest.raises(errors.RepositoryNotFoundError) as e:
                hf.hf_hub_download("missing", "config.json", cache_dir=tmp_path, endpoint=hub.endpoint, token=token)
            assert type(e.value) is errors.RepositoryNotFoundError
        with pytest.raises(errors.RevisionNotFoundError):
            snapshot(hub, "org/tiny", tmp_path, revision="v9")
        with pytest.raises(errors.RevisionNotFoundError):
            snapshot(hub, "org/tiny", tmp_path, revision="0" * 40)  # sha-shaped: skips repo_info, fails at HEAD
        with pytest.raises(errors.RevisionNotFoundError):
            hf.hf_hub_download("org/tiny", "config.json", revision="v9", cache_dir=tmp_path, endpoint=hub.endpoint)
        with pytest.raises(errors.RemoteEntryNotFoundError):
            hf.hf_hub_download("org/tiny", "nope.json", cache_dir=tmp_path, endpoint=hub.endpoint, token=False)


def test_new_version_moves_main_and_old_commit_stays(tmp_path, tiny, online):
    with StandinHub([tiny]) as hub:
        old = Path(snapshot(hub, "org/tiny", tmp_path, allow_patterns="config.json"))
        new_sha = hub.add(HubRepo("org/tiny", {**SMALL, "config.json": b'{"v": 2}'}))
        new = Path(snapshot(hub, "org/tiny", tmp_path, allow_patterns="config.json"))
        assert new.name == new_sha != old.name == tiny.sha
        assert (new / "config.json").read_bytes() == b'{"v": 2}'
        pinned = Path(snapshot(hub, "org/tiny", tmp_path / "x", revision=tiny.sha, allow_patterns="config.json"))
        assert (pinned / "config.json").read_bytes() == SMALL["config.json"]


def test_offline(tmp_path, tiny, online):
    with StandinHub([tiny]) as hub:
        full = snapshot(hub, "org/tiny", tmp_path)
        # local_files_only never touches the network
        mark = len(hub.request_log)
        assert snapshot(hub, "org/tiny", tmp_path, local_files_only=True) == full
        assert len(hub.request_log) == mark
    # the Hub is gone: connection refused
    assert snapshot(hub, "org/tiny", tmp_path) == full
    assert Path(hf.hf_hub_download("org/tiny", "config.json", cache_dir=tmp_path, endpoint=hub.endpoint)
                ).read_bytes() == SMALL["config.json"]
    with pytest.raises(errors.LocalEntryNotFoundError) as e:
        snapshot(hub, "org/never", tmp_path)
    assert type(e.value) is errors.LocalEntryNotFoundError
    # (hf_hub_download of an uncached file with the Hub unreachable raises the same class, but only after
    # ~23 s of backoff retries on the HEAD (1+2+4+8+8 s): local_files_only=True is the fast equivalent.)
    with pytest.raises(errors.LocalEntryNotFoundError) as e:
        hf.hf_hub_download("org/never", "config.json", cache_dir=tmp_path, local_files_only=True)
    assert type(e.value) is errors.LocalEntryNotFoundError
    with pytest.raises(errors.LocalEntryNotFoundError):
        snapshot(hub, "org/never", tmp_path, local_files_only=True)


def test_offline_incomplete_snapshot(tmp_path, tiny, online):
    with StandinHub([tiny]) as hub:
        snapshot(hub, "org/tiny", tmp_path, allow_patterns="*.json")
    with pytest.raises(errors.IncompleteSnapshotError) as e:
        snapshot(hub, "org/tiny", tmp_path)  # hub down, snapshot folder lacks the weights
    assert "model.safetensors" in str(e.value) and Path(e.value.snapshot_path).name == tiny.sha
    assert Path(snapshot(hub, "org/tiny", tmp_path, allow_patterns="*.json")).name == tiny.sha


def test_corrupted_body_is_not_detected_by_huggingface_hub(tmp_path, tiny, online):
    with StandinHub([tiny]) as hub:
        hub.corrupt("org/tiny/model.safetensors")
        path = Path(snapshot(hub, "org/tiny", tmp_path, allow_patterns="*.safetensors")) / "model.safetensors"
    got, want = path.read_bytes(), SMALL["model.safetensors"]
    assert len(got) == len(want) and got != want  # size check passes; no sha256 verification
    blob = path.resolve()
    assert blob.name == hashlib.sha256(want).hexdigest() != hashlib.sha256(got).hexdigest()


@pytest.fixture(scope="module")
def big() -> bytes:
    return random.Random(1234).randbytes(12 * MiB)  # > DOWNLOAD_CHUNK_SIZE (10 MiB): see the docstring


def test_in_call_resume_uses_range_after_a_dropped_connection(tmp_path, big, online):
    repo = HubRepo("org/big", {"config.json": b"{}", "model.safetensors": big})
    key = "org/big/model.safetensors"
    with StandinHub([repo]) as hub:
        hub.disconnect_at(key, 11 * MiB)
        path = hf.hf_hub_download("org/big", "model.safetensors", cache_dir=tmp_path, endpoint=hub.endpoint,
                                  token=False)
        assert [r.range for r in hub.gets(key)] == [None, f"bytes={10 * MiB}-"]  # 10 MiB had been written
        assert hub.bytes_served[key] == 11 * MiB + 2 * MiB
    assert Path(path).read_bytes() == big


SCRIPT = textwrap.dedent("""
    import sys
    from huggingface_hub import snapshot_download
    print(snapshot_download(sys.argv[1]), flush=True)
""")


def test_killed_download_leaves_orphan_incomplete_and_rerun_restarts_the_file(tmp_path, big):
    files = {**SMALL, "model.safetensors": big}
    repo = HubRepo("org/big", files)
    key = "org/big/model.safetensors"
    home = tmp_path / "home"
    storage = home / "hub" / "models--org--big"
    blobs, snap = storage / "blobs", storage / "snapshots" / repo.sha
    pattern = f"{repo.etag('model.safetensors')}.*.incomplete"  # <sha256>.<8 hex>.incomplete
    with StandinHub([repo]) as hub:
        env = hub.subprocess_env(home)  # configured by environment only: no endpoint/cache_dir arguments
        hub.throttle(key, 40 * MiB)
        hub.stall(key, 11 * MiB)
        child = subprocess.Popen([sys.executable, "-c", SCRIPT, "org/big"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            hub.wait_for_bytes(key, 11 * MiB, timeout=30)
            # wait until the child has flushed its first 10 MiB chunk and finished the small files
            deadline = time.monotonic() + 10
            while not (sum(p.stat().st_size for p in blobs.glob(pattern)) == 10 * MiB
                       and all((snap / f).exists() for f in SMALL if f != "model.safetensors")):
                assert time.monotonic() < deadline and child.poll() is None
                time.sleep(0.02)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        assert child.returncode == -signal.SIGKILL
        (orphan,) = blobs.glob(pattern)
        assert not (snap / "model.safetensors").exists()
        hub.unstall(key)
        hub.throttle(key, None)
        mark = len(hub.request_log)

        done = subprocess.run([sys.executable, "-c", SCRIPT, "org/big"], env=env, capture_output=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        assert done.stdout.decode().strip() == str(snap)
        second = hub.request_log[mark:]
        file_requests = [r for r in second if "/resolve/" in r.path]
        # the big file is fetched again from byte 0 (no Range), the finished small files are not touched
        assert file_requests == [("HEAD", f"/org/big/resolve/{repo.sha}/model.safetensors", None),
                                 ("GET", f"/org/big/resolve/{repo.sha}/model.safetensors", None)]
        assert [r.path for r in second if "/resolve/" not in r.path] == ["/api/models/org/big/revision/main"]
    assert read_tree(snap) == files
    assert orphan.exists() and orphan.stat().st_size == 10 * MiB  # never reused nor cleaned up

    # HF_HUB_OFFLINE=1 in a fresh process (hub closed anyway): the cached snapshot is served
    offline = subprocess.run([sys.executable, "-c", SCRIPT, "org/big"], env=hub.subprocess_env(home, offline=True),
                             capture_output=True, timeout=60, check=False)
    assert offline.returncode == 0, offline.stderr.decode()[-2000:]
    assert offline.stdout.decode().strip() == str(snap)


def test_subprocess_env_gated_token_and_missing_offline(tmp_path):
    gated = HubRepo("org/gated", {"config.json": b"{}"}, gated=True)
    script = textwrap.dedent("""
        import sys, json
        from huggingface_hub import snapshot_download, constants
        try:
            print(json.dumps({"path": snapshot_download(sys.argv[1]), "offline": constants.HF_HUB_OFFLINE}))
        except Exception as e:
            print(json.dumps({"error": type(e).__name__}))
    """)

    def run(env):
        out = subprocess.run([sys.executable, "-c", script, "org/gated"], env=env, capture_output=True, timeout=60, check=False)
        return json.loads(out.stdout.decode().strip().splitlines()[-1])

    with StandinHub([gated]) as hub:
        ok = run(hub.subprocess_env(tmp_path, token=StandinHub.token))  # HF_TOKEN is read at call time
        assert ok["offline"] is False and Path(ok["path"], "config.json").read_bytes() == b"{}"
        assert run(hub.subprocess_env(tmp_path / "other")) == {"error": "GatedRepoError"}
        mark = len(hub.request_log)
        assert run(hub.subprocess_env(tmp_path / "third", offline=True)) == {"error": "LocalEntryNotFoundError"}
        assert hub.request_log[mark:] == []  # HF_HUB_OFFLINE=1: not a single request
