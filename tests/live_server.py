"""`specchat --no-browser` on a free loopback port, for tests that drive the running app."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest
from test_cli import SPECCHAT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_specchat(*args: str, env: dict | None = None) -> Iterator[str]:
    """Start the app, wait until its page answers, yield its URL; stop it afterwards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    process = subprocess.Popen([SPECCHAT, "--no-browser", "--port", str(port), *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    pytest.fail(f"specchat did not start:\n{process.communicate()[0]}")
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
