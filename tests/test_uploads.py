"""Uploads live in a folder of the app's own (app/uploads.py): parts of cut-off uploads go, a
dead process's folder goes at the next start, and the folder goes when the app ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from live_server import specchat_process

from specchat.app.uploads import ABANDONED_AFTER_S, remove_abandoned_parts, use_own_upload_folder


def test_parts_no_upload_writes_to_go_and_finished_uploads_stay(tmp_path):
    old, fresh = tmp_path / "tmpabandoned", tmp_path / "tmpinflight"
    for part in (old, fresh):
        part.write_bytes(b"x" * 1000)
    os.utime(old, (time.time() - ABANDONED_AFTER_S - 5,) * 2)
    finished = tmp_path / "0123abcd" / "report.pdf"
    finished.parent.mkdir()
    finished.write_bytes(b"%PDF")
    os.utime(finished, (time.time() - 3600,) * 2)
    remove_abandoned_parts(tmp_path)
    assert not old.exists() and fresh.exists() and finished.exists()
    remove_abandoned_parts(tmp_path / "no such folder")  # before the first upload: nothing to do


def test_a_dead_process_folder_goes_and_this_one_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", "")  # unset for the app; restored (unset) after the test
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / "uploads" / ended.stdout.strip()
    (dead / "abc").mkdir(parents=True)
    alive = tmp_path / "uploads" / str(os.getppid())  # another running process's uploads stay
    alive.mkdir()
    own = use_own_upload_folder(tmp_path)
    assert own == tmp_path / "uploads" / str(os.getpid()) and own.is_dir()
    assert os.environ["GRADIO_TEMP_DIR"] == str(own)
    assert not dead.exists() and alive.exists()


def test_a_folder_chosen_by_the_user_is_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "mine"))
    assert use_own_upload_folder(tmp_path / "cache") == tmp_path / "mine"
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_the_server_keeps_uploads_in_its_own_folder_and_removes_it_at_the_end(embedded_dir, tmp_path):
    # GRADIO_TEMP_DIR empty: unset for the app, whatever this process's environment holds.
    with specchat_process(env={"SPECCHAT_CACHE_DIR": str(tmp_path / "cache"), "GRADIO_TEMP_DIR": ""}) as (url, process):
        response = httpx.post(url + "gradio_api/upload", files={"files": ("notes.txt", b"some notes")}, timeout=30)
        assert response.status_code == 200, response.text
        [stored] = response.json()
        folder = tmp_path / "cache" / "uploads" / str(process.pid)
        assert Path(stored).resolve().is_relative_to(folder.resolve()), stored
        assert Path(stored).read_bytes() == b"some notes"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    assert not folder.exists()
