"""The server's guard (app/security.py) on a live server with a key: every route the app exposes
refuses a request without the key, the key (bearer header or login cookie) opens them, unknown
hosts and cross-site writes are refused, an event cannot read a file that was not uploaded, and
oversized bodies and uploads are answered 413 before they are read."""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from live_server import free_port
from specchat.app.key_attempts import KeyAttempts
from test_browser import playwright_browser  # noqa: F401 (a fixture)

KEY = "s3cret-key-for-tests"
ALLOWED = "chat.example"
TIMEOUT = 30


@dataclass
class Server:
    url: str
    port: int
    app: object  # the Guard around the whole app


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    import uvicorn

    from specchat.app.engine_handle import EngineHandle
    from specchat.app.history import HistoryStore
    from specchat.app.server import build_app
    from specchat.core.loading import load_engine

    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPECCHAT_MAX_UPLOAD_MB", "1")  # an oversized upload in a second
        handle = EngineHandle(lambda model, progress: load_engine(model, progress=progress), str(tiny_model_dir))
        app = build_app(handle, HistoryStore(tmp_path_factory.mktemp("conversations")), api_key=KEY,
                        allowed_hosts=[ALLOWED])
        # The route scan sends a wrong key to every route on purpose; the delays that slow wrong
        # keys down have tests of their own (test_key_attempts.py).
        app.attempts = KeyAttempts(delay=lambda failures: 0.0)
        port = free_port()
        uvicorn_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=uvicorn_server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not uvicorn_server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        try:
            yield Server(f"http://127.0.0.1:{port}", port, app)
        finally:
            uvicorn_server.should_exit = True
            thread.join(TIMEOUT)


def get(server, path, **kwargs) -> httpx.Response:
    return httpx.get(server.url + path, timeout=TIMEOUT, **kwargs)


def post(server, path, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=TIMEOUT, **kwargs)


BEARER = {"Authorization": f"bearer {KEY}"}  # the scheme in lower case, as some clients send it


# ---- every route, without the key -------------------------------------------------------------


def exposed_routes(app) -> list[tuple[str, str]]:
    """(method, path template) of every route of the FastAPI app and the Gradio app mounted in it."""
    from fastapi.routing import iter_route_contexts
    from starlette.routing import Mount

    def walk(routes, prefix=""):
        for context in iter_route_contexts(routes):
            if isinstance(context.route, Mount):
                yield from walk(context.route.routes, prefix + context.route.path)
            else:
                for method in context.methods or ["GET"]:
                    yield method, prefix + context.path

    return sorted(set(walk(app.app.routes)))


PARAMETERS = {"path": "assets/index.js", "path_or_url": "/etc/hostname", "url_path": "http://127.0.0.1:9/x",
              "session_hash": "abc123", "event_id": "abc123", "api_name": "predict", "size": "192",
              "key": "summary", "file_name": "index.js", "ext": "ts"}


def filled(template: str) -> str:
    """A path template with plausible values for its parameters."""
    return re.sub(r"\{(\w+)(:\w+)?\}", lambda m: PARAMETERS.get(m.group(1), "1"), template)


@pytest.mark.slow
def test_no_route_answers_without_the_key(server):
    routes = exposed_routes(server.app)
    assert len(routes) > 50 and ("POST", "/gradio_api/queue/join") in routes and ("GET", "/v1/models") in routes
    answered = []
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        for method, template in routes:
            for headers in ({}, {"Accept": "text/html"}, {"Authorization": "Bearer wrong-key"}):
                body = {"data": [], "session_hash": "abc123"} if method == "POST" else None
                # Streamed: an endpoint that answers keeps its stream open, and only the status matters.
                with client.stream(method, filled(template), headers=headers, json=body) as response:
                    redirected_to_login = response.status_code == 303 and response.headers["location"] == "/login"
                    if response.status_code not in (401, 403, 404, 405) and not redirected_to_login:
                        answered.append(f"{method} {template} {headers}: {response.status_code}")
                    elif response.status_code == 401 and method != "HEAD" and template != "/login" \
                            and "authentication_error" not in response.read().decode():
                        answered.append(f"{method} {template} {headers}: 401 without an OpenAI-shaped error")
    assert not answered, "answered without the key:\n" + "\n".join(answered)


@pytest.mark.slow
def test_the_key_opens_the_page_the_api_and_gradio(server):
    models = get(server, "/v1/models", headers=BEARER)
    assert models.status_code == 200 and models.json()["data"][0]["object"] == "model"
    for path in ("/config", "/gradio_api/info"):
        assert get(server, path, headers=BEARER).status_code == 200, path
    page = get(server, "/", headers={"Cookie": f"specchat_session={login_cookie(server)}", "Accept": "text/html"})
    assert page.status_code == 200 and "gradio" in page.text.lower()


