"""The app's engine: loaded in a background thread, so the page is up at once, and switchable to
another model pair while the server runs."""

from __future__ import annotations

import threading
from typing import Callable

from ..core.errors import SpecchatError


class EngineHandle:
    """`get()` waits for the current load and returns its engine or raises its error. `switch`
    starts loading another model; requests keep the engine they got until their answer ends."""

    def __init__(self, load: Callable[[str], object], model: str):
        self._load_model = load
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._engine = None
        self._error: Exception | None = None
        self.model = model
        self._start(model)

    def _start(self, model: str) -> None:
        ready = threading.Event()
        with self._lock:
            self.model, self._ready, self._engine, self._error = model, ready, None, None
        threading.Thread(target=self._load, args=(model, ready), daemon=True).start()

    def _load(self, model: str, ready: threading.Event) -> None:
        engine, error = None, None
        try:
            engine = self._load_model(model)
        except Exception as failure:  # shown in the app instead of killing the server
            error = failure
        with self._lock:
            if self._ready is ready:  # a later switch supersedes this load
                self._engine, self._error = engine, error
            ready.set()

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
