"""Model downloads from the Hugging Face Hub, on `huggingface_hub`.

Files go to the standard Hub cache, in its layout (blobs/ named by hash, snapshots/<commit>/
linking to them), so other tools share them and `HF_HUB_CACHE` or `HF_HOME` move them.
specchat fetches only what it loads: safetensors weights, configs and tokenizer files, never
pickled weights.

huggingface_hub 2.4 lists the repo and knows the cache, but it cannot resume a file across
processes (each download streams into a file name unique to its process, orphaned by a kill), so
specchat moves the bytes itself: each file streams into `blobs/<hash>.specchat-part`, a rerun
continues it with an HTTP Range request, a stalled or broken connection is retried from where it
stopped, and the file is checked against the hash the Hub lists for it (sha256 for LFS files,
the git blob sha1 for the others) before it joins the cache, and the model's manifest
(`model_cache.py`) records the files it needs. specchat lists the repo itself too: the library
retries its listing for about 23 s (and waits for an answer without a timeout) where a cancel
cannot reach it.

A download can be cancelled within a fraction of a second in every phase: every request runs in
a helper thread while the download's own thread watches the cancel event, writes the files and
reports progress (`hub_requests.Hub.watched`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError
from .files import human_size
from .model_cache import (has_file, hub_cache, is_offline, local_model_path, model_status, read_manifest, repo_folder,
                          snapshot_folder, write_manifest)
from .registry import ModelPair, ModelSpec
from . import hub_requests
from .hub_requests import DownloadError, Hub, list_files

ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.jinja", "tokenizer.model"]
# Pickled or unused formats, and Meta's original/ folder of .pth weights.
IGNORE_PATTERNS = ["original/*", "*.pth", "*.pt", "*.bin", "*.ckpt", "*.h5", "*.msgpack", "*.gguf",
                   "*.onnx", "onnx/*"]
DISK_MARGIN_BYTES = 1 << 30  # leave at least 1 GiB free after a download
HASH_CHUNK = 1 << 24


@dataclass(frozen=True)
class DownloadProgress:
    model: str  # repo id
    filename: str
    done_bytes: int  # over all files of this download, resumed parts included
    total_bytes: int


ProgressCallback = Callable[[DownloadProgress], None]


def download_pair(pair: ModelPair, progress: ProgressCallback | None = None, token: str | None = None,
                  offline: bool | None = None, endpoint: str | None = None,
                  cancel: threading.Event | None = None) -> dict[str, Path]:
    """Make every model of a hub pair available locally: {"target": path, "draft": path}.
    `cancel`: set, the download stops with `DownloadCancelled` within `hub_requests.CANCEL_POLL_SECONDS`, in
    every phase (listing, a pause between tries, a connection that stalls); a partial file is
    kept, to resume.

    A pair already downloaded and verified is returned from the cache without any request.
    Offline (the argument, or `HF_HUB_OFFLINE=1`) it only looks in the cache. Otherwise it lists
    the needed files, checks the disk has room for what is still missing, fetches the missing
    files (resuming partial ones) with progress, and verifies each one.
    """
    if pair.source != "hub":
        raise InputError(f"{pair.id} is not downloaded from the Hub ({pair.source} model)")
    offline = is_offline() if offline is None else offline
    roles = {"target": pair.target} if pair.draft is None else {"target": pair.target, "draft": pair.draft}
    if offline or all(model_status(model).complete for model in roles.values()):
        # A complete, verified download needs no network: it loads while the Hub is down.
        return {role: local_model_path(model, pair.id) for role, model in roles.items()}
    hub = Hub(pair, token, endpoint, cancel)
    plans = {role: _plan(model, hub) for role, model in roles.items()}
    hub.stop_if_cancelled()
    _check_disk_space(sum(plan.missing_bytes for plan in plans.values()))
    counter = _ProgressCounter(progress, sum(plan.total_bytes for plan in plans.values()),
                               sum(plan.cached_bytes for plan in plans.values()))
    return {role: _fetch(plan, hub, counter) for role, plan in plans.items()}


@dataclass(frozen=True)
class _RemoteFile:
    name: str
    size: int
    digest: str  # sha256 (LFS) or git blob sha1: the blob's name in the cache


@dataclass(frozen=True)
class _Plan:
    model: ModelSpec
    files: tuple[_RemoteFile, ...]
    to_fetch: tuple[_RemoteFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(file.size for file in self.files)

    @property
    def cached_bytes(self) -> int:
        """Complete files already in the cache (partial ones count as their download resumes)."""
        return self.total_bytes - sum(file.size for file in self.to_fetch)

    @property
    def missing_bytes(self) -> int:
        return sum(file.size - _part_size(self.model, file) for file in self.to_fetch)


def _plan(model: ModelSpec, hub: Hub) -> _Plan:
    from huggingface_hub.utils import filter_repo_objects

    entries = list_files(model, hub)
    wanted = set(filter_repo_objects([entry.path for entry in entries], allow_patterns=ALLOW_PATTERNS,
                                     ignore_patterns=IGNORE_PATTERNS))
    files = tuple(_RemoteFile(entry.path, entry.lfs.size if entry.lfs else entry.size,
                              entry.lfs.sha256 if entry.lfs else entry.blob_id)
                  for entry in entries if entry.path in wanted)
    if not any(file.name.endswith(".safetensors") for file in files):
        raise DownloadError(f"{model.repo}@{model.revision[:8]} has no safetensors weights; specchat "
                            "never loads pickled weights: choose another revision or model")
    sizes = {file.name: file.size for file in files}
    manifest = read_manifest(model) or {}
    write_manifest(model, sizes, verified=bool(manifest.get("verified")) and manifest.get("files") == sizes)
    snapshot = snapshot_folder(model)
    to_fetch = tuple(file for file in files if not has_file(snapshot / file.name, file.size))
    return _Plan(model, files, to_fetch)


def _fetch(plan: _Plan, hub: Hub, counter: _ProgressCounter) -> Path:
    from huggingface_hub import snapshot_download

    model = plan.model
    for file in plan.to_fetch:
        counter.start(model.repo, file.name)
        _fetch_file(model, file, hub, counter)
    # Let huggingface_hub see the snapshot as complete (it caches the tree listing), so other
    # tools, and its own offline mode, find it. Every file is in place: nothing is fetched, so its
    # "Fetching N files" bars would only repeat our progress; they are off for this call alone.
    folder = Path(hub.call(model, lambda: hub.run(lambda: snapshot_download(
        model.repo, revision=model.revision, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
        cache_dir=hub_cache(), token=hub.token, endpoint=hub.endpoint, tqdm_class=_hidden_bars()))))
    write_manifest(model, {file.name: file.size for file in plan.files}, verified=True)
    return folder


def _hidden_bars() -> type:
    """huggingface_hub's progress bar class, always disabled: passed as one call's `tqdm_class`, it
    hides that call's bars without `disable_progress_bars()`, which is global (other threads'
    downloads and loads would lose theirs too)."""
    from huggingface_hub.utils import tqdm

    class HiddenBar(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    return HiddenBar


def _part_path(model: ModelSpec, file: _RemoteFile) -> Path:
    return repo_folder(model) / "blobs" / f"{file.digest}.specchat-part"


def _part_size(model: ModelSpec, file: _RemoteFile) -> int:
    try:
        return _part_path(model, file).stat().st_size
    except OSError:
        return 0


def _fetch_file(model: ModelSpec, file: _RemoteFile, hub: Hub, counter: _ProgressCounter) -> None:
    """Download one file into its blob (resuming a partial one), verify it, link it into the snapshot."""
    blob = repo_folder(model) / "blobs" / file.digest
    if not (blob.is_file() and blob.stat().st_size == file.size and _blob_matches(blob)):
        part = _part_path(model, file)
        part.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(2):  # a corrupt file is fetched once more from scratch
            counter.resume(_part_size(model, file))
            _transfer(model, file, part, hub, counter)
            if _blob_matches(part, file.digest):
                break
            part.unlink()
            counter.resume(0)
            if attempt:
                raise DownloadError(f"{model.repo}: {file.name} failed the integrity check twice (its hash does "
                                    "not match the Hub's); the partial file was deleted, run the download again")
        os.replace(part, blob)
    _link(blob, snapshot_folder(model) / file.name)


def _transfer(model: ModelSpec, file: _RemoteFile, part: Path, hub: Hub, counter: _ProgressCounter) -> None:
    """Stream the rest of `file` into `part`; a broken or stalled connection resumes where it stopped.
    The bytes are written as they arrive, so a cancel keeps every one of them."""
    import httpx2
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(model.repo, file.name, revision=model.revision, endpoint=hub.endpoint)

    def body(headers: dict) -> Iterator[int | bytes]:
        """The answer's status, then its body: made in `hub.watched`'s helper thread."""
        with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                  timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
            hub.call(model, lambda: hf_raise_for_status(response))
            yield response.status_code
            yield from response.iter_bytes()

    for attempt, pause in enumerate(hub_requests.RETRY_PAUSES + (None,)):
        hub.stop_if_cancelled()
        start = part.stat().st_size if part.exists() else 0
        if start >= file.size:
            return
        headers = build_hf_headers(token=hub.token, headers={"Range": f"bytes={start}-"} if start else None)
        try:
            with closing(hub.watched(lambda headers=headers: body(headers))) as answer:
                if next(answer) != 206 and start:  # the server ignored the range: start over
                    start = 0
                    counter.resume(0)
                with open(part, "ab" if start else "wb") as out:
                    for chunk in answer:
                        out.write(chunk)
                        counter.advance(len(chunk))
            if part.stat().st_size >= file.size:
                return
        except OSError as error:
            raise _write_error(error, model, file, part) from None
        except httpx2.TransportError as error:
            hub.stop_if_cancelled()  # a stalled connection cancelled meanwhile: no "failed after N tries"
            if pause is None:
                raise DownloadError(
                    f"downloading {model.repo} {file.name} failed after {attempt + 1} tries ({type(error).__name__}); "
                    f"{human_size(part.stat().st_size if part.exists() else 0)} are kept: run the download again to "
                    "resume") from None
        if pause is not None:
            hub.pause(pause)
    raise DownloadError(f"downloading {model.repo} {file.name} kept ending early; run the download again to resume")


def _write_error(error: OSError, model: ModelSpec, file: _RemoteFile, part: Path) -> DownloadError:
    """One sentence for a failed write of `part`. A full disk (despite the check before the
    download: something else filled it meanwhile) says so; either way the bytes written stay, and
    the next download resumes from them."""
    kept = human_size(part.stat().st_size if part.exists() else 0)
    if error.errno == errno.ENOSPC:
        return DownloadError(f"the disk is full: {model.repo} {file.name} stopped at {kept} of "
                             f"{human_size(file.size)}, kept in {part.parent}; free some space (or point "
                             "HF_HUB_CACHE at another disk) and run the download again to resume")
    return DownloadError(f"cannot write {part}: {error.strerror or error}; {kept} are kept: free some disk space or "
                         "point HF_HUB_CACHE at another disk, then run the download again to resume")


def _link(blob: Path, pointer: Path) -> None:
    """Point the snapshot's file at its blob as huggingface_hub does: a relative symlink, or a
    copy where the file system has no symlinks."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.unlink(missing_ok=True)
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:
        shutil.copyfile(blob, pointer)


