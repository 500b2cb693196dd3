"""Uploaded files: a folder of this process's own, emptied when it ends and, for a process that
died, when the next one starts; uploads cut off midway removed as the next ones arrive.

Gradio writes an upload in flight to a temporary file at the top of its folder and moves it into a
subfolder once it is whole; one cut off or refused stays there (30-50 MB each) in a folder shared
by every Gradio app on the machine, through restarts.
"""

from __future__ import annotations

import atexit
import os
import shutil
import time
from pathlib import Path

ABANDONED_AFTER_S = 60.0  # a part not written to for this long belongs to no upload in flight


def use_own_upload_folder(cache_root: Path) -> Path:
    """Point Gradio's uploads (GRADIO_TEMP_DIR, read when gradio is imported: call this first) at
    `cache_root`/uploads/<pid>, after removing the folders of processes that have ended. A folder
    the user chose with GRADIO_TEMP_DIR is theirs: it is used as it is."""
    import psutil

    chosen = os.environ.get("GRADIO_TEMP_DIR")
    if chosen:
        return Path(chosen)
    root = cache_root / "uploads"
    for folder in root.glob("*") if root.is_dir() else []:
        if folder.name.isdigit() and not psutil.pid_exists(int(folder.name)):
            shutil.rmtree(folder, ignore_errors=True)
    own = root / str(os.getpid())
    own.mkdir(parents=True, exist_ok=True)
    atexit.register(shutil.rmtree, own, ignore_errors=True)
    os.environ["GRADIO_TEMP_DIR"] = str(own)
    return own


def remove_abandoned_parts(folder: Path, now: float | None = None) -> None:
    """Remove the files at the top of `folder` that no upload has written to for a minute."""
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(folder))
    except OSError:  # no upload yet (no folder), or it went away
        return
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False) and now - entry.stat().st_mtime > ABANDONED_AFTER_S:
                os.unlink(entry.path)
        except OSError:  # finished and moved meanwhile, or already gone
            pass
