"""How much of the model's context a conversation fills, and how to cut a document to fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.errors import InputError
from .conversation import Conversation
from .documents import user_turn
from .token_counts import counter

# The shortest answer limit offered when the one set does not fit: less is no answer worth having.
MIN_ANSWER = 128
ANSWER_STEP = 16  # the answer limit's step in the page's slider: an offered limit is a multiple of it
CUTS = ("start", "middle", "end")
# Decoded text can re-tokenize a few tokens differently at the cut, so a cut takes this many more.
CUT_MARGIN = 16


@dataclass(frozen=True)
class Meter:
    system: int  # tokens of each part, counted alone
    history: int
    document: int
    question: int
    prompt: int  # the whole prompt as the model reads it, chat template included
    context: int  # the most tokens the model reads
    reserve: int  # tokens kept for the answer: the whole answer limit, so that an answer has room to end

    @property
    def needed(self) -> int:
        return self.prompt + self.reserve

    @property
    def over(self) -> bool:
        return self.needed > self.context

    @property
    def excess(self) -> int:
        return max(0, self.needed - self.context)

    @property
    def fraction(self) -> float:
        return self.needed / self.context

    @property
    def answer_room(self) -> int:
        """The longest answer limit (a multiple of `ANSWER_STEP`) that ends before the context
        does, so that the answer never runs into its end; 0 when no useful one fits."""
        room = (self.context - self.prompt - 1) // ANSWER_STEP * ANSWER_STEP
        return room if room >= MIN_ANSWER else 0


def measure(engine, system: str, history: list[dict], document: str, question: str,
            max_new_tokens: int) -> Meter:
    """The meter for the next turn: `document` and `question` form the new user message. Counts
    are remembered (`token_counts`): recounting after a keystroke or a reopening tokenizes only
    what changed."""
    messages = ([{"role": "system", "content": system}] if system else []) + history
    messages = messages + [{"role": "user", "content": user_turn(question, document)}]
    counts = counter(engine.tokenizer)
    return Meter(
        system=counts.count(system) if system else 0,
        history=sum(counts.count(message["content"]) for message in history),
        document=counts.count(document.strip()) if document else 0,
        question=counts.count(question.strip()),
        prompt=counts.prompt(messages),
        context=engine.context_length,
        reserve=max_new_tokens,
    )


def describe(meter: Meter) -> str:
    """One Markdown line for the page, e.g. "**7,812 + 512 / 8,192 tokens** (prompt + answer
    limit) · document 7,402 · …"; parts with no tokens are left out."""
    parts = [f"**{meter.prompt:,} + {meter.reserve:,} / {meter.context:,} tokens** (prompt + the answer limit)"]
    parts += [f"{name} {count:,}" for name, count in (("document", meter.document), ("history", meter.history),
                                                      ("system", meter.system), ("question", meter.question))
              if count]
    line = " · ".join(parts)
    return f"{line} — **over the limit by {meter.excess:,} tokens**" if meter.over else line


def cut_marker(tokens: int) -> str:
    """What stands where text was cut, so neither the model nor the reader takes the rest as whole."""
    return f"[… {tokens:,} tokens cut …]"


def cut_document(tokenizer, text: str, remove_tokens: int, where: str) -> tuple[str, int]:
    """`text` with at least `remove_tokens` of its tokens cut at its start, middle or end and a
    marker in their place: (new text, tokens cut). The cut also pays for the marker, so the new
    text is `remove_tokens` shorter as a whole."""
    if where not in CUTS:
        raise InputError(f"unknown cut {where!r}: choose from {', '.join(CUTS)}")
    if remove_tokens <= 0:
        return text, 0
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The marker's number has at most as many digits as the document's length.
    marker_tokens = len(tokenizer.encode(f"\n\n{cut_marker(len(ids))}\n\n", add_special_tokens=False))
    cut = remove_tokens + marker_tokens + CUT_MARGIN
    if cut >= len(ids):
        raise InputError(f"the document cannot be cut enough: it has {len(ids):,} tokens and "
                         f"{remove_tokens:,} must go, which leaves nothing worth keeping; start a new "
                         "conversation or choose a longer-context pair")
    keep = len(ids) - cut
    # Each edge moves (a token or three) to where no character's bytes are split, cutting more.
    if where == "start":
        start = _whole_characters(tokenizer, ids, cut, 1)
        return f"{cut_marker(start)}\n\n{_decode(tokenizer, ids[start:])}", start
    if where == "end":
        end = _whole_characters(tokenizer, ids, keep, -1)
        return f"{_decode(tokenizer, ids[:end])}\n\n{cut_marker(len(ids) - end)}", len(ids) - end
    head = _whole_characters(tokenizer, ids, (keep + 1) // 2, -1)
    tail = _whole_characters(tokenizer, ids, (keep + 1) // 2 + cut, 1)
    marker = cut_marker(tail - head)
    return f"{_decode(tokenizer, ids[:head])}\n\n{marker}\n\n{_decode(tokenizer, ids[tail:])}", tail - head


def _whole_characters(tokenizer, ids: list[int], index: int, step: int) -> int:
    """`index` moved by `step` until the ids before it end on a whole character: byte-level
    tokens can split a character (an emoji, a CJK one) over up to four tokens, and a slice ending
    inside one decodes to U+FFFD, the character lost from both sides."""
    for _ in range(4):
        if not 0 < index < len(ids) or not tokenizer.decode(ids[max(0, index - 4):index]).endswith("\ufffd"):
            break
        index += step
    return index


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids).strip()


def split_document(tokenizer, text: str, part_tokens: int) -> list[str]:
    """`text` in consecutive parts of at most about `part_tokens` tokens each, cut at a line break
    where one is near the end of a part (so a part rarely stops mid-sentence)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    parts, start = [], 0
    while start < len(ids):
        end = min(len(ids), start + part_tokens)
        if end < len(ids):
            window = _decode(tokenizer, ids[start:end])
            cut = window.rfind("\n", len(window) * 3 // 4)
            if cut > 0:
                end = start + len(tokenizer.encode(window[:cut], add_special_tokens=False))
            end = _whole_characters(tokenizer, ids, end, 1)
        parts.append(_decode(tokenizer, ids[start:end]))
        start = end
    return [part for part in parts if part]


def turn_in_preparation(conversation: Conversation | None, document: str) -> tuple[Conversation, str] | None:
    """(the conversation before it, its question) while work before an answer (summarizing parts,
    loading) shows a question with `document`, which the page keeps attached until the answer starts."""
    messages = conversation.messages if conversation else []
    if (len(messages) < 2 or not document or not messages[-1].get("partial") or messages[-1]["content"]
            or (messages[-2].get("document") or {}).get("text") != document):
        return None
    return dataclasses.replace(conversation, messages=messages[:-2]), messages[-2]["content"]


def document_text(attachment: dict | None, pasted: str | None) -> str:
    """The document a question carries: the attached file's text, else what was pasted."""
    if attachment is not None:
        return attachment["text"]
    return (pasted or "").strip()
