"""The server: the Gradio page at /, the OpenAI-compatible API at /v1 and Gradio's routes on one
ASGI app behind one guard (security.py: known hosts, no cross-site writes, the key, bounded
bodies), run by uvicorn until Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
import webbrowser
from typing import Callable, Iterable

from ..core import limits
from ..core.errors import InputError
from .engine_handle import EngineHandle
from .history import HistoryStore, default_folder
from .security import Guard
from .slow_clients import HeadDeadlineProtocol, head_seconds
from .page_head import PageHead
from .ui import APP_CSS, SLOW_LONG_ANIMATION_LOOPS, build_ui  # first: it turns Gradio's analytics off before Gradio loads

import gradio as gr  # noqa: E402
import uvicorn  # noqa: E402

DEFAULT_HOST = "127.0.0.1"
SHUTDOWN_GRACE_SECONDS = 1
LISTEN_BACKLOG = 2048  # uvicorn's own


def build_app(handle: EngineHandle, store: HistoryStore, registry_file: str | None = None,
              api_key: str | None = None, host: str = DEFAULT_HOST, allowed_hosts: Iterable[str] = ()):
    """The whole server as one ASGI app: the page at /, the OpenAI-compatible API at /v1, and
    Gradio's routes, all behind the `Guard` (known hosts, no cross-site writes, the key, sizes)."""
    from fastapi import FastAPI

    from .api import add_api

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    add_api(app, handle)  # the key is the Guard's, for every route alike
    demo = build_ui(handle, store, registry_file).queue(default_concurrency_limit=1)
    app = gr.mount_gradio_app(app, demo, path="/", ssr_mode=False, footer_links=[], css=APP_CSS,
                              max_file_size=limits.UPLOAD.bytes)
    # Gradio checks that a file an event receives was uploaded (processing_utils._check_allowed)
    # only once `launch()` has marked the app launched, which a mounted app never is: mark it.
    demo.has_launched = True
    app.add_middleware(PageHead, script=SLOW_LONG_ANIMATION_LOOPS)
    return Guard(app, api_key, host, allowed_hosts)


def _quiet_forced_shutdown(record: logging.LogRecord) -> bool:
    """On Ctrl-C uvicorn cuts the streams still open after the grace period (an open tab's event
    stream always is one) and logs each cut as an error with a traceback: expected, so not shown."""
    cut = record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError)
    return not (cut or "timeout graceful shutdown exceeded" in record.getMessage())


def _stop_as_ctrl_c(signum, frame) -> None:
    raise KeyboardInterrupt


class _Server(uvicorn.Server):
    """uvicorn's server, which ends the engine's jobs as soon as a shutdown begins: uvicorn cancels
    what is still open after its grace period, and a request cut so answers a bare 500 (or a
    stream with no end)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        # A signal handler: it may interrupt this thread inside a ticket's lock, so the tickets
        # are ended from a thread of their own.
        threading.Thread(target=self._on_exit, daemon=True, name="stop-serving").start()
        super().handle_exit(sig, frame)


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, listening before the model loads, as uvicorn would make it; an
    `InputError` naming the address when another program (or specchat) holds the port, or the
    address is of no interface here. Probing and letting uvicorn bind later let two specchats
    started at once both pass, the second then aborting in uvicorn with exit code 134."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        if sys.platform == "win32":  # Windows' SO_REUSEADDR would let a second server share the port
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_EXCLUSIVEADDRUSE, 1)
        else:  # a closing socket (TIME_WAIT) is no owner
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(LISTEN_BACKLOG)
    except OSError as error:
        listener.close()
        raise InputError(f"cannot listen on {host}:{port}: {error.strerror or error} (is specchat already "
                         "running there? --port N chooses another port)") from None
    return listener


def _documents_folder():
    """Where saved document caches are (a deleted conversation's go as the bin is emptied); None
    where the cache folder's setting is unusable (loading the model says why)."""
    from ..core.embedded import documents_folder

    try:
        return documents_folder()
    except InputError:
        return None


def launch(load: Callable[[str, Callable[[str], None]], object], model: str = "embedded", registry_file: str | None = None,
           host: str = DEFAULT_HOST, port: int = 7860, open_browser: bool = True, api_key: str | None = None,
           allowed_hosts: Iterable[str] = ()) -> None:
    """Serve the chat at / and the OpenAI-compatible API at /v1 on one server; `load(model,
    progress)` loads an engine (in the background, so the page is up at once)."""

    if host not in (DEFAULT_HOST, "localhost", "::1"):
        print(f"specchat: warning: listening on {host}: other computers on the network can use this chat and "
              + ("its API with the key" if api_key else "its API without a key (set --api-key)")
              + "; they reach it by this computer's address, or by a name given with --allow-host",
              file=sys.stderr)
    # The engine's modules (transformers, torch) are imported here, before any thread starts: a
    # thread importing transformers while another does can fail with "cannot import name
    # 'DynamicCache'" (its lazy module is then half set up). The loading thread starts next.
    from ..core import engine  # noqa: F401

    listener = _listening_socket(host, port)  # before the model loads and "ready" is printed
    head_seconds()
    handle = EngineHandle(load, model)
    store = HistoryStore(default_folder(), documents=_documents_folder())
    app = build_app(handle, store, registry_file, api_key, host, allowed_hosts)
    url = f"http://{host}:{port}"
    print(f"specchat: the chat is at {url}/ and the OpenAI-compatible API at {url}/v1; "
          f"conversations are saved in {store.folder}"
          + ("; both need the key (the page asks for it once per browser)" if api_key else ""), file=sys.stderr)
    if open_browser:
        threading.Timer(1.5, webbrowser.open, args=(f"{url}/",)).start()
    # Open streams (an answer, a tab's event stream) get SHUTDOWN_GRACE_SECONDS to end on Ctrl-C,
    # then are cut: waiting for all of them kept the server up for minutes with a tab open.
    # HeadDeadlineProtocol: a client that dribbles its request head is cut off (slow_clients.py).
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", ws_max_size=limits.REQUEST_BODY.bytes,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,  # configures uvicorn's logging
                            http=HeadDeadlineProtocol)
    logging.getLogger("uvicorn.error").addFilter(_quiet_forced_shutdown)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again with the handler found at
    # start: Python's default would end the process there, exit handlers (the export folder) unrun.
    signal.signal(signal.SIGTERM, _stop_as_ctrl_c)
    try:
        _Server(config, on_exit=handle.stop_serving).run(sockets=[listener])
    except KeyboardInterrupt:
        pass  # Ctrl-C is how the app is stopped: a normal end, as with uvicorn.run
    finally:
        listener.close()
        handle.close(timeout=5)  # the running answer is cancelled, the waiting ones told why
