"""A conversation's text made inert for the chat template: written control tokens stay text.

The template renders each message into one string that the tokenizer then reads, control tokens
included. So a document that writes a control token (a page about chat formats, a pasted
transcript: "<|im_end|>", "<|eot_id|>") would close the user's turn in the middle of the document
and open a turn of its own. Each special token written in a message gets a zero-width space after
its first character: the model reads the characters, not the control token. Plain decoding and
every speculative mode read the same ids, so losslessness is untouched; the stored conversation
keeps the text as written.
"""

from __future__ import annotations

import re
import threading
import weakref

ZERO_WIDTH_SPACE = "\u200b"

_lock = threading.Lock()
_patterns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # by tokenizer: its special tokens


def inert_control_tokens(messages: list[dict], tokenizer) -> list[dict]:
    """`messages` with every special token written in a content broken apart (the messages
    themselves where none is written)."""
    pattern = _special_tokens(tokenizer)
    if pattern is None:
        return messages
    return [{**message, "content": pattern.sub(_broken, message["content"])}
            if isinstance(message.get("content"), str) and pattern.search(message["content"]) else message
            for message in messages]


def _broken(match: re.Match) -> str:
    return match.group(0)[0] + ZERO_WIDTH_SPACE + match.group(0)[1:]


def _special_tokens(tokenizer) -> re.Pattern | None:
    """One pattern of the tokenizer's special tokens of more than one character, longest first."""
    with _lock:
        if tokenizer in _patterns:
            return _patterns[tokenizer]
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    specials = sorted({token.content for token in decoder.values() if getattr(token, "special", False)
                       and len(token.content) > 1}, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
    with _lock:
        _patterns[tokenizer] = pattern
    return pattern
