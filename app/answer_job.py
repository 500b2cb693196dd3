"""The chat tab's answer as a job for the engine thread (`engine_queue`): its prompt (a new answer,
or the last one carried on from its last word), the conversation its KV is kept for, its latest
document's saved KV, and first the mode that runs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from dataclasses import dataclass
from typing import Iterator

from ..core.request import Request
from .chat_versions import continued_ids
from .conversation import Conversation, model_messages
from .documents import document_tokens


@dataclass(frozen=True)
class Started:
    """The first event of the job: the mode that runs (`auto` resolved)."""
    mode: str


@dataclass(frozen=True)
class ConversationKv:
    """What an answer's KV is kept as. `conversation`: the id of the conversation it belongs to
    (the engine keeps one KV per conversation, taken back by its next answer whatever it changed:
    a retry or an edit never leaves a copy behind). `document`: the text of the document whose KV
    is saved to disk, so that the conversation reopened after a restart does not read it again;
    `before`: what the model reads ahead of that document's turn."""
    conversation: str = ""
    before: tuple[dict, ...] = ()
    document: str = ""


def conversation_kv(conversation: Conversation) -> ConversationKv:
    """The conversation's id, and its latest document: that of the last question carrying one,
    wherever in the conversation it was attached (a summary of its parts, a cut, are documents
    too), with the turns before it as the model reads them now."""
    latest = latest_document(conversation)
    if latest is None:
        return ConversationKv(conversation.id)
    before = model_messages(dataclasses.replace(conversation, messages=conversation.messages[:latest]))
    return ConversationKv(conversation.id, tuple(before), conversation.messages[latest]["document"]["text"])


def latest_document(conversation: Conversation) -> int | None:
    """The index of the last question that carries a document (None: none does)."""
    for index in range(len(conversation.messages) - 1, -1, -1):
        message = conversation.messages[index]
        if message["role"] == "user" and ((message.get("document") or {}).get("text") or "").strip():
            return index
    return None


def answer_job(messages: list[dict], max_new_tokens: int, sampling, mode: str, kept: ConversationKv | None = None,
               continued: bool = False):
    """The job answering `messages`, its KV kept as `kept` says (None: no conversation's, no
    document saved). `continued`: the last message is an answer to carry on, its text the start
    of the assistant's turn (`chat_versions.continued_ids`)."""
    kept = kept or ConversationKv()

    def job(engine, cancel) -> Iterator:
        saved = saved_tokens(engine, kept.before, kept.document) if kept.document else 0
        prompt = continued_ids(engine, messages) if continued else engine.chat_ids(messages)
        request = Request(max_new_tokens, sampling, mode, document_tokens=saved, conversation=kept.conversation)
        events = engine.generate(prompt, request, cancel)
        yield Started(engine.resolve_mode(mode))
        yield from events
    return job


# Per engine, the saved prefix's length by what it was measured for: each follow-up asks about the
# same document again, and the three prompts that measure it took 0.7 s to tokenize at 122K tokens
# on a 2-core CPU (2 ms from here), before every answer.
_SAVED_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
SAVED_TOKENS_KEPT = 32


def saved_tokens(engine, before: tuple[dict, ...], document: str) -> int:
    """`documents.document_tokens`, measured once per engine for the same turns and document."""
    key = hashlib.sha256(json.dumps([before, document], ensure_ascii=False).encode("utf-8", "surrogatepass")).digest()
    lengths = _SAVED_TOKENS.setdefault(engine, {})
    if key not in lengths:
        while len(lengths) >= SAVED_TOKENS_KEPT:
            lengths.pop(next(iter(lengths)))  # the oldest first
        lengths[key] = document_tokens(engine, list(before), document)
    return lengths[key]
