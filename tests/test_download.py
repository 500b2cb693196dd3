"""Downloads with the real huggingface_hub against the loopback stand-in hub: only the needed
files, progress, resume after a kill and after a broken connection, integrity, disk space,
gated repos, offline mode, removal; and the CLI on top (`specchat models ...`, loading the pair)."""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from hub_pairs import DRAFT_REPO, TARGET_REPO, UNWANTED, build_tiny_pair
from standin_hub import StandinHub, hub_online
from test_cli import SPECCHAT, assert_bad_input

from specchat.core import download, hub_requests, model_cache
from specchat.core.download import download_pair
from specchat.core.hub_requests import DownloadCancelled, DownloadError
from specchat.core.model_cache import NotDownloaded, model_status, remove_pair
from specchat.core.files import human_size
from specchat.core.registry import load_registry

TARGET_WEIGHTS = f"{TARGET_REPO}/model.safetensors"


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """A private Hub cache and specchat cache for this process (huggingface_hub read its
    cache location at import, so the constant itself is pointed at the test's folder)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "specchat"))
    return tmp_path


@pytest.fixture
def registry(tiny_pair, tmp_path):
    models_file = tmp_path / "models.toml"
    models_file.write_text(tiny_pair.models_toml())
    return load_registry(models_file)


def snapshot_files(model) -> dict[str, bytes]:
    folder = model_cache.snapshot_folder(model)
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def test_downloads_only_the_needed_files_with_progress(hub, caches, registry, tiny_pair, capfd):
    from huggingface_hub.utils import are_progress_bars_disabled

    pair = registry.get("tiny")
    events = []
    with hub_online():
        paths = download_pair(pair, events.append, endpoint=hub.endpoint)
    # Our progress only: none of huggingface_hub's bars (its final snapshot_download would print
    # "Fetching N files"), and its bars stay on for everyone else.
    assert "Fetching" not in capfd.readouterr().err and not are_progress_bars_disabled()
    for model, repo in ((pair.target, tiny_pair.target), (pair.draft, tiny_pair.draft)):
        assert snapshot_files(model) == tiny_pair.wanted(repo)  # byte for byte, no pickle, no README
        assert model_status(model).complete
    assert set(paths) == {"target", "draft"}
    assert not any(name in request.path for request in hub.request_log for name in UNWANTED)
    done = [event.done_bytes for event in events]
    assert done == sorted(done) and done[-1] == events[-1].total_bytes == pair.download_bytes

    gets = len(hub.gets())
    with hub_online():
        download_pair(pair, endpoint=hub.endpoint)
    assert len(hub.gets()) == gets  # nothing fetched again


@pytest.mark.parametrize("size, text", [(0, "0.0 KB"), (4_096, "4.1 KB"), (999_000, "999.0 KB"),
                                        (1_000_000, "1.0 MB"), (16_200_000_000, "16.2 GB")])
def test_sizes_for_people(size, text):
    assert human_size(size) == text


def test_a_broken_connection_resumes_with_a_range_request(hub, caches, registry, tiny_pair):
    size = len(tiny_pair.target.files["model.safetensors"])
    hub.disconnect_at(TARGET_WEIGHTS, size // 2)
    with hub_online():
        download_pair(registry.get("tiny"), endpoint=hub.endpoint)
    ranges = [request.range for request in hub.gets(TARGET_WEIGHTS)]
    assert ranges[0] is None and ranges[1] is not None and int(ranges[1].split("=")[1].rstrip("-")) > 0
    assert snapshot_files(registry.get("tiny").target)["model.safetensors"] == tiny_pair.target.files["model.safetensors"]


def test_a_corrupt_file_is_caught_deleted_and_reported(hub, caches, registry):
    pair = registry.get("tiny")
    hub.corrupt(TARGET_WEIGHTS)
    with hub_online(), pytest.raises(DownloadError, match="integrity check"):
        download_pair(pair, endpoint=hub.endpoint)
    assert len(hub.gets(TARGET_WEIGHTS)) == 2  # fetched once more before giving up
    assert not model_status(pair.target).complete
    assert not list((model_cache.hub_cache()).rglob("*.specchat-part"))
    hub.corrupt(TARGET_WEIGHTS, enabled=False)
    with hub_online():
        download_pair(pair, endpoint=hub.endpoint)
    assert model_status(pair.target).complete


def test_too_little_disk_space_is_refused_before_any_download(hub, caches, registry, monkeypatch):
    # The real free space of the test's disk, and a reserve larger than it.
    monkeypatch.setattr(download, "DISK_MARGIN_BYTES", shutil.disk_usage(caches).free)
    with hub_online(), pytest.raises(DownloadError, match="not enough disk space"):
        download_pair(registry.get("tiny"), endpoint=hub.endpoint)
    assert hub.gets() == []


class _FillingDisk:
    """A partial file on a disk with `room` bytes left: writes what fits, then ENOSPC, as a full
    disk does (a short write, then the error)."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data: bytes) -> int:
        fits = min(len(data), self.room)
        self.room -= self.file.write(data[:fits])
        if fits < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fits

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_a_full_disk_mid_file_says_so_keeps_the_part_and_resumes(hub, caches, registry, tiny_pair, monkeypatch):
    """The disk fills up (after the space check) halfway through the target's weights: one line
    saying so, the partial file kept, and a later download with room resumes it and verifies."""
    pair = registry.get("tiny")
    weights = tiny_pair.target.files["model.safetensors"]
    size, room = len(weights), len(weights) // 2
    weights_part = f"{hashlib.sha256(weights).hexdigest()}.specchat-part"  # named by the Hub's sha256
    disk = {"full": True}

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        file = builtins.open(path, mode, *args, **kwargs)
        full = disk["full"] and mode.startswith(("w", "a")) and os.path.basename(path) == weights_part
        return _FillingDisk(file, room) if full else file

    monkeypatch.setattr(download, "open", open_on_a_full_disk, raising=False)  # shadows the builtin there
    with hub_online(), pytest.raises(DownloadError) as failure:
        download_pair(pair, endpoint=hub.endpoint)
    message = str(failure.value)
    assert message.startswith("the disk is full: ") and "\n" not in message
    assert f"stopped at {human_size(room)} of {human_size(size)}" in message and "run the download again" in message
    parts = list(model_cache.hub_cache().rglob("*.specchat-part"))
    assert [(part.name, part.stat().st_size) for part in parts] == [(weights_part, room)]
    assert not model_status(pair.target).complete

    disk["full"] = False  # space was freed
    with hub_online():
        download_pair(pair, endpoint=hub.endpoint)
    assert [request.range for request in hub.gets(TARGET_WEIGHTS)][-1] == f"bytes={room}-"
    assert model_status(pair.target).complete and model_status(pair.draft).complete
    assert snapshot_files(pair.target)["model.safetensors"] == tiny_pair.target.files["model.safetensors"]