def login_cookie(server) -> str:
    response = post(server, "/login", data={"key": KEY})
    assert response.status_code == 303 and response.headers["location"] == "/"
    return response.cookies["specchat_session"]


@pytest.mark.slow
def test_login_asks_for_the_key_and_sets_a_strict_cookie(server):
    asked = get(server, "/", headers={"Accept": "text/html"})
    assert asked.status_code == 303 and asked.headers["location"] == "/login"
    form = get(server, "/login")
    assert form.status_code == 200 and 'name="key"' in form.text
    assert not re.search(r"(src|href)=", form.text)  # self-contained: nothing to load before the key
    wrong = post(server, "/login", data={"key": "not-the-key"})
    assert wrong.status_code == 401 and "not the key" in wrong.text and "set-cookie" not in wrong.headers
    right = post(server, "/login", data={"key": KEY})
    cookie = right.headers["set-cookie"]
    assert right.status_code == 303 and "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    assert KEY not in cookie
    assert get(server, "/config", cookies={"specchat_session": right.cookies["specchat_session"]}).status_code == 200
    assert get(server, "/config", cookies={"specchat_session": "0" * 64}).status_code == 401


# ---- hosts and origins ------------------------------------------------------------------------


@pytest.mark.slow
def test_unknown_hosts_are_refused_and_allowed_names_answered(server):
    rebound = get(server, "/v1/models", headers={**BEARER, "Host": f"evil.example:{server.port}"})
    assert rebound.status_code == 400 and "--allow-host" in rebound.json()["error"]["message"]
    for host in (f"{ALLOWED}:{server.port}", "localhost", f"[::1]:{server.port}", "192.168.1.20"):
        assert get(server, "/v1/models", headers={**BEARER, "Host": host}).status_code == 200, host


@pytest.mark.slow
def test_a_cross_site_write_is_refused_even_with_the_key(server):
    body = {"data": [], "fn_index": 0, "session_hash": "cross"}
    for origin in ("http://evil.example", "null", f"http://192.168.1.20:{server.port}"):
        refused = post(server, "/gradio_api/queue/join", json=body, headers={**BEARER, "Origin": origin})
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error", origin
    own = post(server, "/gradio_api/queue/join", json=body, headers={**BEARER, "Origin": server.url})
    assert own.status_code != 403


@pytest.mark.slow
def test_a_page_on_another_local_port_cannot_read_with_the_cookie(server):
    """Same site (the cookie goes along), another origin: Gradio echoed it with credentials allowed."""
    cookie = {"Cookie": f"specchat_session={login_cookie(server)}"}
    for path in ("/config", "/gradio_api/info", "/v1/models"):
        for origin in (f"http://127.0.0.1:{server.port + 1}", f"http://localhost:{server.port}", "null"):
            refused = get(server, path, headers={**cookie, "Origin": origin})
            assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers, (path, origin)
        assert get(server, path, headers={**cookie, "Origin": server.url}).status_code == 200, path
        assert get(server, path, headers=cookie).status_code == 200, path  # same-origin reads send no Origin


# ---- files an event receives ------------------------------------------------------------------


def upload_event(server) -> tuple[int, int]:
    """The fn index and trigger of the attaching of a file put in the message box (its clip, or a
    drop), from the config the page loads: the box's change event that renders the chat."""
    config = get(server, "/config", headers=BEARER).json()
    box = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "message")
    fn = next(d["id"] for d in config["dependencies"] if [box, "change"] in d["targets"] and len(d["outputs"]) > 1)
    return fn, box


def run_event(server, fn: int, trigger: int, data: list) -> str:
    """Every message of the event's stream, as text, once it completes."""
    session = uuid.uuid4().hex
    joined = post(server, "/gradio_api/queue/join", headers=BEARER,
                  json={"data": data, "fn_index": fn, "trigger_id": trigger, "session_hash": session})
    assert joined.status_code == 200, joined.text
    event_id, seen = joined.json()["event_id"], []
    with httpx.stream("GET", f"{server.url}/gradio_api/queue/data", params={"session_hash": session},
                      headers=BEARER, timeout=TIMEOUT) as stream:
        for line in stream.iter_lines():
            seen.append(line)
            if line.startswith("data:"):
                message = json.loads(line[5:])
                if message.get("msg") == "process_completed" and message.get("event_id") == event_id:
                    return "\n".join(seen)
    pytest.fail("the event never completed:\n" + "\n".join(seen))


def file_data(path: str) -> dict:
    return {"path": path, "orig_name": path.rsplit("/", 1)[-1], "meta": {"_type": "gradio.FileData"}}


