"""Drafts kept on disk per browser, so that what a person typed, attached and pasted and did not
send survives a reload, back and forward, and a server restart (Gradio reloads the page when the
server comes back). The browser is known by a random id it keeps (a `gr.BrowserState`); its
drafts are one JSON file beside the conversations, written whole (`chat_drafts` keeps them by
conversation id) and only when they change.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import uuid
from pathlib import Path

BROWSER_ID = re.compile(r"[0-9a-f]{32}")
KEPT_DRAFTS = 50  # conversations with a draft, per browser: the newest kept


class DraftStore:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._lock = threading.Lock()
        self._written: dict[str, str] = {}  # browser id -> the JSON last written for it

    @staticmethod
    def browser(browser_id: str | None) -> str:
        """`browser_id` when it is one this store made, else a new one (a first visit, or a value
        that is not an id: it names a file)."""
        return browser_id if isinstance(browser_id, str) and BROWSER_ID.fullmatch(browser_id) else uuid.uuid4().hex

    def load(self, browser_id: str) -> dict:
        """The browser's drafts ({} when none, or when the file cannot be read: a draft is no
        reason for an error)."""
        try:
            drafts = json.loads(self._path(browser_id).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return drafts if isinstance(drafts, dict) and all(_is_draft(value) for value in drafts.values()) else {}

    def save(self, browser_id: str, drafts: dict) -> None:
        """Write the browser's drafts (the newest `KEPT_DRAFTS`); an empty dict removes the file.
        A failure (a full disk) is silent: the drafts stay in the page while it is open."""
        kept = dict(list(drafts.items())[-KEPT_DRAFTS:])
        text = json.dumps(kept, ensure_ascii=False)
        path = self._path(browser_id)
        with self._lock:
            if self._written.get(browser_id) == text:
                return
            try:
                if kept:
                    _write(path, text)
                else:
                    path.unlink(missing_ok=True)
            except OSError:
                return
            self._written[browser_id] = text

    def _path(self, browser_id: str) -> Path:
        if not BROWSER_ID.fullmatch(browser_id):
            raise ValueError(f"not a browser id: {browser_id!r}")
        return self.folder / f"{browser_id}.json"


def _write(path: Path, text: str) -> None:
    """`text` in `path`, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)


def _is_draft(value) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("message", ""), str)
            and isinstance(value.get("pasted", ""), str)
            and (value.get("attachment") is None or isinstance(value["attachment"], dict)
                 and isinstance(value["attachment"].get("text"), str)
                 and isinstance(value["attachment"].get("name"), str)))
