"""One answer at a time in a conversation. A question sent from a second tab while the first tab's
answer in the same conversation is written is saved at once (a tab closed meanwhile keeps it);
its answer then waits for that one to end, and reads the turns as saved: the first answer whole,
not the first words the tab's copy held. Which answer began first: `LiveAnswers`' line.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Iterator

from .chat_view import View
from .conversation import Conversation
from .history import CHANGED, ConversationChanged, HistoryStore

# How soon the wait sees the other answer end; a view each time, as Gradio closes a handler (the
# tab gone) only between two of its views.
POLL_SECONDS = 0.5
WAITING = "⏳ Waiting for the answer being written in this conversation (another tab): yours follows it…"
STOPPED = "Stopped before the answer started; the question stays, for Retry to answer."


def after_earlier_answers(store: HistoryStore, conversation: Conversation, restore: list[dict], answer: object,
                          stopped: threading.Event) -> Iterator[View]:
    """Views saying so while an answer begun before `answer` (`LiveAnswers.writing`'s) is written in
    the conversation, until it ends or Stop sets `stopped`; then, having waited, the conversation
    follows the saved turns (`follow_saved_turns`). Its last message is the answer to come."""
    if not store.live_answers.ahead_of(conversation.id, answer):
        return
    # Shown without the answer to come, and not as this tab's stream: the one being written is the
    # last answer, marked so (its copy here stops at the words it had when this tab asked).
    asked = dataclasses.replace(conversation, messages=conversation.messages[:-1])
    while store.live_answers.ahead_of(conversation.id, answer) and not stopped.is_set():
        yield View(conversation=asked, status=WAITING)
        stopped.wait(POLL_SECONDS)
    follow_saved_turns(store, conversation, restore)


def follow_saved_turns(store: HistoryStore, conversation: Conversation, restore: list[dict]) -> None:
    """The conversation (its last message the answer to come) as saved, with that answer, where the
    saved one still ends as the answer's turn did (`restore`: the messages without the answer to
    come, or with the one it writes over): on its question, or that and the answer a retry or a
    continuation replaces. `restore` follows too. `ConversationChanged` when it ends otherwise
    (another tab edited it, or asked after this question)."""
    saved = store.current(conversation)
    if saved is conversation:
        return
    turn = restore[len(conversation.messages) - 2:]  # the question, and the answer a retry or continuation replaces
    if saved.messages[-len(turn):] != turn:
        raise ConversationChanged(CHANGED)
    question = len(saved.messages) - len(turn)  # the turns before it may have grown (the answer waited for)
    restore[:] = saved.messages
    vars(conversation).update(vars(saved), messages=[*saved.messages[:question + 1], conversation.messages[-1]])


def taken_back(store: HistoryStore, conversation: Conversation, restore: list[dict]) -> None:
    """No answer came (a Stop while it waited): the conversation back to `restore`, saved. A file
    that moved on meanwhile holding the same turns (renamed) gives its name and revision: it was a
    "changed meanwhile" warning."""
    saved = store.current(conversation)
    if saved is not conversation and saved.messages in (conversation.messages, restore):  # its empty answer saved, or not yet
        conversation.title, conversation.revision = saved.title, saved.revision
    conversation.messages[:] = restore
    store.save(conversation)


def renamed_meanwhile(store: HistoryStore, asked: Conversation) -> str:
    """The name `asked` (a question saved while the model loaded) was given since, which it takes
    with the file's revision; "" when none (or deleted meanwhile). Its restore then saves, where it
    failed "changed meanwhile" and left a second conversation holding the question."""
    try:
        saved = store.current(asked)
    except ConversationChanged:
        return ""
    if saved is asked or saved.messages != asked.messages:  # not only renamed: the restore stays refused
        return ""
    asked.revision, asked.title = saved.revision, saved.title
    return saved.title


def only_written_on(copy: Conversation, saved: Conversation) -> bool:
    """Whether the saved conversation differs from a tab's copy only as the answer being written
    when the copy was shown has gone on since: worth no note (a tab opened mid-answer)."""
    if len(copy.messages) != len(saved.messages) or copy.messages[:-1] != saved.messages[:-1] or not copy.messages:
        return False
    shown, written = copy.messages[-1], saved.messages[-1]
    return (shown["role"] == written["role"] == "assistant" and bool(shown.get("partial"))
            and written["content"].startswith(shown["content"]))
