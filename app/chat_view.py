"""What the chat tab's handlers take and give: the `Settings` of a question, and the `View` of what
a handler changed, which `ui.py` draws onto the page's components."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.errors import InputError, SpecchatError, first_line
from .conversation import Conversation, shown_messages

KEPT_SETTINGS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "mode", "repetition_penalty",
                 "follow_up_room")
# What a follow-up that does not fit does (`follow_up_room`): the oldest turns are left out of what the
# model reads, marked in the chat, or the over-limit choices are offered. Words, not a bool: a
# conversation's saved settings hold numbers and words.
LEAVE_OUT_OLDEST, ASK_FIRST = "leave out the oldest turns", "ask"
# A path in an error's message (/home/…, ~/…, C:\…): left out of the reason saved with an answer.
PATH = re.compile(r"(?<!\S)(?:[A-Za-z]:)?[\\/~]\S*")


@dataclass(frozen=True)
class Settings:
    system: str
    preset: str
    temperature: float
    top_p: float
    top_k: int
    seed: str | float | None  # blank or None: a fresh seed each time
    max_new_tokens: int
    mode: str
    repetition_penalty: float = 1.0
    follow_up_room: str = LEAVE_OUT_OLDEST

    def kept(self) -> dict:
        """The settings a conversation keeps and brings back when reopened (the system prompt and
        preset are fields of their own)."""
        return {name: getattr(self, name) for name in KEPT_SETTINGS}

    def sampling(self):
        """The sampling settings; the repeat guard as the preset has it (on in every preset)."""
        from ..core.sampling import SamplingParams
        from .presets import PRESETS

        try:
            seed = None if str(self.seed or "").strip() == "" else int(str(self.seed).strip())
            return SamplingParams(float(self.temperature), int(self.top_k), float(self.top_p), seed,
                                  repetition_penalty=float(self.repetition_penalty),
                                  stop_repeats=PRESETS.get(self.preset, PRESETS["free"]).stop_repeats)
        except ValueError as error:
            problem = str(error) if "must" in str(error) else f"the seed must be a whole number, got {self.seed!r}"
            raise InputError(problem) from None


@dataclass
class View:
    """What a handler changed; None: leave the component as it is."""
    conversation: Conversation | None = None
    status: str | None = None
    message: str | None = None
    attachment: dict | None = None
    clear_attachment: bool = False
    pasted: str | None = None
    stats: str | None = None
    stages: str | None = None
    tokens: str | None = None
    over_limit: str | None = None  # the over-limit choice's text; "" hides it
    cuts: dict[str, str] | None = None  # where -> the cut's button label; None: no document to cut
    answer_room: int = 0  # a shorter answer limit that fits, offered as a choice; 0: none does
    can_leave_out: bool = False  # leaving earlier turns out makes room
    in_parts: bool = False  # the document can be summarized in parts
    longer_pairs: list[tuple[str, str]] | None = None
    streaming: bool = False
    # The chat's bubbles as drawn (a rename: redrawn from the saved copy, they would flash an
    # answer streaming in this tab back to its last save).
    same_messages: bool = False
    pending: str = ""  # shown in the streaming answer's bubble until its first word (Markdown of ours)
    conversations_changed: bool = False
    clear_conversation: bool = False  # show an empty, new conversation
    # An opened conversation's own system prompt and preset, shown in the settings: otherwise the
    # page's (after a reload, the defaults) would replace them at its next question.
    system: str | None = None
    preset: str | None = None
    settings: dict | None = None  # an opened conversation's own settings (`KEPT_SETTINGS`), likewise
    deleted: str | None = None  # the id of a conversation just deleted, offered to undo; "": none now


def problem_text(error: Exception) -> str:
    """An error as one line for the page, never a traceback."""
    text = str(error) if isinstance(error, SpecchatError) else f"unexpected error: {type(error).__name__}: {error}"
    return f"⚠️ {text}"


def error_reason(error: Exception) -> str:
    """Why `error` cut an answer short, in a few words saved with the answer: the first clause of
    one of ours (the advice after it, and any path, left out), or only the kind of an unexpected
    one (its message may quote paths, or a traceback's lines)."""
    if not isinstance(error, SpecchatError):
        return f"an unexpected {type(error).__name__}"
    return PATH.sub("…", re.split(r"[:;]\s", first_line(error), maxsplit=1)[0]).strip()


def shown(conversation: Conversation | None, streaming: bool = False, pending: str = "",
          writing: bool = False) -> list[dict]:
    return shown_messages(conversation, streaming, pending, writing) if conversation else []