def test_gated_repos_need_a_token(embedded_dir, tmp_path, caches):
    gated = build_tiny_pair(embedded_dir, tmp_path / "gated", gated=True)
    (tmp_path / "models.toml").write_text(gated.models_toml())
    pair = load_registry(tmp_path / "models.toml").get("tiny")
    with StandinHub(gated.repos) as server, hub_online():
        with pytest.raises(DownloadError, match="is gated.*hf auth login"):
            download_pair(pair, endpoint=server.endpoint, token=False)
        download_pair(pair, endpoint=server.endpoint, token=StandinHub.token)
    assert model_status(pair.target).complete


def test_a_wrong_revision_or_repo_is_reported(hub, caches, tiny_pair, tmp_path):
    text = tiny_pair.models_toml()
    for wrong, message in ((tiny_pair.target.sha, "has no revision"), (TARGET_REPO, "not found on the Hub")):
        replacement = "0" * 40 if wrong == tiny_pair.target.sha else "specchat-test/missing"
        (tmp_path / "models.toml").write_text(text.replace(wrong, replacement, 1))
        with hub_online(), pytest.raises(DownloadError, match=message):
            download_pair(load_registry(tmp_path / "models.toml").get("tiny"), endpoint=hub.endpoint)


def test_offline_mode_uses_the_cache_and_names_what_is_missing(hub, caches, registry):
    pair = registry.get("tiny")
    with pytest.raises(NotDownloaded, match="not downloaded.*specchat models download tiny"):
        download_pair(pair, offline=True)
    with hub_online():
        paths = download_pair(pair, endpoint=hub.endpoint)
    hub.close()
    assert download_pair(pair, offline=True) == paths
    (model_cache.snapshot_folder(pair.draft) / "tokenizer.json").unlink()
    with pytest.raises(NotDownloaded, match="missing tokenizer.json"):
        download_pair(pair, offline=True)



@pytest.mark.slow
def test_an_unreachable_hub_is_reported_after_its_retries(hub, caches, registry):
    hub.close()  # the listing is tried 6 times, 23 s in all (huggingface_hub's own backoff, as before)
    started = time.monotonic()
    with hub_online(), pytest.raises(DownloadError, match="cannot reach the Hub"):
        download_pair(registry.get("tiny"), endpoint=hub.endpoint)
    assert 20 < time.monotonic() - started < 40


