"""Incremental detokenization: token ids in, text deltas out.

Decoding the whole answer each time and emitting the new suffix keeps multi-token characters
and tokenizer clean-ups right; a trailing U+FFFD means a character is still incomplete, so it
waits for the next token.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # emitted so far

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        """Append tokens; return the text that became final."""
        self.ids.extend(ids)
        text = self._decode()
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta

    def finish(self) -> str:
        """The rest of the text, once no more tokens come."""
        text = self._decode()
        delta = text[len(self.text):] if text.startswith(self.text) else ""
        self.text = text
        return delta
