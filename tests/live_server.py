"""`specchat --no-browser` on a free loopback port, for tests that drive the running app."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli import SPECCHAT


def cache_without_documents(data_dir: Path) -> Path:
    """A cache folder for one app's data (shared by its restarts) that sees the machine's converted
    models and calibrations but not its saved document KV: a document read in an earlier test run
    would otherwise start from disk, and the read a test watches would not happen."""
    from specchat.core import embedded

    cache = data_dir / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    shared = embedded.cache_root()
    shared.mkdir(parents=True, exist_ok=True)
    for entry in ("embedded", "hardware", "trees", "acceptance"):
        (shared / entry).mkdir(exist_ok=True)
        if not (cache / entry).exists():
            (cache / entry).symlink_to(shared / entry)
    return cache


RUNNING: list[subprocess.Popen] = []  # the servers started here, newest last


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(process: subprocess.Popen, characters: int = 3000) -> str:
    """The end of what the server printed, for failure messages."""
    return Path(process.log_path).read_text(errors="replace")[-characters:]


@contextlib.contextmanager
def specchat_process(*args: str, data_dir: str | None = None,
                     env: dict | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start the app (conversations saved under `data_dir`, a fresh folder by default), wait
    until its page answers, yield its URL and process; stop it afterwards. Its output goes to a
    file: a pipe nobody reads fills up (64 KB) and the server then blocks mid-answer on a print."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with contextlib.ExitStack() as stack:
        data_dir = data_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="specchat-data-"))
        env = {**os.environ, **(env or {}), "SPECCHAT_DATA_DIR": str(data_dir)}
        env.setdefault("SPECCHAT_CACHE_DIR", str(cache_without_documents(Path(data_dir))))
        log_path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specchat-log-"))) / "server.log"
        log = stack.enter_context(open(log_path, "w"))
        process = subprocess.Popen([SPECCHAT, "--no-browser", "--port", str(port), *args], env=env,
                                   stdout=log, stderr=subprocess.STDOUT, text=True)
        process.log_path = str(log_path)
        RUNNING.append(process)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(url, timeout=2)
                    break
                except urllib.error.HTTPError:
                    break  # it answers (a server with a key answers 401 without it): it is up
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        process.kill()
                        process.wait()
                        pytest.fail(f"specchat did not start:\n{log_tail(process)}")
                    time.sleep(0.5)
            yield url, process
        finally:
            RUNNING.remove(process)
            if process.poll() is None:
                process.terminate()
            process.wait(timeout=30)


def running_servers_log_tail() -> str:
    """What the newest running server printed last ("" when none runs)."""
    return log_tail(RUNNING[-1]) if RUNNING else ""


@contextlib.contextmanager
def running_specchat(*args: str, data_dir: str | None = None, env: dict | None = None) -> Iterator[str]:
    with specchat_process(*args, data_dir=data_dir, env=env) as (url, _):
        yield url
