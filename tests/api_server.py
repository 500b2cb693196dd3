"""Loopback servers for tests that need real HTTP: the /v1 API (`add_api`) with a trivial page at
/ served by a worker thread, in a background thread (`serving_api`); or the whole app as
`specchat` serves it, in a process of its own (`api_process`), when the test's own client threads
must not compete with the server for the interpreter lock, as real clients never do."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from specchat.app.api import add_api
from specchat.app.engine_handle import EngineHandle
from specchat.app.slow_clients import HeadDeadlineProtocol


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def api_app(handle: EngineHandle) -> FastAPI:
    app = FastAPI()
    add_api(app, handle)

    @app.get("/")
    def page():  # a plain function: Starlette runs it in a worker thread, so it needs a free one
        return HTMLResponse("<p>specchat</p>")
    return app


@contextlib.contextmanager
def serving_api(engine, **line_options) -> Iterator[tuple[str, EngineHandle]]:
    """Serve `engine` (already loaded); yields the server's URL (no trailing slash) and handle."""
    handle = EngineHandle(lambda _model, _progress: engine, engine.name, **line_options)
    app = api_app(handle)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2, http=HeadDeadlineProtocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", handle
    finally:
        handle.close()
        server.should_exit = True
        thread.join(10)


def serve_forever(model: str, port: int) -> None:
    """The server of `api_process`: the whole app as `specchat` serves it (the Gradio page, its
    routes and the API behind the guard), `model` loaded as the CLI loads it."""
    import tempfile

    from specchat.app.history import HistoryStore
    from specchat.app.server import SHUTDOWN_GRACE_SECONDS, build_app
    from specchat.core.loading import load_engine

    handle = EngineHandle(load_engine, model)
    handle.get()
    with tempfile.TemporaryDirectory(prefix="specchat-data-") as data:
        app = build_app(handle, HistoryStore(Path(data)))
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning",
                    timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS, http=HeadDeadlineProtocol)


@contextlib.contextmanager
def api_process(model: str) -> Iterator[str]:
    """Serve `model` from a process of its own; yields its URL (no trailing slash)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from api_server import serve_forever; serve_forever({model!r}, {port})")
    process = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=2)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    pytest.fail(f"the API server did not start:\n{process.communicate()[0]}")
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()  # a stalled server may ignore TERM: KILL after a while
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