@pytest.mark.slow
def test_an_event_cannot_read_a_file_that_was_not_uploaded(server, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-MARKER-7731 the password is hunter2\n")
    fn, trigger = upload_event(server)
    refused = run_event(server, fn, trigger, [{"text": "", "files": [file_data(str(secret))]}, None])  # no attachment yet
    assert "TOP-SECRET-MARKER-7731" not in refused and "Attached" not in refused
    assert "not uploaded by a user" in refused or "only files uploaded through this page" in refused

    uploaded = post(server, "/gradio_api/upload", headers=BEARER,
                    files={"files": ("notes.txt", b"Notes uploaded the normal way.\n", "text/plain")})
    assert uploaded.status_code == 200, uploaded.text
    attached = run_event(server, fn, trigger, [{"text": "", "files": [file_data(uploaded.json()[0])]}, None])
    assert "Attached notes.txt" in attached


# ---- sizes ------------------------------------------------------------------------------------


def raw_request(server, head: str, body_parts, read_timeout: float = 1.0) -> tuple[str, float]:
    """Send `head`, then body parts until the server answers; its answer (head and body, the
    body read to its Content-Length) and the seconds it took from the end of `head`."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_timeout) as sock:
        sock.sendall(head.encode())
        started = time.monotonic()
        for part in body_parts:
            if select.select([sock], [], [], 0)[0]:
                break  # the server has answered: stop sending
            try:
                sock.sendall(part)
            except (TimeoutError, ConnectionError):
                break  # the server no longer reads
        answer = b""
        try:
            while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
            seconds = time.monotonic() - started
            head_end = answer.find(b"\r\n\r\n") + 4
            length = re.search(rb"(?i)content-length: *(\d+)", answer[:head_end])
            while length and len(answer) - head_end < int(length.group(1)) and (chunk := sock.recv(65536)):
                answer += chunk  # the body may come in a packet of its own
        except (TimeoutError, ConnectionError):
            seconds = time.monotonic() - started
        return answer.decode("latin-1"), seconds


@pytest.mark.slow
def test_a_10_mb_body_is_answered_413_at_once_without_being_read(server):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {10 * 10**6}\r\n\r\n")
    answer, seconds = raw_request(server, head, [b"x" * 65536])  # 64 KB of the 10 MB, then wait
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert seconds < 1.0
    answer, _ = raw_request(server, head.replace(f"Content-Length: {10 * 10**6}", "Transfer-Encoding: chunked"),
                            (b"%x\r\n%s\r\n" % (10**6, b"x" * 10**6) for _ in range(20)), read_timeout=10)
    assert answer.startswith("HTTP/1.1 413") and "SPECCHAT_MAX_REQUEST_MB" in answer, answer[:300]


@pytest.mark.slow
def test_an_oversized_upload_is_refused(server):
    # Over the limit by far: refused by its declared size, with the limit named.
    big = post(server, "/gradio_api/upload", headers=BEARER,
               files={"files": ("big.txt", b"x" * 1_500_000, "text/plain")})
    assert big.status_code == 413 and "SPECCHAT_MAX_UPLOAD_MB" in big.json()["error"]["message"]
    # Just over: the body fits the multipart allowance, and Gradio's own per-file limit refuses it.
    just = post(server, "/gradio_api/upload", headers=BEARER,
                files={"files": ("just.txt", b"x" * (10**6 + 100), "text/plain")})
    assert just.status_code == 413 and "maximum allowed size" in just.text


# ---- in a browser -----------------------------------------------------------------------------


@pytest.mark.browser
@pytest.mark.slow
def test_a_browser_is_asked_for_the_key_then_uses_the_page(server, playwright_browser, tmp_path):
    """The key prompt in Chromium, then the page's own requests (config, assets, the queue, an
    upload and its event) all pass on the cookie alone."""
    page = playwright_browser.new_page()
    try:
        page.goto(server.url + "/")
        key = page.locator("input[name=key]")
        key.wait_for(timeout=30_000)
        key.fill("not-the-key")
        key.press("Enter")
        page.get_by_text("not the key").wait_for(timeout=30_000)
        page.locator("input[name=key]").fill(KEY)
        page.locator("input[name=key]").press("Enter")
        page.locator("#message textarea").wait_for(timeout=60_000)
        document = tmp_path / "notes.txt"
        document.write_text("Meeting notes: the launch moved to March 3.\n")
        page.locator("#message input[type=file]").set_input_files(str(document))  # the box's clip
        attachment = page.locator("#attachment")
        wait = time.monotonic() + 60
        while "notes.txt" not in attachment.inner_text():
            assert time.monotonic() < wait, "the upload was not attached"
            time.sleep(0.2)
    finally:
        page.close()


# ---- the guard's parts ------------------------------------------------------------------------


def test_host_names_and_allowed_hosts():
    from specchat.app.security import allowed_host, allowed_names, host_allowed, origin_allowed
    from specchat.core.errors import InputError

    names = allowed_names("0.0.0.0", ["Chat.Example."])
    assert host_allowed("localhost:7860", names) and host_allowed("[::1]:7860", names)
    assert host_allowed("CHAT.example:443", names) and host_allowed("10.0.0.7:7860", names)
    assert not host_allowed("evil.example:7860", names) and not host_allowed("", names)
    added = frozenset({"chat.example"})
    assert origin_allowed("https://chat.example", "127.0.0.1:7860", added)  # behind a proxy
    assert origin_allowed("http://10.0.0.7:7860", "10.0.0.7:7860", added)  # the page's own origin
    assert not origin_allowed("http://10.0.0.8", "10.0.0.7:7860", added)  # a page served by another address
    assert not origin_allowed("http://localhost:8000", "localhost:7860", added)  # or by another local server
    assert not origin_allowed("null", "127.0.0.1:7860", added)
    for bad in ("http://chat.example/", "a b", "user@host", ""):
        with pytest.raises(InputError, match="--allow-host"):
            allowed_host(bad)


def run_async(coroutine):
    """`asyncio.run` in a thread of its own: playwright's sync API keeps a loop running in this one."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result(timeout=TIMEOUT)


