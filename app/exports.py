"""The files of a conversation export (Markdown and JSON), written where they never pile up.

Every export goes into one temporary folder per process, emptied before each export and removed
when the interpreter exits: the page hands the files to Gradio, which copies them into its own
cache when the event returns, so the previous export is never needed again.
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
import threading
from pathlib import Path

from ..core.errors import InputError
from .conversation import Conversation, to_json, to_markdown

STEM_BYTES = 200  # file names are limited to 255 bytes: room for ".json"
# Names Windows refuses for a file, whatever the extension.
WINDOWS_DEVICES = {"CON", "PRN", "AUX", "NUL", *(f"COM{n}" for n in range(1, 10)), *(f"LPT{n}" for n in range(1, 10))}

_lock = threading.Lock()
_folder: Path | None = None


def write_export(conversation: Conversation | None, writing: bool = False) -> list[str]:
    """Write `conversation` as `<title>.md` and `<title>.json`; their paths, Markdown first.
    `writing`: this process is still writing its last answer (`to_markdown`)."""
    if conversation is None or not conversation.messages:
        raise InputError("nothing to export yet: this conversation is empty")
    stem = file_stem(conversation.title)
    files = {f"{stem}.md": to_markdown(conversation, writing), f"{stem}.json": to_json(conversation)}
    with _lock:
        folder = export_folder()
        for old in folder.iterdir():
            old.unlink()
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8")
    return [str(folder / name) for name in files]


def file_stem(title: str) -> str:
    """The whole title as a file name: letters and digits of any script, '-', '_' and '.' kept,
    every other run of characters one '-'; never empty, hidden or a Windows device name."""
    stem = re.sub(r"[^\w.-]+", "-", title).strip("-.")
    stem = stem.encode("utf-8")[:STEM_BYTES].decode("utf-8", "ignore").strip("-.")
    if stem.split(".")[0].upper() in WINDOWS_DEVICES:
        stem = f"{stem}-"
    return stem or "conversation"


def export_folder() -> Path:
    """This process's export folder, made on first use and removed at exit."""
    global _folder
    if _folder is None or not _folder.is_dir():
        _folder = Path(tempfile.mkdtemp(prefix="specchat-export-"))
        atexit.register(shutil.rmtree, _folder, ignore_errors=True)
    return _folder
