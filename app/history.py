"""Saved conversations: one JSON file per conversation, `<id>.json`, in one folder.

A file that cannot be read never breaks the list, whatever is wrong with it: one whose content is
not a conversation (binary, not UTF-8, truncated, nested too deeply, wrong types) is set aside as
`<id>.json.corrupt`; one that cannot be touched safely (a folder with a conversation's name, a file
over `CONVERSATION_FILE`, one we may not read) is left where it is and skipped. Either way it is
reported once through `take_problems`.

A deleted conversation goes to a bin (`<id>.json.deleted`) that the next start empties; the saved
document caches that no other conversation uses go with it (`core/kv/document_owners.py`).

Each tab holds its own copy of a conversation, so every file carries a revision and the store
writes only the copy that is the file's latest: a stale copy (another tab wrote since, or an answer
ended after the copy was opened) or a deleted conversation is refused (`ConversationChanged`)
instead of silently overwriting newer turns; an answer being written merges into the newer copy,
or into the bin's for a deleted conversation, so that Undo brings back all that was written.
A copy's `partial` answer is being written while `live_answers` holds its conversation, else it
was cut short (a crash, a kill). Each call is one step under one lock: an answer saves on its own
thread while the page renames or deletes on another.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import re
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..core.env_settings import folder_setting
from ..core.errors import InputError, SpecchatError
from ..core.files import human_size, write_atomically
from ..core.kv import document_owners
from ..core.limits import CONVERSATION_FILE
from .conversation import NEW_TITLE, Conversation, from_json, one_line, to_json
from .live_answers import LiveAnswers

ID_PATTERN = re.compile(r"[0-9a-f]{32}")
DELETED_SUFFIX = ".deleted"  # a deleted conversation, kept until the next start so that it can be undone
# A temporary file younger than this may belong to another specchat that is writing it right now.
STALE_TEMPORARY_S = 60.0


class SaveFailed(SpecchatError):
    """A conversation could not be written (disk full, no permission); the file on disk is the
    previous version, untouched."""


class ConversationChanged(SpecchatError):
    """The copy being saved is no longer the conversation on disk (written or deleted since it was
    read); nothing was written."""


DELETED = ("this conversation was deleted meanwhile (here or in another tab), so nothing more of it was "
           "saved: Undo, in the tab that deleted it, brings it back")
CHANGED = ("this conversation changed meanwhile (in another tab, or an answer ended after it was opened), "
           "so nothing was saved: open it again to see it as saved")


class _Unreadable(Exception):
    """A conversation file that cannot be used; `problem` is the line reported about it."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


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
        return folder_setting("SPECCHAT_DATA_DIR", override) / "conversations"
    import platformdirs

    return Path(platformdirs.user_data_dir("specchat", appauthor=False)) / "conversations"


