"""Requests to the Hugging Face Hub that a cancel reaches at once, and the repo listing.

Each request runs in a helper thread while the download's own thread watches the cancel event
(`Hub.watched`); failures become one actionable sentence (`hub_call`). specchat lists a repo
itself: huggingface_hub retries its listing for about 23 s, and waits for an answer without a
timeout, where a cancel cannot reach it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote

from .errors import SpecchatError, first_line
from .registry import ModelPair, ModelSpec

RETRY_PAUSES = (1.0, 2.0, 4.0, 8.0, 8.0)  # seconds between tries of a listing or a transfer (the library's)
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)  # answers a listing tries again after, as huggingface_hub does
MAX_RETRY_AFTER = 60.0  # the longest `Retry-After` a listing waits (seconds)
CANCEL_POLL_SECONDS = 0.1  # how often a download waiting on the network looks at its cancel event
T = TypeVar("T")


class DownloadError(SpecchatError):
    """A download failed (network, integrity, disk space); what was complete stays on disk."""


class DownloadCancelled(Exception):
    """The download was cancelled (its `cancel` set, or its progress callback raised this); the
    partial file stays, to resume."""


@dataclass(frozen=True)
class Hub:
    """Where and as whom to download, and which pair errors are reported for."""
    pair: ModelPair
    token: str | None
    endpoint: str | None
    cancel: threading.Event | None = None

    def call(self, model: ModelSpec, call: Callable[[], T]) -> T:
        """`call()`, a failure turned into one sentence (`hub_call`); a failure once the download
        was cancelled (often because of it) is the cancel."""
        def checked() -> T:
            try:
                return call()
            except Exception:
                self.stop_if_cancelled()
                raise

        return hub_call(checked, model, self.pair)

    def watched(self, items: Callable[[], Iterable[T]]) -> Iterator[T]:
        """What `items()` yields, made in a helper thread while this thread watches the cancel event:
        a cancel raises `DownloadCancelled` here within CANCEL_POLL_SECONDS even while the request
        blocks (a DNS lookup, a connection that stalls, a server that does not answer). The helper
        is then left to end at its own timeout, and what it still makes is dropped: only this thread
        writes files and reports progress. Use it in `contextlib.closing`, so that stopping early
        lets the helper go. Without a cancel event, `items()` runs in this thread."""
        if self.cancel is None:
            yield from items()
            return
        channel: queue.Queue = queue.Queue(maxsize=16)
        stop = threading.Event()

        def send(message: tuple[bool, object]) -> bool:
            while not stop.is_set():
                try:
                    channel.put(message, timeout=CANCEL_POLL_SECONDS)
                    return True
                except queue.Full:
                    pass
            return False

        def make() -> None:
            try:
                made = iter(items())
                try:
                    for item in made:
                        if not send((True, item)):
                            return
                finally:
                    getattr(made, "close", lambda: None)()  # a request's `with` block ends here
            except BaseException as error:  # raised again in the download's thread
                send((False, error))
            else:
                send((False, None))

        threading.Thread(target=make, daemon=True, name="download-request").start()
        try:
            while True:
                try:
                    more, value = channel.get(timeout=CANCEL_POLL_SECONDS)
                except queue.Empty:
                    self.stop_if_cancelled()
                    continue
                self.stop_if_cancelled()
                if more:
                    yield value
                elif value is None:
                    return
                else:
                    raise value
        finally:
            stop.set()

    def run(self, call: Callable[[], T]) -> T:
        """`call()` in a helper thread (`watched`): its result, or `DownloadCancelled` at once on a cancel."""
        with closing(self.watched(lambda: [call()])) as results:
            return next(results)

    def stop_if_cancelled(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise DownloadCancelled()

    def pause(self, seconds: float) -> None:
        """Wait before the next try; a cancel ends the wait at once."""
        if self.cancel is None:
            time.sleep(seconds)
        elif self.cancel.wait(seconds):
            raise DownloadCancelled()


def list_files(model: ModelSpec, hub: Hub) -> list:
    """The files of the model's repo at its revision (`RepoFile`s), as `HfApi.list_repo_tree(recursive=True)`
    lists them, page by page, each page tried as huggingface_hub tries it (`_get_page`)."""
    from huggingface_hub import constants
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import build_hf_headers

    url: str | None = (f"{hub.endpoint or constants.ENDPOINT}/api/models/{model.repo}/tree/"
                       f"{quote(model.revision, safe='')}")
    params: dict | None = {"recursive": True, "expand": False}
    headers = build_hf_headers(token=hub.token)
    files = []
    while url:
        page, url = _get_page(url, params, headers, model, hub)
        params = None  # the next page's link carries them
        files += [RepoFile(**entry) for entry in page if entry.get("type") == "file"]
    return files


def _get_page(url: str, params: dict | None, headers: dict, model: ModelSpec, hub: Hub) -> tuple[list, str | None]:
    """One page of a listing and the next one's link. A broken connection, a timeout or a
    408/429/5xx answer is tried again after each of RETRY_PAUSES (huggingface_hub's backoff), in
    a pause a cancel ends at once."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session, hf_raise_for_status

    for attempt, pause in enumerate(RETRY_PAUSES + (None,)):
        hub.stop_if_cancelled()
        try:
            response = hub.run(lambda: get_session().get(url, params=params, headers=headers, follow_redirects=True,
                                                         timeout=constants.HF_HUB_ETAG_TIMEOUT))
        except httpx2.TransportError as error:
            if pause is None:
                hub.call(model, lambda failure=error: _raise(failure))
            why = type(error).__name__
        else:
            if pause is None or response.status_code not in RETRY_STATUSES:
                hub.call(model, lambda: hf_raise_for_status(response))
                return response.json(), response.links.get("next", {}).get("url")
            pause, why = max(pause, _retry_after(response)), f"HTTP {response.status_code}"
        logging.getLogger(__name__).warning("listing the files of %s failed (%s): try %d of %d in %.0f s", model.repo,
                                            why, attempt + 2, len(RETRY_PAUSES) + 1, pause)
        hub.pause(pause)
    raise AssertionError("unreachable: the last try returns or raises")


def _raise(error: BaseException):
    raise error


def _retry_after(response) -> float:
    """The seconds a 429 or 503 answer asks to wait (`Retry-After`), at most MAX_RETRY_AFTER; 0 without."""
    try:
        return min(float(response.headers.get("Retry-After", "")) + 1, MAX_RETRY_AFTER)
    except ValueError:
        return 0.0


def hub_call(call, model: ModelSpec, pair: ModelPair):
    """Run a huggingface_hub call and turn its failures into one actionable sentence."""
    import httpx2
    from huggingface_hub import errors

    try:
        return call()
    except httpx2.TransportError as error:
        raise DownloadError(f"cannot reach the Hub to download {model.repo} ({type(error).__name__}); check the "
                            "connection, or set HF_HUB_OFFLINE=1 to use only what is cached") from None
    except errors.GatedRepoError:
        raise DownloadError(
            f"{model.repo} is gated: accept its licence ({pair.license}) at https://huggingface.co/{model.repo} "
            "with your account, then log in with `hf auth login` (or set HF_TOKEN) and run the download again"
        ) from None
    except errors.RevisionNotFoundError:
        raise DownloadError(f"{model.repo} has no revision {model.revision}: the registry entry for "
                            f"{pair.id} is out of date") from None
    except errors.RepositoryNotFoundError:
        raise DownloadError(f"{model.repo} was not found on the Hub (or is private): check the registry entry "
                            f"for {pair.id} and your token") from None
    except errors.LocalEntryNotFoundError:
        raise DownloadError(f"cannot reach the Hub to download {model.repo}; check the connection, or use "
                            "what is cached with HF_HUB_OFFLINE=1") from None
    except (errors.HfHubHTTPError, OSError) as error:
        raise DownloadError(f"downloading {model.repo} failed: {first_line(error) or type(error).__name__}; "
                            "run the download again to resume") from None
