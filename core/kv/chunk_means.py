"""The mean key of every complete chunk of a cache's positions, per layer and KV head, kept where
the retrieval cache scores them (the GPU), so that a rebuild over an offloaded KV reads the chunk
means instead of streaming every key over PCIe (kv/retrieval.py: `select_by_chunk_means`).

The cache reports each position from which its contents changed (`changed`); the next `update`
recomputes the chunks from there on and no others. The first one after a prefill reads every key
once; later ones, the few chunks completed since.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class ChunkMeans:
    """Per layer [kv_heads, chunks, head_dim] chunk means in `dtype` on `device` (as the plan
    budgets them: `planning.memory.chunk_key_bytes`), for a cache of `capacity` positions."""

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int, chunk_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.chunk_size, self.device = chunk_size, torch.device(device)
        self.means = [torch.zeros(kv_heads, capacity // chunk_size, head_dim, dtype=dtype, device=self.device)
                      for _ in range(layers)]
        self.valid = 0  # leading chunks whose means are those of the cache's current keys

    def changed(self, position: int) -> None:
        """The cache's keys from `position` on were replaced or dropped."""
        self.valid = min(self.valid, position // self.chunk_size)

    @torch.inference_mode()
    def update(self, layer_keys: list[torch.Tensor], length: int,
               exact: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.float) -> list[torch.Tensor]:
        """The means of the complete chunks of `length` positions, per layer [kv_heads, chunks,
        head_dim], from each layer's keys [kv_heads, capacity, head_dim] (host memory, for an
        offloaded cache: only the chunks not yet valid are read); `exact` turns stored keys (8-bit
        rows, say) into their float32 values."""
        size, complete = self.chunk_size, length // self.chunk_size
        if complete > self.valid:
            for means, keys in zip(self.means, layer_keys, strict=True):
                block = exact(keys[:, self.valid * size:complete * size].to(self.device, non_blocking=True))
                kv_heads, _, head_dim = block.shape
                chunks = block.reshape(kv_heads, complete - self.valid, size, head_dim).mean(2)
                means[:, self.valid:complete] = chunks.to(means.dtype)
            self.valid = complete
        return [means[:, :complete] for means in self.means]
