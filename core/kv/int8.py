"""The target's full KV cache in 8 bits: keys and values as int8 codes with a symmetric absmax
scale per token and KV head (kv/int8_rows.py), attended exactly at their dequantized values.

A token's codes and scale come from its own keys and values alone, so it is attended to with the
same values whether it ran alone (plain decoding) or inside a verification (chain or tree): the
speculative decoders stay lossless against "the model with an 8-bit KV". A forward's new tokens
are quantized before its attention, so they too are seen only at their dequantized values.
Where the fused kernel runs (kv/int8_attention.py), attention gets the packed rows as stored and
dequantizes them in registers; elsewhere it gets them dequantized in the model's dtype.
"""

from __future__ import annotations

from typing import Iterable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import int8_attention
from .full import FullCache, GrowingLayer
from .int8_rows import SCALE_BYTES, pack, unpack


class Int8Layer(GrowingLayer):
    """A `GrowingLayer` whose buffers hold packed rows. `update` returns every slot's keys and
    values for this forward's attention: the packed rows themselves where attention reads them
    (kv/int8_attention.py), else dequantized; nothing but the packed rows is kept. Where the
    kernels run, the new keys and values are packed by a kernel straight into the buffers (one
    launch each, where torch's packing took about ten small kernels and a copy)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        dtype, device, head_dim = key_states.dtype, key_states.device, key_states.shape[-1]
        if not int8_attention.reads_packed(device, dtype, head_dim):
            key_states, value_states = pack(key_states), pack(value_states)
        keys, values = super().update(key_states, value_states)
        if int8_attention.reads_packed(device, dtype, head_dim):  # asked again: a kernel may have failed meanwhile
            return keys, values
        return unpack(keys, dtype), unpack(values, dtype)

    def append_packed(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append packed rows as they are; returns every slot's packed rows (views)."""
        return super().update(keys, values)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(*(states.new_empty(0, dtype=torch.int8) for states in (key_states, value_states)))

    def stored_row(self, states: torch.Tensor) -> tuple[int, torch.dtype]:
        return states.shape[-1] + (0 if states.dtype == torch.int8 else SCALE_BYTES), torch.int8

    def write_rows(self, buffer: torch.Tensor, at: int | torch.Tensor, states: torch.Tensor) -> None:
        if states.dtype != torch.int8:  # not packed yet: where the kernels run
            if int8_attention.pack_into(states, buffer, at):
                return
            states = pack(states)  # the kernel failed here
        super().write_rows(buffer, at, states)


class Int8Cache(FullCache):
    """A `FullCache` holding 8-bit keys and values; `layers` gives them dequantized, in the
    model's dtype. For models whose every layer attends to the whole context (no sliding window)."""

    def __init__(self, hf_config, dtype: torch.dtype, max_positions: int | None = None):
        self.config = hf_config
        self.dtype = dtype  # the model's compute dtype: what `layers` dequantizes to
        self.max_positions = max_positions  # growing, no room reserved past it (FullCache)
        cache = DynamicCache(config=hf_config)
        if not all(type(layer) is DynamicLayer for layer in cache.layers):
            raise ValueError("the 8-bit KV cache covers full-attention models only; this one has "
                             "sliding-window layers")
        positions = max_positions or getattr(hf_config, "max_position_embeddings", None)
        cache.layers = [Int8Layer(positions) for _ in cache.layers]
        self.transformers_cache = cache

    @classmethod
    @torch.inference_mode()
    def from_layers(cls, hf_config, layers: list[tuple[torch.Tensor, torch.Tensor]],
                    dtype: torch.dtype | None = None) -> Int8Cache:
        """A cache holding the given per-layer (keys, values) [1, kv_heads, length, head_dim],
        quantized; `dtype` (default: theirs) is what `layers` gives them back in."""
        cache = cls(hf_config, dtype or layers[0][0].dtype)
        for layer, (keys, values) in zip(cache.transformers_cache.layers, layers, strict=True):
            layer.append_packed(pack(keys), pack(values))
        return cache

    @classmethod
    @torch.inference_mode()
    def from_packed(cls, hf_config, dtype: torch.dtype, layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    max_positions: int | None = None) -> Int8Cache:
        """A cache holding the given per-layer packed (keys, values), copied bit for bit."""
        cache = cls(hf_config, dtype, max_positions)
        for layer, (keys, values) in zip(cache.transformers_cache.layers, layers, strict=True):
            layer.append_packed(keys, values)
        return cache

    def stored_layers(self, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer packed (keys, values) [1, kv_heads, length, head_dim + 4] int8 of the first
        `length` positions (all by default), as views: what a saved document stores."""
        return FullCache.layers(self, length)

    def layers(self, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) of the first `length` positions (all by default), dequantized
        into new tensors in the model's dtype: the values attention sees."""
        return [(self._seen(keys), self._seen(values)) for keys, values in self.stored_layers(length)]

    def _seen(self, rows: torch.Tensor) -> torch.Tensor:
        """Packed rows dequantized, in the model's dtype."""
        return unpack(rows, self.dtype)

    def layer_shape(self, length: int) -> tuple[int, ...]:
        """The shape of one layer's packed keys (and values) for `length` positions."""
        *leading, head_dim = super().layer_shape(length)
        return (*leading, head_dim + SCALE_BYTES)

    def _holding(self, stored_layers) -> Int8Cache:
        """A copy of packed layers, codes and scales as they are (`clone_prefix`, `copy_to`)."""
        return Int8Cache.from_packed(self.config, self.dtype, stored_layers, self.max_positions)