def test_without_a_key_the_guard_still_refuses_rebinding_cross_site_writes_and_big_bodies():
    """The guard alone, around an app that answers everything: no key set, as by default."""
    from specchat.app.security import Guard

    async def app(scope, receive, send):
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"read %d bytes" % len(body)})

    async def chunked():  # 10 MB of unknown size: counted as it arrives
        for _ in range(10):
            yield b"x" * 10**6

    async def requests():
        transport = httpx.ASGITransport(app=Guard(app, None, "127.0.0.1"))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7860") as client:
            for origin, status in (("http://evil.example", 403), ("http://127.0.0.1:7860", 200)):
                assert (await client.post("/gradio_api/queue/join", headers={"Origin": origin})).status_code == status
            assert (await client.get("/", headers={"Host": "evil.example"})).status_code == 400
            assert (await client.get("/config")).status_code == 200  # no key: the page is open, as before

            too_big = await client.post("/v1/chat/completions", content=chunked())
            assert too_big.status_code == 413 and "so far" in too_big.json()["error"]["message"]

    run_async(requests())


def test_websockets_need_the_key_and_the_lifespan_passes():
    from specchat.app.security import Guard

    reached = []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    async def call(scope) -> list:
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "websocket.connect"}

        await Guard(app, KEY, "127.0.0.1")(scope, receive, send)
        return sent

    def websocket(*headers):
        return {"type": "websocket", "path": "/ws", "headers": [(b"host", b"127.0.0.1:7860"), *headers]}

    closed = [{"type": "websocket.close", "code": 1008}]  # answered 403 before the handshake completes
    assert run_async(call(websocket())) == closed
    assert run_async(call(websocket((b"authorization", f"Bearer {KEY}".encode()),
                                      (b"origin", b"http://evil.example")))) == closed
    assert run_async(call(websocket((b"authorization", f"Bearer {KEY}".encode())))) == []
    assert run_async(call({"type": "lifespan"})) == []
    assert reached == ["websocket", "lifespan"]


def test_only_uploaded_files_are_attached(tmp_path, monkeypatch):
    from specchat.app.security import uploaded_file
    from specchat.core.errors import InputError

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "uploads"))
    inside = tmp_path / "uploads" / "abc" / "notes.txt"
    inside.parent.mkdir(parents=True)
    inside.write_text("notes")
    assert uploaded_file(str(inside)) == str(inside)
    (tmp_path / "uploads" / "link.txt").symlink_to(tmp_path / "secret.txt")
    for outside in (tmp_path / "secret.txt", tmp_path / "uploads" / ".." / "secret.txt",
                    tmp_path / "uploads" / "link.txt"):
        with pytest.raises(InputError, match="only files uploaded"):
            uploaded_file(str(outside))


def test_allow_host_and_its_variable_reach_the_server(monkeypatch, tmp_path):
    import specchat.app.server as server
    from specchat.app.cli import main

    # The serve path points GRADIO_TEMP_DIR at an upload folder of its own unless one is set: set
    # one here, so this process's environment is restored after the test (and the user's cache untouched).
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "uploads"))
    launched = {}
    monkeypatch.setattr(server, "launch", lambda *args, **kwargs: launched.update(kwargs))
    monkeypatch.setenv("SPECCHAT_ALLOWED_HOSTS", "a.example, b.example")
    assert main(["--no-browser", "--allow-host", "chat.example", "--allow-host", "[::1]"]) == 0
    assert launched["allowed_hosts"] == ["chat.example", "::1", "a.example", "b.example"]
