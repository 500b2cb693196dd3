"""StreamingLLM cache (Xiao et al.; TriForce's first stage): the first `sinks` positions, which
attention leans on whatever the text, and a recent window; everything between is dropped.

For a small draft model over a long document: its attention cost and memory stay fixed however
long the context grows. Keys keep the rotary positions they were computed at (absolute
positions, within the model's trained context), so a dropped span is simply not attended.
"""

from __future__ import annotations

import torch

from .full import held_bytes, hf_cache, keep_slots


class StreamingCache:
    """A `KVCache` whose slots hold sorted positions: the sinks, then the window, then the newest
    tokens; `compact` drops the middle. `trim(n)` rolls back to the first n positions (dropping
    the slots at or after n), which works at any length since slots are sorted."""

    def __init__(self, hf_config, sinks: int, window: int,
                 layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 positions: torch.Tensor | None = None):
        if sinks < 0 or window < 1:
            raise ValueError(f"a streaming cache needs sinks >= 0 and window >= 1, got {sinks}, {window}")
        self.config = hf_config
        self.sinks, self.window = sinks, window
        self.transformers_cache = hf_cache(hf_config, layers or [])
        self._positions = positions if positions is not None else torch.empty(0, dtype=torch.long)

    @classmethod
    @torch.inference_mode()
    def from_cache(cls, hf_config, full, sinks: int, window: int, device: torch.device | None = None,
                   count: int | None = None, length: int | None = None) -> StreamingCache:
        """The streaming view of the first `length` positions (all by default) of a full cache's
        first `count` layers (a layer-skip draft shares the target's first layers, hence their
        KV): only the kept positions are read where they lie (`layers_at`) and moved to `device`."""
        kept = streaming_positions(full.length if length is None else length, sinks, window)
        gathered = [(k.to(device or k.device), v.to(device or v.device)) for k, v in full.layers_at(kept, count)]
        return cls(hf_config, sinks, window, gathered, kept)

    @property
    def length(self) -> int:
        """Positions covered: one past the newest slot's position."""
        self._sync_positions()
        return int(self._positions[-1]) + 1 if self._positions.numel() else 0

    @property
    def slots(self) -> int:
        return self.transformers_cache.get_seq_length()

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values in its slots, on every device; the spare capacity of the
        layers' buffers (which compaction does not shrink) is reserved but not counted."""
        return held_bytes(self.transformers_cache)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) [1, kv_heads, slots, head_dim], in the order of their positions."""
        return [(layer.keys, layer.values) for layer in self.transformers_cache.layers]

    def trim(self, length: int) -> None:
        self._sync_positions()
        kept = int((self._positions < length).sum())
        if kept < self.slots:
            self.transformers_cache.crop(kept - self.slots)
        self._positions = self._positions[:kept]

    def keep(self, positions: torch.Tensor) -> None:
        """Keep only `positions` (ascending), renumbered 0, 1, ...: the leading ones that already
        are 0, 1, ... keep what the cache holds of them (a dropped span stays dropped); each
        after them must be held, and moves to the next number (a tree's accepted path)."""
        self._sync_positions()
        positions = positions.to(torch.long)
        unchanged = int((positions == torch.arange(positions.shape[0])).cumprod(0).sum())
        moved = positions[unchanged:]
        if not torch.isin(moved, self._positions).all():
            raise ValueError("a streaming cache keeps only positions it holds")
        prefix_slots = int((self._positions < unchanged).sum())
        slots = torch.cat([torch.arange(prefix_slots), torch.searchsorted(self._positions, moved)])
        keep_slots(self.transformers_cache, slots)
        self._positions = torch.cat([self._positions[:prefix_slots], torch.arange(unchanged, positions.shape[0])])

    def fitted(self) -> StreamingCache:
        """A copy whose buffers hold just its slots: after reading a long prompt a chunk at a
        time, the buffers keep a chunk's room, which compaction does not give back."""
        self._sync_positions()
        return StreamingCache(self.config, self.sinks, self.window,
                              [(keys.clone(), values.clone()) for keys, values in self.layers()], self._positions.clone())

    def compact(self) -> None:
        """Drop everything but the sinks and the window (called between drafts, never mid-draft)."""
        self._sync_positions()
        if self.slots <= self.sinks + self.window:
            return
        kept = torch.cat([torch.arange(self.sinks), torch.arange(self.slots - self.window, self.slots)])
        keep_slots(self.transformers_cache, kept)
        self._positions = self._positions[kept]

    def _sync_positions(self) -> None:
        """Forwards append slots for consecutive positions after the newest one; account for them."""
        appended = self.slots - self._positions.numel()
        if appended > 0:
            start = int(self._positions[-1]) + 1 if self._positions.numel() else 0
            self._positions = torch.cat([self._positions, torch.arange(start, start + appended)])


def streaming_positions(length: int, sinks: int, window: int) -> torch.Tensor:
    """The positions a streaming cache keeps of `length`: [0, sinks) and the last `window`."""
    if length <= sinks + window:
        return torch.arange(length)
    return torch.cat([torch.arange(sinks), torch.arange(length - window, length)])
