"""Small file helpers shared by the caches specchat keeps on disk."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file and a rename, so a reader (or a crash) never sees half a file.

    The data reaches the disk before the rename and the rename before returning, so even a power
    cut leaves the old file or the new one, never an empty one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """Make a rename inside `folder` durable. Windows cannot open a folder (and some file systems
    refuse to sync one): there the rename is as durable as the OS makes it anyway."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def human_size(size: float) -> str:
    """Bytes for people: GB from one gigabyte up, MB from one megabyte up, KB below."""
    if size >= 1e9:
        return f"{size / 1e9:.1f} GB"
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} KB"