def _locked(method):
    """`method` as one step of the store: its reads, checks and writes never interleave with
    another thread's (`HistoryStore._lock`)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class HistoryStore:
    def __init__(self, folder: Path, documents: Path | None = None):
        self.folder = Path(folder)
        # Saved document caches (None: none kept), listed by the conversations that use them.
        self.documents = Path(documents) if documents is not None else None
        self._problems: list[str] = []
        # Summaries by id, with the (mtime, size) they were read at: the list is asked for after
        # every answer, and rereading every document each time would grow with the history.
        self._summaries: dict[str, tuple[tuple[int, int], Summary]] = {}
        self._reported: set[str] = set()  # problems already reported about files left in place
        self._revisions: dict[str, tuple[tuple[int, int], int]] = {}  # by file name: (mtime, size) -> revision
        self._deleted: set[str] = set()  # in the bin: no copy still open anywhere may write it again
        self.live_answers = LiveAnswers()  # whose answer this process is writing: a new store knows none
        # An answer saves on its own thread while the page renames or deletes on another: a write
        # landing between another's revision check and its write would be lost for good.
        self._lock = threading.RLock()
        self._remove_stale_temporaries()
        self._empty_the_bin()

    def new(self, system: str = "", preset: str = "free") -> Conversation:
        """A fresh conversation, not written until it holds a message."""
        now = time.time()
        return Conversation(id=uuid.uuid4().hex, title=NEW_TITLE, created=now, updated=now,
                            system=system, preset=preset)

    @_locked
    def save(self, conversation: Conversation) -> None:
        """Write `conversation` (bumping `updated` and `revision`); one without messages leaves no
        file (and takes away the file of a question saved while the model loaded, then taken back).
        `ConversationChanged` when the copy is stale or the conversation was deleted."""
        if not self._is_current(conversation):
            raise ConversationChanged(CHANGED)
        if not conversation.messages:
            self._path(conversation.id).unlink(missing_ok=True)
            self._summaries.pop(conversation.id, None)
            return
        conversation.updated = time.time()
        self._write(conversation)

    @_locked
    def save_answer(self, conversation: Conversation, answer: dict) -> None:
        """Save while `answer`, one of the conversation's messages, is being written. When the
        conversation moved on meanwhile but still holds the turns before the answer (renamed,
        another tab asked after it), the answer goes into the newer copy, which `conversation`
        becomes; `ConversationChanged` when those turns changed. Deleted meanwhile, it goes into
        the bin's copy, which stays there: Undo brings back the answer as its tab shows it."""
        binned = conversation.id in self._deleted
        path = self._path(conversation.id, binned)
        saved = self._saved_revision(path)
        if binned and saved is None:  # nothing in the bin for Undo to bring back
            raise ConversationChanged(DELETED)
        if saved not in (None, conversation.revision):
            place = next(index for index, message in enumerate(conversation.messages) if message is answer)
            newer = self._load(conversation.id, path)
            if newer.messages[:place] != conversation.messages[:place]:
                raise ConversationChanged(CHANGED)
            after = newer.messages[place:]
            if after and after[0]["role"] == "assistant":  # the answer as saved before: replaced
                after = after[1:]
            conversation.messages[:] = [*newer.messages[:place], answer, *after]
            conversation.title, conversation.settings = newer.title, newer.settings
            conversation.revision = newer.revision
        conversation.updated = time.time()
        self._write(conversation, path)

    @_locked
    def current(self, conversation: Conversation) -> Conversation:
        """The conversation as saved: `conversation` itself when nothing wrote it since the copy was
        read (or it was never saved), else the newer copy; `ConversationChanged` when deleted."""
        return conversation if self._is_current(conversation) else self.load(conversation.id)

    def _is_current(self, conversation: Conversation) -> bool:
        """Whether the copy is the file's latest (or was never saved); `ConversationChanged` when
        the conversation was deleted."""
        if conversation.id in self._deleted:
            raise ConversationChanged(DELETED)
        return self._saved_revision(self._path(conversation.id)) in (None, conversation.revision)

    @_locked
    def load(self, conversation_id: str) -> Conversation:
        return self._load(conversation_id, self._path(conversation_id))

    def _load(self, conversation_id: str, path: Path) -> Conversation:
        try:
            conversation = self._read(path)
        except FileNotFoundError:
            raise InputError(f"there is no saved conversation {conversation_id}") from None
        except _Unreadable as unreadable:
            self._report(unreadable.problem)
            raise InputError(unreadable.problem) from None
        conversation.id = conversation_id  # the file name is the id the list knows it by
        return conversation

    @_locked
    def list(self) -> list[Summary]:
        """Every saved conversation, most recently updated first."""
        summaries = []
        for path in self.folder.glob("*.json") if self.folder.is_dir() else []:
            if ID_PATTERN.fullmatch(path.stem):
                summary = self._summary(path)
                if summary is not None:
                    summaries.append(summary)
        return sorted(summaries, key=lambda summary: summary.updated, reverse=True)

    @_locked
    def rename(self, conversation_id: str, title: str) -> Conversation:
        """The conversation as saved, renamed."""
        title = one_line(title)
        if not title:
            raise InputError("a conversation needs a title: type at least one character")
        conversation = self.load(conversation_id)
        conversation.title = title
        self._write(conversation)  # renaming is not activity: the list order stays
        return conversation

    @_locked
    def delete(self, conversation_id: str) -> None:
        """Take the conversation out of the list; `undelete` brings it back until the next start
        of the app, which empties the bin."""
        path = self._path(conversation_id)
        if path.exists():
            os.replace(path, self._path(conversation_id, binned=True))
        self._deleted.add(conversation_id)
        self._summaries.pop(conversation_id, None)

    @_locked
    def undelete(self, conversation_id: str) -> None:
        path, deleted = self._path(conversation_id), self._path(conversation_id, binned=True)
        if not deleted.exists() or path.exists():  # gone, or saved again since (never overwritten)
            raise InputError("that conversation can no longer be brought back")
        os.replace(deleted, path)
        self._deleted.discard(conversation_id)

    @_locked
    def take_problems(self) -> list[str]:
        """Messages about files set aside since the last call, for the UI to show once."""
        problems, self._problems = self._problems, []
        return problems

    def _path(self, conversation_id: str, binned: bool = False) -> Path:
        """The conversation's file, or its copy in the bin."""
        _check_id(conversation_id)
        return self.folder / f"{conversation_id}.json{DELETED_SUFFIX if binned else ''}"

    def _write(self, conversation: Conversation, path: Path | None = None) -> None:
        path = path or self._path(conversation.id)
        text = to_json(dataclasses.replace(conversation, revision=conversation.revision + 1))
        # Written larger than the limit, it could never be opened again.
        CONVERSATION_FILE.check(len(text.encode("utf-8")), f"the conversation {conversation.title!r}")
        try:
            write_atomically(path, text)  # on failure the old file stays and the temporary goes
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SaveFailed(f"the disk is full: {self.folder} has no room for {human_size(len(text))}; "
                                 "conversation not saved (free some space and send again)") from None
            raise SaveFailed(f"cannot write to {self.folder}: {error.strerror or error}; "
                             "conversation not saved") from None
        conversation.revision += 1
        info = path.stat()
        self._revisions[path.name] = ((info.st_mtime_ns, info.st_size), conversation.revision)

    def _summary(self, path: Path) -> Summary | None:
        """The summary of one file, from the cache while the file is unchanged; None when it is
        gone or cannot be used (reported once)."""
        try:
            info = path.stat()
            version = (info.st_mtime_ns, info.st_size)
            cached = self._summaries.get(path.stem)
            if cached and cached[0] == version:
                return cached[1]
            conversation = self._read(path)
        except FileNotFoundError:  # deleted since the folder was listed
            return None
        except OSError as error:  # a symlink loop, no permission: `_read` words it the same way
            self._report(f"cannot read the saved conversation {path}: {error.strerror or error}; it was skipped")
            return None
        except _Unreadable as unreadable:
            self._report(unreadable.problem)
            return None
        summary = Summary(path.stem, conversation.title, conversation.updated)
        self._summaries[path.stem] = (version, summary)
        return summary

    def _read(self, path: Path) -> Conversation:
        """The conversation in `path`; `_Unreadable` (set aside or left alone as the problem says)
        when it cannot be one, `FileNotFoundError` when there is none."""
        try:
            info = path.stat()
            if stat.S_ISDIR(info.st_mode) or not stat.S_ISREG(info.st_mode):
                kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
                raise _Unreadable(f"{path} is {kind}, not a saved conversation: it was left as it is and skipped")
            _check_size(path, info.st_size)
            with path.open("rb") as file:
                data = file.read(CONVERSATION_FILE.bytes + 1)  # it may have grown since stat
        except FileNotFoundError:
            raise
        except OSError as error:  # no permission, an I/O error: nothing to repair from here
            raise _Unreadable(f"cannot read the saved conversation {path}: {error.strerror or error}; "
                              "it was skipped") from None
        _check_size(path, len(data))
        try:
            conversation = from_json(data.decode("utf-8-sig"))  # -sig: a file saved again by Notepad
        except ValueError:  # UnicodeDecodeError is a ValueError too
            raise _Unreadable(self._set_aside(path)) from None
        self._revisions[path.name] = ((info.st_mtime_ns, info.st_size), conversation.revision)
        return conversation

    def _saved_revision(self, path: Path) -> int | None:
        """The revision of the file on disk (None: no file, or one that cannot be read)."""
        try:
            info = path.stat()
            cached = self._revisions.get(path.name)
            if cached and cached[0] == (info.st_mtime_ns, info.st_size):
                return cached[1]
            return self._read(path).revision
        except OSError:
            return None
        except _Unreadable as unreadable:  # written over: what could be kept of it was set aside
            self._report(unreadable.problem)
            return None

    def _set_aside(self, path: Path) -> str:
        """Move a broken file out of the list's way; the line that reports it."""
        corrupt, copies = path.with_name(path.name + ".corrupt"), 1
        while corrupt.exists():  # an earlier broken copy is kept too: it may be all that is left of a chat
            corrupt, copies = path.with_name(f"{path.name}.{copies}.corrupt"), copies + 1
        self._summaries.pop(path.stem, None)
        try:
            os.replace(path, corrupt)
        except OSError as error:
            return f"a saved conversation could not be read, nor set aside ({error.strerror or error}): {path}"
        return f"a saved conversation could not be read and was set aside: {corrupt}"

    def _report(self, problem: str) -> None:
        """Report a problem once: a file left in place would otherwise be reported on every listing."""
        if problem not in self._reported:
            self._reported.add(problem)
            self._problems.append(problem)

    def _empty_the_bin(self) -> None:
        """Delete the conversations in the bin for good, and the saved documents only they used."""
        gone = set()
        for deleted in self.folder.glob(f"*.json{DELETED_SUFFIX}") if self.folder.is_dir() else []:
            deleted.unlink(missing_ok=True)
            gone.add(deleted.name.removesuffix(f".json{DELETED_SUFFIX}"))
        if self.documents is not None:
            document_owners.release(self.documents, {name for name in gone if ID_PATTERN.fullmatch(name)})

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


def _check_size(path: Path, size: int) -> None:
    """Reading a file past the limit would cost its size in memory: such a file is skipped."""
    try:
        CONVERSATION_FILE.check(size, f"the saved conversation {path}")
    except InputError as error:
        raise _Unreadable(f"{error}; it was left as it is and skipped") from None


def _check_id(conversation_id: str) -> None:
    """Ids become file names: only uuid4 hex gets near a path, so none can point elsewhere."""
    if not isinstance(conversation_id, str) or not ID_PATTERN.fullmatch(conversation_id):
        raise InputError(f"not a conversation id: {conversation_id!r}")
