"""Saved conversations: one JSON file per conversation, `<id>.json`, in one folder.

A file that cannot be read never breaks the list: it is set aside as `<id>.json.corrupt` and
reported once through `take_problems`.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import InputError
from ..core.files import write_atomically
from .conversation import NEW_TITLE, Conversation, from_json, to_json

ID_PATTERN = re.compile(r"[0-9a-f]{32}")
# A temporary file younger than this may belong to another specchat that is writing it right now.
STALE_TEMPORARY_S = 60.0


@dataclass(frozen=True)
class Summary:
    """What the conversation list shows, without the messages."""
    id: str
    title: str
    updated: float


def default_folder() -> Path:
    """$SPECCHAT_DATA_DIR/conversations, else the platform's user data folder."""
    override = os.environ.get("SPECCHAT_DATA_DIR")
    if override:
        return Path(override) / "conversations"
    import platformdirs

    return Path(platformdirs.user_data_dir("specchat", appauthor=False)) / "conversations"


class HistoryStore:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._problems: list[str] = []
        # Summaries by id, with the (mtime, size) they were read at: the list is asked for after
        # every answer, and rereading every document each time would grow with the history.
        self._summaries: dict[str, tuple[tuple[int, int], Summary]] = {}
        self._remove_stale_temporaries()

    def new(self, system: str = "", preset: str = "free") -> Conversation:
        """A fresh conversation, not written until it holds a message."""
        now = time.time()
        return Conversation(id=uuid.uuid4().hex, title=NEW_TITLE, created=now, updated=now,
                            system=system, preset=preset)

    def save(self, conversation: Conversation) -> None:
        """Write `conversation` (bumping `updated`); one without messages leaves no file."""
        if not conversation.messages:
            return
        conversation.updated = time.time()
        self._write(conversation)

    def load(self, conversation_id: str) -> Conversation:
        path = self._path(conversation_id)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InputError(f"there is no saved conversation {conversation_id}") from None
        try:
            conversation = from_json(text)
        except ValueError:
            corrupt = self._set_aside(path)
            raise InputError(f"the conversation could not be read and was set aside: {corrupt}") from None
        conversation.id = conversation_id  # the file name is the id the list knows it by
        return conversation

    def list(self) -> list[Summary]:
        """Every saved conversation, most recently updated first."""
        summaries = []
        for path in self.folder.glob("*.json") if self.folder.is_dir() else []:
            if ID_PATTERN.fullmatch(path.stem):
                summary = self._summary(path)
                if summary is not None:
                    summaries.append(summary)
        return sorted(summaries, key=lambda summary: summary.updated, reverse=True)

    def rename(self, conversation_id: str, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            raise InputError("a conversation needs a title: type at least one character")
        conversation = self.load(conversation_id)
        conversation.title = title
        self._write(conversation)  # renaming is not activity: the list order stays

    def delete(self, conversation_id: str) -> None:
        self._path(conversation_id).unlink(missing_ok=True)
        self._summaries.pop(conversation_id, None)

    def take_problems(self) -> list[str]:
        """Messages about files set aside since the last call, for the UI to show once."""
        problems, self._problems = self._problems, []
        return problems

    def _path(self, conversation_id: str) -> Path:
        _check_id(conversation_id)
        return self.folder / f"{conversation_id}.json"

    def _write(self, conversation: Conversation) -> None:
        write_atomically(self._path(conversation.id), to_json(conversation))

    def _summary(self, path: Path) -> Summary | None:
        """The summary of one file, from the cache while the file is unchanged; None when it is
        gone or had to be set aside."""
        try:
            stat = path.stat()
            version = (stat.st_mtime_ns, stat.st_size)
            cached = self._summaries.get(path.stem)
            if cached and cached[0] == version:
                return cached[1]
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:  # deleted since the folder was listed
            return None
        try:
            conversation = from_json(text)
        except ValueError:
            self._set_aside(path)
            return None
        summary = Summary(path.stem, conversation.title, conversation.updated)
        self._summaries[path.stem] = (version, summary)
        return summary

    def _set_aside(self, path: Path) -> Path:
        corrupt = path.with_name(path.name + ".corrupt")
        os.replace(path, corrupt)
        self._summaries.pop(path.stem, None)
        self._problems.append(f"a saved conversation could not be read and was set aside: {corrupt}")
        return corrupt

    def _remove_stale_temporaries(self) -> None:
        """Drop what a crash midway through `write_atomically` left behind."""
        if not self.folder.is_dir():
            return
        for temporary in self.folder.glob("*.tmp"):
            try:
                if time.time() - temporary.stat().st_mtime > STALE_TEMPORARY_S:
                    temporary.unlink()
            except FileNotFoundError:
                pass


def _check_id(conversation_id: str) -> None:
    """Ids become file names: only uuid4 hex gets near a path, so none can point elsewhere."""
    if not isinstance(conversation_id, str) or not ID_PATTERN.fullmatch(conversation_id):
        raise InputError(f"not a conversation id: {conversation_id!r}")
