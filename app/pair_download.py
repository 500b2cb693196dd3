"""A pair's download in the background, for the app: one at a time, with live progress for the
page to poll, and cancel (the partial file is kept, so the next download resumes it)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from ..core.download import DownloadProgress, download_pair
from ..core.hub_requests import DownloadCancelled
from ..core.errors import SpecchatError, first_line
from ..core.files import human_size
from ..core.registry import ModelPair
from .models_cmd import progress_text


@dataclass(frozen=True)
class DownloadSnapshot:
    """The download panel at one moment."""
    pair_id: str | None  # None: nothing downloaded since the app started
    state: str  # "idle", "running", "cancelling", "downloaded", "cancelled" or "failed"
    progress: DownloadProgress | None  # the latest report; None before the first
    rate: float  # bytes per second: so far while running, on average once ended
    error: str = ""  # why it failed


class PairDownload:
    """One pair's download at a time, in a background thread; the page polls `snapshot()`.

    Cancelling sets the download's `cancel` event: download_pair ends with `DownloadCancelled`
    within a fraction of a second in every phase (listing, a pause between tries, a stalled
    connection); the partial file is kept, so the next download resumes it.

    The refusals it gives because a download runs ("is downloading", "still downloading") are
    remembered, so that the page can clear one once that download has ended (`outdated`).
    """

    def __init__(self, endpoint: str | None = None):
        self.endpoint = endpoint  # None: the Hub huggingface_hub is configured for (HF_ENDPOINT)
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._snapshot = DownloadSnapshot(None, "idle", None, 0.0)
        self._started = 0.0
        self._first_done: int | None = None
        self.ended = 0  # downloads ended so far: the pairs table is read again after each
        self._number = 0  # downloads started so far: the current one's number
        self._refusals: dict[str, int] = {}  # a refusal given while a download ran -> that download's number

    def snapshot(self) -> DownloadSnapshot:
        with self._lock:
            current = self._snapshot
            return replace(current, rate=self._rate(current.progress)) if self._active() else current

    def start(self, pair: ModelPair) -> str:
        """Start downloading `pair` unless a download runs: "" when it starts (the progress line
        shows it), else a sentence for the page saying why not."""
        if pair.source != "hub":
            return f"**{pair.id}** is built in: nothing to download."
        with self._lock:
            if self._active():
                return self._refusal(f"**{self._snapshot.pair_id}** is downloading: wait for it, or cancel it first.")
            self._number += 1
            self._snapshot = DownloadSnapshot(pair.id, "running", None, 0.0)
            self._started, self._first_done = time.monotonic(), None
            self._cancel.clear()
        threading.Thread(target=self._download, args=(pair,), daemon=True, name=f"download-{pair.id}").start()
        return ""

    def cancel(self) -> str:
        """"" when it stops (the progress line says so), else a sentence saying why not."""
        with self._lock:
            if not self._active():
                return "No download is running."
            self._cancel.set()
            self._snapshot = replace(self._snapshot, state="cancelling")
            return ""

    def downloading(self, pair_id: str) -> bool:
        with self._lock:
            return self._active() and self._snapshot.pair_id == pair_id

    def still_downloading(self, pair_id: str) -> str | None:
        """Why `pair_id` cannot be used while it downloads, or None when it is not downloading."""
        with self._lock:
            if self._active() and self._snapshot.pair_id == pair_id:
                return self._refusal(f"**{pair_id}** is still downloading: use it once the download ends.")
            return None

    def outdated(self, message: str) -> bool:
        """Is `message` a refusal this gave because a download ran, and has that download ended since?
        The page clears it then: the progress line says how the download ended."""
        with self._lock:
            number = self._refusals.get(message)
            return number is not None and (number != self._number or not self._active())

    def _refusal(self, message: str) -> str:
        """`message`, remembered as given while the current download runs (the lock is held)."""
        self._refusals[message] = self._number
        return message

    def _active(self) -> bool:
        return self._snapshot.state in ("running", "cancelling")

    def _rate(self, progress: DownloadProgress | None) -> float:
        """Bytes per second since this download started, not counting the bytes it found on disk."""
        if progress is None:
            return 0.0
        return (progress.done_bytes - self._first_done) / max(time.monotonic() - self._started, 1e-9)

    def _report(self, progress: DownloadProgress) -> None:
        if self._cancel.is_set():
            raise DownloadCancelled()
        with self._lock:
            if self._first_done is None:
                self._first_done = progress.done_bytes
            self._snapshot = replace(self._snapshot, progress=progress)

    def _download(self, pair: ModelPair) -> None:
        state, error = "downloaded", ""
        try:
            download_pair(pair, self._report, endpoint=self.endpoint, cancel=self._cancel)
        except DownloadCancelled:
            state = "cancelled"
        except SpecchatError as failure:  # DownloadError, NotDownloaded (offline): their sentence
            state, error = "failed", str(failure)
        except Exception as failure:  # shown in the page instead of a dead thread
            state, error = "failed", f"unexpected error: {type(failure).__name__}: {first_line(failure)}"
        with self._lock:
            progress = self._snapshot.progress
            self._snapshot = DownloadSnapshot(pair.id, state, progress, self._rate(progress), error)
            self.ended += 1


def download_markdown(snapshot: DownloadSnapshot) -> str:
    pair, progress = f"**{snapshot.pair_id}**", snapshot.progress
    if snapshot.state == "idle":
        return "No download running. A download cancelled or broken off resumes where it stopped."
    if snapshot.state in ("running", "cancelling"):
        line = f"{pair}: " + (progress_text(progress, snapshot.rate) if progress else "asking the Hub for its files…")
        return line + (" — cancelling…" if snapshot.state == "cancelling" else "")
    if snapshot.state == "downloaded":
        return f"{pair} downloaded" + (
            f": {human_size(progress.total_bytes)}, {human_size(snapshot.rate)}/s on average" if progress else
            " (it was already in the cache)")
    if snapshot.state == "cancelled":
        if progress is None:  # cancelled while it listed the files (or before it fetched one)
            return f"{pair}: download cancelled before it fetched any file; press Download to start it again."
        return (f"{pair}: download cancelled at {human_size(progress.done_bytes)} of "
                f"{human_size(progress.total_bytes)}; press Download to resume it.")
    return f"⚠️ {pair}: {snapshot.error}"
