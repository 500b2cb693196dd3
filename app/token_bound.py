"""The fewest tokens a prompt can make, from its length alone: a prompt far past the context is
refused before it is tokenized, which for megabytes costs seconds and a gigabyte on the engine thread.

The bound: every character the model reads (the text after the tokenizer's own normalizer) is
covered by some token, and no token covers more characters than the longest entry in the vocabulary
(for a byte-level vocabulary, one character per byte, so at least as many as it covers), hence
tokens >= characters / longest. It holds only where no step of the tokenizer drops text or
stands one token for a run of any length: a BPE model (an unknown run is fused into one token only
without byte fallback) behind pre-tokenizers that keep every character. Any other tokenizer gets
no bound (0), and its prompts are tokenized whole as before.
"""

from __future__ import annotations

import json
import math
import threading
import weakref

from ..core.errors import InputError

# Pre-tokenizers that split text without dropping any of it (unless a `behavior` says "Removed").
KEEPING = {"Sequence", "ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}

_lock = threading.Lock()
_bounds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (normalize, longest) or None


def check_fits(engine, messages: list[dict]) -> None:
    """`InputError`, as the engine words it, when `messages` surely make a prompt past the context."""
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    fewest = fewest_tokens(engine.tokenizer, text)
    if fewest >= engine.context_length:
        raise InputError(f"the prompt is at least {fewest:,} tokens ({len(text):,} characters) but {engine.name} "
                         f"reads at most {engine.context_length:,}: shorten it by at least "
                         f"{fewest - engine.context_length + 1:,} tokens")


def fewest_tokens(tokenizer, text: str) -> int:
    """A number of tokens `text` makes at least (0 where the tokenizer allows no bound)."""
    bound = _bound(tokenizer)
    if bound is None:
        return 0
    normalize, longest = bound
    return math.ceil(len(normalize(text)) / longest)


def _bound(tokenizer):
    with _lock:
        if tokenizer in _bounds:
            return _bounds[tokenizer]
    bound = _measure(tokenizer)
    with _lock:
        _bounds[tokenizer] = bound
    return bound


def _measure(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a slow (Python) tokenizer has none: no bound
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return None
    if not _keeps_every_character(spec.get("pre_tokenizer")):
        return None
    normalizer = backend.normalizer
    normalize = normalizer.normalize_str if normalizer is not None else (lambda text: text)
    return normalize, max(len(piece) for piece in tokenizer.get_vocab())


def _keeps_every_character(pre_tokenizer) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") not in KEEPING or pre_tokenizer.get("behavior") == "Removed":
        return False
    return all(_keeps_every_character(inner) for inner in pre_tokenizer.get("pretokenizers", []))
