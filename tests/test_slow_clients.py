"""A client that sends its request head slowly is cut off; one that sends its head at once is
served, its body as slow as it likes (a server of the protocol the app runs: `slow_clients`)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import uvicorn
from api_server import free_port

from specchat.app.slow_clients import HeadDeadlineProtocol

DEADLINE = 0.6


async def echo(scope, receive, send):
    """Answers with the size of the body it was sent."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(size).encode()})


@pytest.fixture
def port(monkeypatch):
    monkeypatch.setenv("SPECCHAT_HEADER_SECONDS", str(DEADLINE))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(echo, host="127.0.0.1", port=port, log_level="warning",
                                           http=HeadDeadlineProtocol, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def dribble(sock: socket.socket, data: bytes, seconds: float) -> float:
    """Send `data` a byte at a time over `seconds`; when the server closed the connection."""
    started = time.monotonic()
    with contextlib.suppress(OSError):
        for byte in data:
            sock.sendall(bytes([byte]))
            time.sleep(seconds / len(data))
        sock.settimeout(seconds)
        while sock.recv(1024):
            pass
    return time.monotonic() - started


def test_a_head_sent_a_byte_at_a_time_is_cut_off(port):
    # Found: 440 slow connections stayed open 60 s; nothing ever timed a request's head.
    with socket.create_connection(("127.0.0.1", port)) as sock:
        closed = dribble(sock, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 40 + b"\r\n\r\n", 4)
    assert closed < 2


def test_a_slow_next_head_on_a_kept_alive_connection_is_cut_off_too(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        closed = dribble(sock, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 40 + b"\r\n\r\n", 4)
    assert closed < 2


def test_a_slow_body_after_a_prompt_head_is_served(port):
    body = b"x" * 20
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 20\r\n\r\n")
        for byte in body:  # 2 s for the body, past the head's deadline
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
        sock.settimeout(5)
        assert b"\r\n20\r\n" in sock.recv(1024)  # served: the body of 20 bytes, counted
