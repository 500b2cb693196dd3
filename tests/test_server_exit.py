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
