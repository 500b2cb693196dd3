"""The chat tab's list of saved conversations: open, the newest at a page load, rename, delete and
bring back, export. Each returns the `View` of what changed, as the chat's other handlers do."""

from __future__ import annotations

import collections
import contextlib
import time

from ..core.errors import InputError
from .chat_view import KEPT_SETTINGS, View, problem_text
from .conversation import Conversation
from .exports import write_export
from .history import ConversationChanged, HistoryStore, Summary
from .chat_versions import figures


class ConversationList:
    def __init__(self, store: HistoryStore):
        self.store = store

    def choices(self, query: str = "") -> list[tuple[str, str]]:
        """(label, id) of each saved conversation, newest first, each with when it last changed;
        labels that still repeat get a number. `query`: only those whose title, messages or
        documents' names hold it (any case)."""
        summaries = self.store.list()
        if query.strip():
            summaries = [summary for summary in summaries if self._holds(summary, query.strip().casefold())]
        now = time.time()
        labels = [f"{summary.title} · {when(summary.updated, now)}" for summary in summaries]
        repeats, seen = collections.Counter(labels), collections.Counter()
        for index, label in enumerate(labels):
            seen[label] += 1
            if repeats[label] > 1:
                labels[index] = f"{label} ({seen[label]})"
        return [(label, summary.id) for label, summary in zip(labels, summaries)]

    def _holds(self, summary: Summary, query: str) -> bool:
        if query in summary.title.casefold():
            return True
        try:
            conversation = self.store.load(summary.id)
        except InputError:  # unreadable since it was listed: the list's next read reports it
            return False
        return any(query in message.get("content", "").casefold()
                   or query in (message.get("document") or {}).get("name", "").casefold()
                   for message in conversation.messages)

    def open(self, conversation_id: str | None) -> View:
        if not conversation_id:
            return View()
        conversation = self.store.load(conversation_id)
        last = next((m for m in reversed(conversation.messages) if m["role"] == "assistant"), None)
        return View(conversation=conversation, over_limit="", system=conversation.system, preset=conversation.preset,
                    settings={name: value for name, value in conversation.settings.items() if name in KEPT_SETTINGS},
                    **(figures(last) if last else {"stats": "", "stages": "", "tokens": ""}))

    def as_saved(self, conversation: Conversation | None) -> View | None:
        """None when the tab's copy is the conversation as saved; else the view that shows it as
        saved, refusing the action (Retry, Continue, an edit) asked on turns the tab showed."""
        if conversation is None:
            return None
        try:
            saved = self.store.current(conversation)
        except ConversationChanged as gone:
            return View(status=problem_text(gone))
        if saved is conversation:
            return None
        view = self.open(conversation.id)
        view.status = ("This conversation had changed since it was shown (another tab, or an answer that ended "
                       "later): here it is as saved; try again.")
        return view

    def newest(self) -> View:
        problems = self.store.take_problems()
        choices = self.choices()
        view = self.open(choices[0][1]) if choices else View(clear_conversation=True)
        view.status = " ".join(f"⚠️ {problem}" for problem in problems) or None
        view.conversations_changed = True
        return view

    def rename(self, conversation: Conversation | None, title: str) -> View:
        if conversation is None:
            raise InputError("start the conversation before naming it")
        renamed = self.store.rename(conversation.id, title)  # the tab's copy becomes the file's latest
        return View(conversation=renamed, same_messages=True, conversations_changed=True,
                    status=f"Renamed to “{renamed.title}”.")

    def delete(self, conversation: Conversation | None) -> View:
        """Delete the conversation; it can be brought back (`undelete`) until the app restarts."""
        if conversation is None or not conversation.messages:
            return View(status="Nothing to delete: this conversation is not saved yet.")
        self.store.delete(conversation.id)
        view = self.newest()
        view.status = f"Deleted “{conversation.title}”."
        view.deleted = conversation.id
        return view

    def undelete(self, conversation_id: str | None) -> View:
        if not conversation_id:
            return View(status="Nothing to bring back.")
        self.store.undelete(conversation_id)
        view = self.open(conversation_id)
        view.conversations_changed, view.deleted, view.status = True, "", "Brought back."
        return view

    def export(self, conversation: Conversation | None) -> list[str]:
        """The conversation as saved: a tab's older copy may hold an answer that has ended since,
        which it would show cut short."""
        if conversation is not None:
            with contextlib.suppress(ConversationChanged):  # deleted: the tab's copy is all there is
                conversation = self.store.current(conversation)
        return write_export(conversation, conversation is not None and conversation.id in self.store.live_answers)


def when(updated: float, now: float) -> str:
    """When a conversation last changed, as short as stays clear: the time today, the day this
    year, else the date."""
    then, today = time.localtime(updated), time.localtime(now)
    if then[:3] == today[:3]:
        return time.strftime("%H:%M", then)
    return time.strftime("%b %d" if then.tm_year == today.tm_year else "%b %d %Y", then)