class Background:
    """download_pair in a thread, with a cancel event: how it ended, and when."""

    def __init__(self, pair, endpoint: str):
        self.cancel = threading.Event()
        self.outcome: BaseException | dict | None = None
        self.ended = 0.0
        self.thread = threading.Thread(target=self._run, args=(pair, endpoint), daemon=True)
        self.thread.start()

    def _run(self, pair, endpoint) -> None:
        try:
            self.outcome = download_pair(pair, endpoint=endpoint, cancel=self.cancel)
        except BaseException as error:
            self.outcome = error
        self.ended = time.monotonic()

    def cancel_and_wait(self, timeout: float = 40) -> float:
        """Cancel; seconds until download_pair returned or raised."""
        cancelled = time.monotonic()
        self.cancel.set()
        self.thread.join(timeout)
        return (self.ended or time.monotonic()) - cancelled


def test_cancel_while_the_hub_is_unreachable_ends_at_once_as_cancelled(hub, caches, registry):
    """The page stayed "cancelling…" through huggingface_hub's own retries of the listing (about
    23 s), then the download ended as "failed: cannot reach the Hub"."""
    hub.close()
    with hub_online():
        download = Background(registry.get("tiny"), hub.endpoint)
        time.sleep(1.5)  # the first try failed: it waits before the next
        took = download.cancel_and_wait()
    assert isinstance(download.outcome, DownloadCancelled), download.outcome
    assert took < 2


def test_cancel_while_the_listing_gets_no_answer_ends_at_once(hub, caches, registry):
    hub.hold("/api/models/")  # connected, but the listing never answers
    with hub_online():
        download = Background(registry.get("tiny"), hub.endpoint)
        time.sleep(1)
        took = download.cancel_and_wait(timeout=5)
        hub.release("/api/models/")
        download.thread.join(30)
    assert isinstance(download.outcome, DownloadCancelled), download.outcome
    assert took < 2


