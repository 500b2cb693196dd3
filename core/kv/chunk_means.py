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

# Positions of one layer's keys read at once: after a 128K prefill of an 8B model, 8K positions
# are 16 MB of bf16 keys (32 MB as float32) on the GPU, where the whole layer was 256 MB (768 MB).
SPAN_POSITIONS = 8192


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
        span = max(1, SPAN_POSITIONS // size)  # chunks read at once: bounded memory on the device
        if complete > self.valid:
            for means, keys in zip(self.means, layer_keys, strict=True):
                for first in range(self.valid, complete, span):
                    last = min(first + span, complete)
                    block = exact(self._moved(keys[:, first * size:last * size]))
                    kv_heads, _, head_dim = block.shape
                    means[:, first:last] = block.reshape(kv_heads, last - first, size, head_dim).mean(2).to(means.dtype)
            self.valid = complete
        return [means[:, :complete] for means in self.means]

    def _moved(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [kv_heads, n, width] on the device. From host memory a head at a time: each
        head's rows are one contiguous block there (pinned: the copies are asynchronous), where
        the whole slice is not (a copy of it would first be gathered in pageable memory)."""
        if rows.device == self.device:
            return rows
        moved = torch.empty(rows.shape, dtype=rows.dtype, device=self.device)
        for head in range(rows.shape[0]):
            moved[head].copy_(rows[head], non_blocking=True)
        return moved
