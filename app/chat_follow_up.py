"""Room for a follow-up that does not fit: the oldest turns are left out of what the model reads,
whole turns (a question with its answer) and as few as make room. Every document stays, and the
turns stay in the chat, marked. `ChatLogic.send` does it unasked unless the settings say to ask
first; the over-limit panel offers it only where it makes room."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Iterator

from .chat_view import LEAVE_OUT_OLDEST, Settings, View
from .conversation import Conversation

if TYPE_CHECKING:
    from .ui_chat import ChatLogic


def earlier_messages(conversation: Conversation | None) -> list[int]:
    """The indexes of the messages that can still be left out of what the model reads, oldest first."""
    if conversation is None:
        return []
    return [index for index, message in enumerate(conversation.messages) if not message.get("left_out")]


def turns_to_leave_out(chat: ChatLogic, conversation: Conversation | None, attachment: dict | None, question: str,
                       settings: Settings) -> list[int]:
    """The indexes of the fewest oldest messages, whole turns, whose leaving out lets the question
    (with `attachment`) fit; [] when leaving out every one is still not enough."""
    earlier = earlier_messages(conversation)
    # How many of `earlier` may go: a turn ends where the next kept message is a question.
    ends = [count for count in range(1, len(earlier) + 1)
            if count == len(earlier) or conversation.messages[earlier[count]]["role"] == "user"]

    def fits(count: int) -> bool:
        trial = dataclasses.replace(conversation, messages=_marked(conversation.messages, earlier[:count]))
        return not chat.meter(trial, attachment, "", question, settings).over

    if not ends or not fits(ends[-1]):
        return []
    # Leaving more out never makes the prompt longer: the fewest that fit, by bisection.
    low, high = 0, len(ends) - 1
    while low < high:
        middle = (low + high) // 2
        if fits(ends[middle]):
            high = middle
        else:
            low = middle + 1
    return earlier[:ends[low]]


def leave_out(conversation: Conversation, indexes: list[int]) -> str:
    """Mark the messages left out (the caller saves the conversation); the line that says so."""
    conversation.messages[:] = _marked(conversation.messages, indexes)
    turns = sum(conversation.messages[index]["role"] == "user" for index in indexes) or 1
    return (f"✂ The {'oldest turn was' if turns == 1 else f'{turns} oldest turns were'} left out of what the model "
            "reads to make room (documents stay; marked in the chat). Settings → “When a follow-up does not fit” "
            "can ask first instead.")


def make_room(chat: ChatLogic, conversation: Conversation | None, attachment: dict | None, question: str,
              settings: Settings) -> str:
    """Leave the oldest turns out, unasked, where the settings say so and that makes room: the line
    that says so, or "" (nothing changed: the choices are offered)."""
    if settings.follow_up_room != LEAVE_OUT_OLDEST or conversation is None:
        return ""
    indexes = turns_to_leave_out(chat, conversation, attachment, question, settings)
    return leave_out(conversation, indexes) if indexes else ""


def room_to_ask_again(chat: ChatLogic, conversation: Conversation, index: int, question: str,
                      settings: Settings) -> tuple[bool, str]:
    """Whether the question at `index`, asked again as `question` (an edit, a retry) with its
    document and the turns before it, fits with the whole answer limit, the oldest turns left out
    first as the settings allow: (True, the line saying what was left out, or "") or (False, why
    not). Nothing of the conversation changes unless it fits."""
    if index < 0 or conversation.messages[index]["role"] != "user":  # a hand-edited file: no question to measure
        return True, ""
    before = dataclasses.replace(conversation, messages=conversation.messages[:index])
    document = conversation.messages[index].get("document")
    meter = chat.meter(before, document, "", question, settings)
    if not meter.over:
        return True, ""
    note = make_room(chat, before, document, question, settings)
    if note:
        conversation.messages[:index] = before.messages  # the turns left out, marked
        return True, note
    return False, (f"⚠️ Asked again, this does not fit: the prompt would be {meter.prompt:,} tokens with "
                   f"{meter.reserve:,} kept for the answer, {meter.excess:,} more than the model reads. Nothing was "
                   "changed: shorten the question, or lower the answer limit in Settings.")


def noted(views: Iterator[View], note: str) -> Iterator[View]:
    """The answer's views with `note` kept in the status line while it streams and after (an
    answer clears the line as it starts)."""
    with contextlib.closing(views):  # a Stop that closes this closes the answer too
        for view in views:
            yield dataclasses.replace(view, status=note) if note and view.status == "" else view


def _marked(messages: list[dict], indexes: list[int]) -> list[dict]:
    chosen = set(indexes)
    return [dict(message, left_out=True) if index in chosen else message for index, message in enumerate(messages)]
