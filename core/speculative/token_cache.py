"""A model with a KV cache of its own that follows a token sequence which grows and is rolled back.

Every stage that keeps a cache beside the decoder's own is one of these: a draft model's
StreamingLLM cache (hierarchy.py's `ModelDrafter`), the target over a retrieval cache
(`RetrievalStage`), and each DSI target instance (dsi/pool.py). Each call rolls the cache back to
the longest prefix that still matches, then reads the rest.
"""

from __future__ import annotations

import torch

from ..kv.cache import KVCache
from ..model import CausalLM


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    differs = (a[:n] != b[:n]).nonzero()
    return int(differs[0]) if differs.numel() else n


class TokenCache:
    """`model` over `cache`, which holds the KV of `ids`.

    `prefill_chunk`: the part before the tokens whose logits are asked for is read this many
    tokens per forward (a long prompt); None reads everything in one forward (a few new tokens).
    """

    def __init__(self, model: CausalLM, cache: KVCache | None, ids: torch.Tensor | None = None,
                 prefill_chunk: int | None = None):
        self.model = model
        self.cache = cache
        self.ids = ids if ids is not None else torch.empty(0, dtype=torch.long)
        self.prefill_chunk = prefill_chunk
        self.forwards = 0

    def logits(self, tokens: torch.Tensor, count: int) -> torch.Tensor:
        """Logits after each of the last `count` of `tokens`: [count, vocab]. A forward that raises
        leaves `ids` naming the prompt chunks that finished."""
        context = tokens.shape[0] - count
        self.cache.trim(common_prefix(self.ids, tokens[:context]))
        start = self.cache.length  # a streaming cache may hold less than it was rolled back to
        self.ids = tokens[:start]
        if self.prefill_chunk is not None:
            for chunk_start in range(start, context, self.prefill_chunk):
                end = min(context, chunk_start + self.prefill_chunk)
                self.model.forward(tokens[chunk_start:end], torch.arange(chunk_start, end), self.cache,
                                   last_only=True)
                self.ids = tokens[:end]
            start = max(start, context)
        logits = self.model.forward(tokens[start:], torch.arange(start, tokens.shape[0]), self.cache)
        self.ids = tokens
        self.forwards += 1
        return logits[-count:]

    def read(self, tokens: torch.Tensor) -> None:
        """Bring the cache to all of `tokens` without computing logits (a prompt chunk)."""
        start = self.cache.length
        self.model.forward(tokens[start:], torch.arange(start, tokens.shape[0]), self.cache, last_only=True)
        self.ids = tokens
