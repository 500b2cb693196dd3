"""Token counts remembered per tokenizer and text, so that the context meter, recounted at every
keystroke and every reopening, tokenizes only the text that changed.

The counts live in memory, keyed by the tokenizer and a hash of the text, rather than stored with
each message: a count belongs to one tokenizer while a conversation is reopened under other
models, and a count in the file is one more field a hand-edited file can get wrong (a wrong count
would make the meter lie). What this costs, one count of each text per process, is bounded by the
conversation size limit.
"""

from __future__ import annotations

import hashlib
import re
import threading
import weakref
from collections import OrderedDict

from ..core.chat_text import inert_control_tokens

KEPT = 4096  # counts kept per tokenizer: far more messages than a conversation within the limit holds
# A stretch longer than twice this (a pasted book and the question under it) is counted as a
# remembered head and a tail recounted at each keystroke, once the two are seen to add up.
HEAD_STEP = 16_384
# A conversation whose cut at special tokens must count as it does whole, or the cut is not used.
PROBE = [{"role": "system", "content": " Be brief.  "},
         {"role": "user", "content": "  Hello\n\nworld  — héllo 你好 <b>x</b>\t"},
         {"role": "assistant", "content": " Sure:\n 1. one\n\n"},
         {"role": "user", "content": "\nAnd then?"}]

_lock = threading.Lock()
_counters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a swapped-out model's counts go with it


class TokenCounter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        added = sorted((token.content for token in tokenizer.added_tokens_decoder.values()), key=len, reverse=True)
        self._added = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        self._pieces_add_up = self._added is not None and self._piecewise(self._render(PROBE)) == self._whole(PROBE)
        self._heads_adding_up: OrderedDict[bytes, bool] = OrderedDict()  # head's key -> head + tail == whole

    def count(self, text: str) -> int:
        """Tokens in `text` alone, as `Engine.count_tokens` counts them."""
        key = _key(text)
        with _lock:
            if key in self._counts:
                self._counts.move_to_end(key)
                return self._counts[key]
        count = len(self.tokenizer.encode(text, add_special_tokens=False))
        with _lock:
            self._counts[key] = count
            if len(self._counts) > KEPT:
                self._counts.popitem(last=False)
        return count

    def stretch(self, text: str) -> int:
        """`count(text)` where only the end of `text` changes between calls, as the question under
        a long document does while it is typed: the head, cut before a space at a place that moves
        only every `HEAD_STEP` characters, is counted once. A tokenizer could join tokens across
        the cut, so a head is trusted only once head + tail has counted as the whole."""
        cut = _cut(text)
        if cut is None:
            return self.count(text)
        head, tail = text[:cut], text[cut:]
        key = _key(head)
        with _lock:
            adds_up = self._heads_adding_up.get(key)
        if adds_up:
            return self.count(head) + self.count(tail)
        whole = self.count(text)
        if adds_up is None:
            adds_up = self.count(head) + self.count(tail) == whole
            with _lock:
                self._heads_adding_up[key] = adds_up
                if len(self._heads_adding_up) > KEPT:
                    self._heads_adding_up.popitem(last=False)
        return whole

    def prompt(self, messages: list[dict]) -> int:
        """The length of `Engine.chat_ids(messages)`. The tokenizer splits its input at added
        tokens (the template's markers) before anything else, so each stretch between them counts
        alone and is remembered: a new question tokenizes only itself, never the history. Where a
        tokenizer does not split that way (the probe says), the whole prompt is counted, remembered too."""
        text = self._render(messages)
        return self._piecewise(text) if self._pieces_add_up else self.stretch(text)

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(inert_control_tokens(messages, self.tokenizer),
                                                  add_generation_prompt=True, tokenize=False)

    def _piecewise(self, text: str) -> int:
        # re.split with a group alternates stretches (even places) and added tokens (odd places).
        pieces = self._added.split(text)
        return sum(1 if index % 2 else self.stretch(piece) for index, piece in enumerate(pieces) if piece)

    def _whole(self, messages: list[dict]) -> int:
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return len(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _cut(text: str) -> int | None:
    """Where `stretch` cuts `text`: before a single space between two words, at most `HEAD_STEP`
    characters before a multiple of it that leaves the tail at least `HEAD_STEP` long; None for a
    short text or one without such a space there."""
    if len(text) < 2 * HEAD_STEP:
        return None
    step_end = (len(text) - HEAD_STEP) // HEAD_STEP * HEAD_STEP
    place = text.rfind(" ", step_end - HEAD_STEP, step_end)
    while place > step_end - HEAD_STEP:
        if not text[place - 1].isspace() and not text[place + 1].isspace():
            return place
        place = text.rfind(" ", step_end - HEAD_STEP, place)
    return None


def counter(tokenizer) -> TokenCounter:
    """The counter of `tokenizer`, made on first use."""
    with _lock:
        found = _counters.get(tokenizer)
    if found is None:
        found = TokenCounter(tokenizer)
        with _lock:
            found = _counters.setdefault(tokenizer, found)
    return found
