"""The target's full KV cache, kept whole on one device.

The cache owns its length: callers roll it back with `trim` or compact it with `keep`, never by
editing tensors. Offloading to pinned CPU memory plugs in here later.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from .cache import rows_at
from .device_length import active_step

GROWTH = 1.25  # spare capacity on growth: amortized O(1) per token, at most 25% unused memory
MIN_GROWTH = 256  # positions


class GrowingLayer(DynamicLayer):
    """transformers' DynamicLayer appends by `torch.cat`, which copies the whole layer on every
    forward: at 32K positions that was 58% of a one-token forward of Llama-3.1-8B's shape on an
    H100 (13 ms). This layer writes new entries into spare capacity and keeps `keys`/`values`
    as views of its buffers, so `crop` and in-place edits (`keep_slots`) work unchanged. Never
    assign `keys`/`values` from outside: the next `update` writes into the buffer and returns
    its prefix, which would bring back whatever the buffer held there."""

    def __init__(self, max_positions: int | None = None):
        super().__init__()
        self.max_positions = max_positions  # never reserve beyond the model's context
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        step = active_step()
        if step is not None:  # a replayable step (core/step_graphs.py): the runner keeps the length
            self.write_rows(self._key_buffer, step.slots, key_states)
            self.write_rows(self._value_buffer, step.slots, value_states)
            return self._key_buffer, self._value_buffer
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, end = self.get_seq_length(), self.get_seq_length() + key_states.shape[-2]
        if self._key_buffer is None or self._key_buffer.shape[-2] < end:
            self._grow(length, end, key_states, value_states)
        self.write_rows(self._key_buffer, length, key_states)
        self.write_rows(self._value_buffer, length, value_states)
        self.written(end)
        return self.keys, self.values

    def write_rows(self, buffer: torch.Tensor, at: int | torch.Tensor, states: torch.Tensor) -> None:
        """Store `states` [1, kv_heads, n, d] in `buffer` from slot `at` on, or at the slots `at` [n]
        (a replayable step's)."""
        if isinstance(at, int):
            buffer[..., at:at + states.shape[-2], :] = states
        else:
            buffer.index_copy_(2, at, states)

    def stored_row(self, states: torch.Tensor) -> tuple[int, torch.dtype]:
        """The width and dtype of the buffers' rows for entries like `states`: as they come."""
        return states.shape[-1], states.dtype

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, values) [1, kv_heads, capacity, head_dim]: what a replayable step writes into."""
        return None if self._key_buffer is None else (self._key_buffer, self._value_buffer)

    def written(self, end: int) -> None:
        """The buffers' first `end` slots are held (after a replayable step wrote the last ones)."""
        self.keys, self.values = self._key_buffer[..., :end, :], self._value_buffer[..., :end, :]

    def _grow(self, length: int, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = max(needed, int(length * GROWTH), length + MIN_GROWTH)
        if self.max_positions is not None:
            capacity = max(needed, min(capacity, self.max_positions))

        def buffer(states: torch.Tensor) -> torch.Tensor:
            width, dtype = self.stored_row(states)
            return torch.empty(*states.shape[:-2], capacity, width, dtype=dtype, device=states.device)

        keys, values = buffer(key_states), buffer(value_states)
        if length:
            keys[..., :length, :] = self.keys
            values[..., :length, :] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def refill(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Hold exactly `keys`, `values` [1, kv_heads, n, head_dim] in the buffers it has (a step
        graph captured over them stays valid); False, unchanged, where they do not fit there."""
        if self._key_buffer is None or any(
                buffer.shape[:2] != new.shape[:2] or buffer.shape[3] != new.shape[3] or buffer.shape[2] < new.shape[2]
                or buffer.dtype != new.dtype or buffer.device != new.device
                for buffer, new in ((self._key_buffer, keys), (self._value_buffer, values))):
            return False
        end = keys.shape[2]
        self._key_buffer[..., :end, :] = keys
        self._value_buffer[..., :end, :] = values
        self.written(end)
        return True

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


@torch.inference_mode()
def keep_slots(cache: DynamicCache, slots: torch.Tensor) -> None:
    """Keep only `slots` (ascending) of every layer, moved in place to the first slots, and
    drop the rest. In place because a `GrowingLayer`'s keys must stay views of its buffer;
    only the part after the untouched leading slots is copied, so keeping a tree's accepted
    path costs the tree, not the context."""
    slots = slots.to(torch.long)
    unchanged = int((slots == torch.arange(slots.shape[0])).cumprod(0).sum())
    moved = slots[unchanged:]
    if moved.numel():
        for layer in cache.layers:
            target = slice(unchanged, unchanged + moved.shape[0])
            # The gather on the right copies before the write, so overlapping ranges are safe.
            layer.keys[:, :, target] = layer.keys[:, :, moved.to(layer.keys.device)]
            layer.values[:, :, target] = layer.values[:, :, moved.to(layer.values.device)]
    excess = cache.get_seq_length() - slots.shape[0]
    if excess:
        cache.crop(-excess)


def _growing_cache(hf_config, max_positions: int | None = None) -> DynamicCache:
    cache = DynamicCache(config=hf_config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):  # sliding-window layers stay as they are
        positions = max_positions or getattr(hf_config, "max_position_embeddings", None)
        cache.layers = [GrowingLayer(positions) for _ in cache.layers]
    return cache


def held_bytes(cache: Cache) -> int:
    """Bytes of the keys and values a transformers cache's layers hold (a layer that never ran
    holds none); a `GrowingLayer`'s spare capacity is not counted."""
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


@torch.inference_mode()
def hf_cache(hf_config, layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
             max_positions: int | None = None) -> DynamicCache:
    """A transformers cache holding the given per-layer (keys, values); growing, it reserves no
    room past `max_positions` (default: the config's positions)."""
    cache = _growing_cache(hf_config, max_positions)
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


class FullCache:
    """A `KVCache` whose slots are the positions 0 .. length-1. Growing, it reserves no room past
    `max_positions` (the plan's context; default: the config's, which can be 4x more): a
    verification's nodes past it still fit, allocated exactly."""

    def __init__(self, hf_config, max_positions: int | None = None):
        self.config = hf_config
        self.max_positions = max_positions
        self.transformers_cache = _growing_cache(hf_config, max_positions)

    @classmethod
    def from_layers(cls, hf_config, layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    max_positions: int | None = None) -> FullCache:
        """A cache holding a copy of the given per-layer (keys, values), each [1, kv_heads, length,
        head_dim], read one layer at a time."""
        cache = cls(hf_config, max_positions)
        cache.transformers_cache = hf_cache(hf_config, layers, max_positions)
        return cache

    def layers(self, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) of the first `length` positions (all by default), as views."""
        length = self.length if length is None else length
        return [(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in self.transformers_cache.layers]

    def stored_layers(self, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first `length` positions as stored, what a saved document holds: here `layers`."""
        return FullCache.layers(self, length)

    def each_layer(self, length: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """`layers`, one layer at a time: an 8-bit cache dequantizes each only when it is reached."""
        return ((self._seen(keys), self._seen(values)) for keys, values in self.stored_layers(length))

    def layers_at(self, positions: torch.Tensor, count: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer of the first `count` (all by default), the (keys, values) [1, kv_heads,
        len(positions), head_dim] at `positions` as attention sees them, new tensors: only those
        rows are read (dequantized, for an 8-bit cache), whatever the cache's length."""
        return rows_at(self.stored_layers()[:count], self._seen, positions)

    def _seen(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows as attention sees them: here as they are."""
        return rows

    def layer_shape(self, length: int) -> tuple[int, ...]:
        """The shape of one layer's keys (and values) for `length` positions, from the config."""
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return (1, config.num_key_value_heads, length, head_dim)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held, on every device; the spare capacity of the layers'
        buffers (up to 25% more, at least 256 positions) is reserved but not counted."""
        return held_bytes(self.transformers_cache)

    def clone_prefix(self, length: int) -> FullCache:
        """An independent copy of the first `length` positions, where they are."""
        return self.copy_to(self.devices, length)

    @property
    def devices(self) -> list[torch.device]:
        """The device of each layer's keys and values (of the layers that hold any)."""
        return [layer.keys.device for layer in self.transformers_cache.layers if layer.is_initialized]

    @property
    def movable(self) -> bool:
        """Whether `copy_to` gives back exactly this cache's state: every layer a `GrowingLayer`
        holding entries (a sliding-window layer keeps its own count of positions, which a copy
        would not carry)."""
        return all(isinstance(layer, GrowingLayer) and layer.is_initialized
                   for layer in self.transformers_cache.layers)

    def copy_to(self, devices: list[torch.device], length: int | None = None) -> FullCache:
        """An independent copy of the first `length` positions (all by default) as stored, layer i
        on `devices[i]`, a layer at a time: never a second copy of the whole KV on either side."""
        layers = ((keys.to(device), values.to(device))
                  for (keys, values), device in zip(self.stored_layers(length), devices, strict=True))
        return self._holding(layers)

    def _holding(self, stored_layers) -> FullCache:
        """A cache of this kind holding a copy of `stored_layers` (an iterable of (keys, values))."""
        return FullCache.from_layers(self.config, stored_layers, self.max_positions)

    @property
    def length(self) -> int:
        """Number of positions whose keys and values are stored."""
        return self.transformers_cache.get_seq_length()

    def trim(self, length: int) -> None:
        """Roll back to the first `length` positions (drops rejected draft tokens)."""
        excess = self.length - length
        if excess < 0:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {length}")
        if excess:
            self.transformers_cache.crop(-excess)

    def keep(self, positions: torch.Tensor) -> None:
        """Keep only `positions` (ascending), moved to consecutive slots: after a tree
        verification, the accepted path's entries follow the prefix."""
        keep_slots(self.transformers_cache, positions)