def test_a_listing_that_gets_no_answer_or_a_server_error_is_tried_again(hub, caches, registry, monkeypatch):
    """huggingface_hub's listing waited for an answer without a timeout; now it times out like a
    file's request, and both that and a 503 are tried again after a pause."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    monkeypatch.setattr(hub_requests, "RETRY_PAUSES", (0.1,) * 5)
    hub.hold("/api/models/", times=1)
    hub.fail("/api/models/", 503, times=2)
    pair = registry.get("tiny")
    with hub_online():
        background = Background(pair, hub.endpoint)
        background.thread.join(20)
        hub.release("/api/models/")
        background.thread.join(30)
    assert isinstance(background.outcome, dict), background.outcome
    assert model_status(pair.target).complete and model_status(pair.draft).complete
    first_file = next(i for i, request in enumerate(hub.request_log) if "/resolve/" in request.path)
    listings = [request.path.split("/")[4] for request in hub.request_log[:first_file] if "/tree/" in request.path]
    assert listings == ["tiny-target"] * 4 + ["tiny-draft"]  # the target's: no answer, 503, 503, listed


def test_cancel_while_a_file_stalls_ends_at_once_and_keeps_what_arrived(hub, caches, registry, tiny_pair):
    """A cancel waited for the stalled read to time out (10 s by default)."""
    size = len(tiny_pair.target.files["model.safetensors"])
    hub.stall(TARGET_WEIGHTS, size // 3)
    with hub_online():
        download = Background(registry.get("tiny"), hub.endpoint)
        hub.wait_for_bytes(TARGET_WEIGHTS, size // 3)
        time.sleep(0.5)
        took = download.cancel_and_wait()
        hub.unstall(TARGET_WEIGHTS)
    assert isinstance(download.outcome, DownloadCancelled), download.outcome
    assert took < 2
    parts = list(model_cache.hub_cache().rglob("*.specchat-part"))
    assert [part.stat().st_size for part in parts] == [size // 3]  # every byte that arrived, for the resume


def test_remove_keeps_models_another_downloaded_pair_uses(hub, caches, tiny_pair, tmp_path):
    (tmp_path / "models.toml").write_text(tiny_pair.models_toml("tiny") + tiny_pair.models_toml("other"))
    registry = load_registry(tmp_path / "models.toml")
    with hub_online():
        download_pair(registry.get("tiny"), endpoint=hub.endpoint)
    removed, kept = remove_pair(registry.get("tiny"), registry)
    assert removed == [] and kept == [TARGET_REPO, DRAFT_REPO]  # "other" is the same two models
    (tmp_path / "models.toml").write_text(tiny_pair.models_toml("tiny"))
    registry = load_registry(tmp_path / "models.toml")
    removed, kept = remove_pair(registry.get("tiny"), registry)
    assert removed == [TARGET_REPO, DRAFT_REPO] and kept == []
    assert not any(model_cache.hub_cache().iterdir())


def cli(*args, env, timeout=600):
    return subprocess.run([SPECCHAT, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_cli_download_killed_mid_file_resumes_and_the_pair_generates(hub, tiny_pair, tmp_path):
    """The issue's acceptance test: `specchat models download` killed mid-file, run again,
    finishes without fetching completed files again; the loaded pair generates."""
    models_file = tmp_path / "models.toml"
    models_file.write_text(tiny_pair.models_toml())
    env = hub.subprocess_env(tmp_path / "hf", base={**os.environ, "SPECCHAT_CACHE_DIR": str(tmp_path / "specchat")})
    size = len(tiny_pair.target.files["model.safetensors"])
    hub.throttle(TARGET_WEIGHTS, size / 4)  # about 4 s for the target's weights

    first = subprocess.Popen([SPECCHAT, "models", "download", "tiny", "--models-file", models_file], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    hub.wait_for_bytes(TARGET_WEIGHTS, size // 3, timeout=120)
    first.send_signal(signal.SIGKILL)
    first.wait()
    parts = list((tmp_path / "hf" / "hub").rglob("*.specchat-part"))
    kept = parts[0].stat().st_size if len(parts) == 1 else 0
    assert 0 < kept < size
    finished_before = {request.path for request in hub.gets() if "model.safetensors" not in request.path}
    hub.throttle(TARGET_WEIGHTS, None)

    listing = json.loads(cli("models", "list", "--json", "--models-file", models_file, env=env).stdout)
    tiny = next(row for row in listing if row["id"] == "tiny")
    assert tiny["status"].startswith("partly") and not tiny["downloaded"]

    gets_before = len(hub.gets())
    second = cli("models", "download", "tiny", "--models-file", models_file, env=env)
    assert second.returncode == 0, second.stderr
    again = hub.gets()[gets_before:]
    assert not {request.path for request in again} & finished_before  # completed files not fetched again
    resumed = [request for request in again if request.path.endswith(TARGET_WEIGHTS.split("/", 2)[2])
               and TARGET_REPO in request.path]
    assert [request.range for request in resumed] == [f"bytes={kept}-"]  # one request, from where it stopped
    listing = json.loads(cli("models", "list", "--json", "--models-file", models_file, env=env).stdout)
    assert next(row for row in listing if row["id"] == "tiny")["downloaded"]

    hub.close()  # offline from here on: the pair loads from the cache
    offline_env = {**env, "HF_HUB_OFFLINE": "1"}
    outputs = {}
    for mode in ("plain", "tree"):
        run = cli("generate", "--model", "tiny", "--models-file", models_file, "--prompt", "Hello there",
                  "--max-new-tokens", "12", "--mode", mode, "--json", env=offline_env)
        assert run.returncode == 0, run.stderr
        outputs[mode] = json.loads(run.stdout)
    assert outputs["tree"]["token_ids"] == outputs["plain"]["token_ids"]  # lossless with the pair's draft
    assert outputs["plain"]["new_tokens"] == 12
    assert "tree_plan" in outputs["tree"]


def test_cli_models_errors_are_one_line(tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text("[pairs.tiny]\nname = 'x'\nsource = 'hub'\ncontext_length = 'long'\n")
    env = {**os.environ}
    assert_bad_input(cli("models", "list", "--models-file", bad, env=env), f"{bad}:4", "context_length")
    bad.write_text("[pairs.tiny\n")
    assert_bad_input(cli("models", "download", "tiny", "--models-file", bad, env=env), "not valid TOML")
    assert_bad_input(cli("models", "download", "no-such-pair", env=env), "unknown model pair 'no-such-pair'")
    assert_bad_input(cli("generate", "--model", "no-such-pair", "--prompt", "hi", env=env), "unknown model pair")
    assert_bad_input(cli("models", "list", "--models-file", tmp_path / "missing.toml", env=env), "no such file")


def test_cli_models_list_shows_size_fit_and_status(tmp_path):
    env = {**os.environ, "SPECCHAT_CACHE_DIR": str(tmp_path)}  # a fresh machine: no hardware profile cached
    run = cli("models", "list", env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split()[:2] == ["ID", "DOWNLOAD"]
    rows = {line.split()[0]: line for line in lines[1:] if line.strip() and not line.startswith("Fit")}
    assert {"embedded", "llama3.1-8b", "qwen2.5-7b", "qwen3-8b"} <= set(rows)
    assert "18.6 GB" in rows["llama3.1-8b"] and "built in" in rows["embedded"]
    assert lines[-1].startswith("Fit is the plan `specchat plan --pair ID --context N` shows")
    listing = json.loads(cli("models", "list", "--json", env=env, timeout=120).stdout)
    for row in listing:  # the verdict the table shows, from the plan at the pair's full context
        assert f"  {row['fit']}  " in rows[row["id"]] and row["fits"] == row["fit"].startswith("fits")
        assert row["fit_reason"] and (row["fits"] or row["fit_reason"].startswith(
            f"{row['id']} at {row['context_length']:,} tokens does not fit"))
    assert not (tmp_path / "hardware").exists()  # listing measured (and saved) nothing