def _blob_matches(blob: Path, expected: str | None = None) -> bool:
    """Does the file hash to `expected` (default: its own name, as blobs are named)?"""
    expected = expected or blob.name
    if len(expected) == 64:  # an LFS file: its sha256
        digest = hashlib.sha256()
    elif len(expected) == 40:  # a git file: its git blob sha1
        digest = hashlib.sha1(f"blob {blob.stat().st_size}\0".encode())
    else:
        return True  # a naming scheme this check does not know: nothing to compare against
    with open(blob, "rb") as file:
        while chunk := file.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest() == expected


def _check_disk_space(needed: int) -> None:
    folder = hub_cache()
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed + DISK_MARGIN_BYTES > free:
        raise DownloadError(f"not enough disk space: the download needs {human_size(needed)} (plus {human_size(DISK_MARGIN_BYTES)} "
                            f"to spare) but {folder} has {human_size(free)} free; free some space or point "
                            "HF_HUB_CACHE at a larger disk")


class _ProgressCounter:
    """Bytes over the whole pair, reported as `DownloadProgress`."""

    def __init__(self, callback: ProgressCallback | None, total: int, done: int):
        self.callback, self.total, self.done = callback, total, done
        self.model, self.filename = "", ""
        self.file_start = done

    def start(self, model: str, filename: str) -> None:
        self.model, self.filename = model, filename
        self.file_start = self.done

    def resume(self, file_bytes: int) -> None:
        """The current file now holds `file_bytes` (a resumed part, or 0 after starting over)."""
        self.done = self.file_start + file_bytes
        self._report()

    def advance(self, count: int) -> None:
        self.done += count
        self._report()

    def _report(self) -> None:
        if self.callback is not None:
            self.callback(DownloadProgress(self.model, self.filename, self.done, self.total))
