"""How much of the model's context a conversation fills, and how to cut a document to fit."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import InputError
from .documents import user_turn

# Tokens kept free for the answer. A reply needs some room, but the answer limit may be set far
# above what a long document leaves, so only this much of it counts against the prompt.
ANSWER_RESERVE = 256
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
    reserve: int  # tokens kept for the answer

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


def measure(engine, system: str, history: list[dict], document: str, question: str,
            max_new_tokens: int) -> Meter:
    """The meter for the next turn: `document` and `question` form the new user message."""
    messages = ([{"role": "system", "content": system}] if system else []) + history
    messages = messages + [{"role": "user", "content": user_turn(question, document)}]
    return Meter(
        system=engine.count_tokens(system) if system else 0,
        history=sum(engine.count_tokens(message["content"]) for message in history),
        document=engine.count_tokens(document.strip()) if document else 0,
        question=engine.count_tokens(question.strip()),
        prompt=len(engine.chat_ids(messages)),
        context=engine.context_length,
        reserve=min(max_new_tokens, ANSWER_RESERVE),
    )


def describe(meter: Meter) -> str:
    """One Markdown line for the page, e.g. "**7,812 / 8,192 tokens** · document 7,402 · … ·
    256 kept for the answer"; parts with no tokens are left out."""
    parts = [f"**{meter.prompt:,} / {meter.context:,} tokens**"]
    parts += [f"{name} {count:,}" for name, count in (("document", meter.document), ("history", meter.history),
                                                      ("system", meter.system), ("question", meter.question))
              if count]
    parts.append(f"{meter.reserve:,} kept for the answer")
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
    marker = cut_marker(cut)
    keep = len(ids) - cut
    if where == "start":
        return f"{marker}\n\n{_decode(tokenizer, ids[cut:])}", cut
    if where == "end":
        return f"{_decode(tokenizer, ids[:keep])}\n\n{marker}", cut
    head = (keep + 1) // 2
    return f"{_decode(tokenizer, ids[:head])}\n\n{marker}\n\n{_decode(tokenizer, ids[head + cut:])}", cut


def _decode(tokenizer, ids: list[int]) -> str:
    """Text of a slice of ids; a slice can split a character's bytes, which decode as U+FFFD."""
    return tokenizer.decode(ids).strip().strip("\ufffd").strip()
