"""The target's full KV cache, kept whole on one device.

The cache owns its length: callers roll it back with `trim` or compact it with `keep`, never by
editing tensors. Offloading to pinned CPU memory plugs in here later.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class FullCache:
    def __init__(self, hf_config):
        self.hf = DynamicCache(config=hf_config)

    @property
    def length(self) -> int:
        """Number of positions whose keys and values are stored."""
        return self.hf.get_seq_length()

    def trim(self, length: int) -> None:
        """Roll back to the first `length` positions (drops rejected draft tokens)."""
        excess = self.length - length
        if excess < 0:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {length}")
        if excess:
            self.hf.crop(-excess)

    @torch.inference_mode()
    def keep(self, positions: torch.Tensor) -> None:
        """Keep only `positions` (ascending), moved to consecutive slots: after a tree
        verification, the accepted path's entries follow the prefix. Only the part after the
        untouched prefix is copied, so the cost is that of the tree, not of the context."""
        positions = positions.to(torch.long)
        unchanged = int((positions == torch.arange(positions.shape[0])).cumprod(0).sum())
        moved = positions[unchanged:]
        for layer in self.hf.layers:
            if moved.numel():
                layer.keys[:, :, unchanged:unchanged + moved.shape[0]] = layer.keys[:, :, moved]
                layer.values[:, :, unchanged:unchanged + moved.shape[0]] = layer.values[:, :, moved]
        self.trim(positions.shape[0])
