"""The chat tab's answer as a job for the engine thread (`engine_queue`): its prompt (a new answer,
or the last one carried on from its last word), the opening document's saved KV, and first the
mode that runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..core.request import Request
from .chat_versions import continued_ids
from .conversation import Conversation
from .documents import document_tokens


@dataclass(frozen=True)
class Started:
    """The first event of the job: the mode that runs (`auto` resolved)."""
    mode: str


def answer_job(messages: list[dict], max_new_tokens: int, sampling, mode: str, document: str = "",
               continued: bool = False):
    """The job answering `messages`. `document`: the text the conversation opens with, whose KV is
    saved to disk, so that the conversation reopened after a restart does not read it again.
    `continued`: the last message is an answer to carry on, its text the start of the assistant's
    turn (`chat_versions.continued_ids`)."""
    def job(engine, cancel) -> Iterator:
        system = messages[:1] if messages and messages[0]["role"] == "system" else []
        saved = document_tokens(engine, system, document) if document else 0
        prompt = continued_ids(engine, messages) if continued else engine.chat_ids(messages)
        events = engine.generate(prompt, Request(max_new_tokens, sampling, mode, document_tokens=saved), cancel)
        yield Started(engine.resolve_mode(mode))
        yield from events
    return job


def opening_document(conversation: Conversation) -> str:
    """The text of the document the conversation opens with ("" when it opens without one)."""
    first = conversation.messages[0] if conversation.messages else {}
    return (first.get("document") or {}).get("text", "") if first.get("role") == "user" else ""
