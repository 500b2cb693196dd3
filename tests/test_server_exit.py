"""The server ends as Ctrl-C ends it when a service manager or `kill` sends SIGTERM: exit code 0,
through the exit handlers (the export folder goes), not Python's default death by signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from live_server import specchat_process

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def test_sigterm_ends_the_server_normally(embedded_dir):
    with specchat_process() as (url, process):
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not end within 30 s of SIGTERM")
    assert code == 0, f"ended by the signal ({code}), its exit handlers unrun"
    assert time.monotonic() - started < 15


def test_answers_running_and_waiting_at_shutdown_end_with_a_reason_not_a_bare_500(embedded_dir):
    """uvicorn cancels what is still open after its grace period: the running answer, a stream, and
    those waiting in line were cut into bare 500s (or a stream with no end)."""
    import json
    import socket

    question = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]

    def ask(url: str, stream: bool) -> socket.socket:
        host, port = url.split("//")[1].rstrip("/").split(":")
        body = json.dumps({"messages": question, "max_tokens": 200, "temperature": 0, "stream": stream}).encode()
        connection = socket.create_connection((host, int(port)))
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % (host.encode(), port.encode(), len(body)) + body)
        return connection

    with specchat_process() as (url, process):
        streaming, waiting = ask(url, stream=True), ask(url, stream=False)
        time.sleep(1.0)  # the stream has begun; the other waits for the engine
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    replies = []
    for connection in (streaming, waiting):
        connection.settimeout(10)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
        replies.append(received.decode("utf-8", "replace"))
    # The stream began (200, then an error event), or on a slow machine was still reading (503).
    assert replies[0].startswith(("HTTP/1.1 200", "HTTP/1.1 503")) and "the server is shutting down" in replies[0]
    assert replies[1].startswith("HTTP/1.1 503") and "the server is shutting down" in replies[1]
