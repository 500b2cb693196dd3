"""The target's full KV cache, kept whole on one device.

The cache owns its length: callers roll it back with `trim`, never by editing tensors.
Offloading to pinned CPU memory and tree compaction (`keep`) plug in here later.
"""

from __future__ import annotations

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
