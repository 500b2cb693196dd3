"""The /v1 API (`add_api`) on a loopback uvicorn server in a background thread, with a trivial
page at / served by a worker thread (as the app's page is), for tests that need real HTTP."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from specchat.app.api import add_api
from specchat.app.engine_handle import EngineHandle


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving_api(engine, **line_options) -> Iterator[tuple[str, EngineHandle]]:
    """Serve `engine` (already loaded); yields the server's URL (no trailing slash) and handle."""
    handle = EngineHandle(lambda _model: engine, engine.name, **line_options)
    app = FastAPI()
    add_api(app, handle)

    @app.get("/")
    def page():  # a plain function: Starlette runs it in a worker thread, so it needs a free one
        return HTMLResponse("<p>specchat</p>")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
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
