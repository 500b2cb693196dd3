"""The app's engine: loaded in a background thread, so the page is up at once, switchable to
another model pair while the server runs, and used only from its own thread: the page and the API
`submit` jobs that wait in one line (`engine_queue`)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

from ..core.errors import SpecchatError
from .engine_queue import EngineLine, Job, Ticket


class EngineHandle:
    """`get()` waits for the current load and returns its engine or raises its error. `switch`
    starts loading another model; a job runs on the engine current when its turn comes.
    `submit` and `call` run work on the engine thread; `close` stops that thread."""

    def __init__(self, load: Callable[[str, Callable[[str], None]], object], model: str,
                 max_waiting: int | None = None, stall_seconds: float | None = None):
        """`load(model, progress)` builds the engine, calling `progress(line)` as it goes (a
        download, the first use's calibration): the page shows the latest line."""
        self._load_model = load
        self._progress = ""
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._engine = None
        self._error: Exception | None = None
        self._loaded: str | None = None  # the model last loaded: what a failed switch goes back to
        self._switch_failure = ""  # why the last switch failed, once it went back ("": none)
        self.model = model
        self._line = EngineLine(self.get, max_waiting, stall_seconds, idle_work=self._idle_work)
        self._start(model)

    def _start(self, model: str) -> None:
        ready = threading.Event()
        with self._lock:
            self.model, self._ready, self._engine, self._error = model, ready, None, None
            self._progress = ""
        threading.Thread(target=self._load, args=(model, ready), daemon=True).start()

    def _load(self, model: str, ready: threading.Event) -> None:
        engine, error, failure_note = None, None, ""
        try:
            engine = self._load_model(model, lambda line: self._note(line, ready))
        except Exception as failure:  # shown in the app instead of killing the server
            error = failure
        back = self._loaded
        if error is not None and back not in (None, model):  # a failed switch: the chat keeps a model
            self._note(f"could not load {model} ({error}); loading {back} again…", ready)
            try:
                engine = self._load_model(back, lambda line: self._note(line, ready))
                failure_note = f"could not switch to {model}: {error}; back on {back}"
                error, model = None, back
            except Exception:  # the previous model does not load either: the first failure is the story
                pass
        with self._lock:
            if self._ready is ready:  # a later switch supersedes this load
                self._engine, self._error, self.model = engine, error, model
                self._switch_failure = failure_note
                if error is None:
                    self._loaded = model
            ready.set()
        self._line.wake()  # its first calibration may wait for idle time

    def _note(self, line: str, ready: threading.Event) -> None:
        with self._lock:
            if self._ready is ready:
                self._progress = line.strip()

    def _idle_work(self):
        """The loaded engine's first calibration while it is still to finish, else None; never
        waits for a load (the engine thread asks whenever it is idle)."""
        with self._lock:
            engine = self._engine if self._ready.is_set() else None
        calibration = getattr(engine, "idle_calibration", None)  # stand-in engines of the tests have none
        return calibration if calibration is not None and not calibration.finished else None

    def progress(self) -> str:
        """The loading model's latest progress line ("" when none, or once loaded)."""
        with self._lock:
            return "" if self._ready.is_set() else self._progress

    def switch(self, model: str) -> None:
        """Load `model` in the background; a no-op when it is the model already loaded."""
        with self._lock:
            same = model == self.model and self._error is None
        if not same:
            self._start(model)

    def get(self, timeout: float | None = None):
        with self._lock:
            ready = self._ready
        if not ready.wait(timeout):
            raise SpecchatError(f"{self.model} is still loading: try again in a moment")
        with self._lock:
            if self._error is not None:
                raise SpecchatError(f"the model {self.model} could not be loaded: {self._error}")
            return self._engine

    def status(self) -> str:
        """"loading", "ready" or "failed: <why>", for the page."""
        with self._lock:
            if not self._ready.is_set():
                return "loading"
            return f"failed: {self._error}" if self._error is not None else "ready"

    def switch_note(self) -> str:
        """Why the last switch failed and the chat went back to the model before ("" when none)."""
        with self._lock:
            return f"⚠️ {self._switch_failure}" if self._switch_failure and self._ready.is_set() else ""

    def calibration_note(self) -> str:
        """While the first launch measures this machine's step times between answers, a few words
        saying so (speculation is sized by stated defaults until then), or that it gave up; else ""."""
        with self._lock:
            engine = self._engine if self._ready.is_set() and self._error is None else None
        calibration = getattr(engine, "idle_calibration", None)
        if calibration is None:
            return ""
        if calibration.finished:
            return ("this machine was too busy to measure its speed: default step costs until the next start"
                    if calibration.gave_up else "")
        done = len(calibration.measured)
        return f"measuring this machine's speed between answers ({done} of {done + len(calibration.pending)})"

    def submit(self, job: Job) -> Ticket:
        """Queue `job(engine, cancel)`; raises `engine_queue.Busy` when the line is full."""
        return self._line.submit(job)

    def forget(self, conversation: str) -> None:
        """Free the KV the engine keeps for `conversation` (deleted), in line after its answers;
        without waiting. A full line (the memory budget evicts the KV in time) or one shutting down
        skips it."""
        with contextlib.suppress(SpecchatError):
            self._line.submit(lambda engine, cancel: iter([engine.forget(conversation)]))

    def call(self, fn: Callable[[Any], Any], cancel: threading.Event | None = None):
        """`fn(engine)` run alone on the engine thread, in line with the answers; its result."""
        return self._line.call(fn, cancel)

    def stop_serving(self) -> None:
        """The server is shutting down: every waiting and running job ends now with an error
        (`EngineLine.stop_serving`), so each client still gets its answer."""
        self._line.stop_serving()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (on shutdown): the running answer is cancelled."""
        self._line.close(timeout)
