"""The target's full KV cache in 8 bits: keys and values as int8 codes with a symmetric absmax
scale per token and KV head, attended exactly at their dequantized values.

A token's codes and scale come from its own keys and values alone, so it is attended to with the
same values whether it ran alone (plain decoding) or inside a verification (chain or tree): the
speculative decoders stay lossless against "the model with an 8-bit KV". A forward's new tokens
are quantized before its attention, so they too are seen only at their dequantized values.

Layout: each row (one token of one KV head) holds head_dim codes followed by the 4 bytes of its
float32 scale, one int8 tensor per layer for the keys and one for the values. A scale thus
travels with its codes through everything that drops or moves slots (`crop`, `keep_slots`, the
rollback of a stopped forward in interrupt.py), and `held_bytes` counts codes and scales.
Scales are float32 rather than the model's dtype: a bf16 scale keeps 8 bits, adding up to 0.4%
error to every value of its row, for 2 bytes saved per row against head_dim (often 128) of codes.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .full import FullCache, GrowingLayer

LEVELS = 127  # codes -127 .. 127: symmetric, so zero is exact and -128 goes unused
SCALE_BYTES = 4  # a float32 scale, stored as int8 bytes after its row's codes


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes int8 [..., d], scale float32 [..., 1]), per row: scale = absmax / 127
    and codes = round(x / scale), so |x - codes * scale| <= scale / 2. An all-zero row gets
    scale 0 and codes 0."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    scale = (wide.abs().amax(-1, keepdim=True) / LEVELS).to(torch.float32)
    codes = torch.round(wide / torch.where(scale > 0, scale, 1.0))
    # A subnormal scale is inexact enough for a code to overshoot 127 by one.
    return codes.clamp_(-LEVELS, LEVELS).to(torch.int8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes * scale, computed in at least float32 and rounded once to `dtype`."""
    precise = torch.promote_types(dtype, torch.float32)
    return (codes.to(precise) * scale.to(precise)).to(dtype)


def pack(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] -> int8 [..., d + 4]: each row's codes, then its scale's bytes."""
    codes, scale = quantize(x)
    return torch.cat([codes, scale.view(torch.int8)], -1)


def unpack(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized values [..., d] of packed rows [..., d + 4], in `dtype`."""
    codes, scale_bytes = packed.split((packed.shape[-1] - SCALE_BYTES, SCALE_BYTES), -1)
    return dequantize(codes, scale_bytes.contiguous().view(torch.float32), dtype)


class Int8Layer(GrowingLayer):
    """A `GrowingLayer` whose buffers hold packed rows. `update` returns the dequantized keys and
    values of every slot for this forward's attention; nothing but the packed rows is kept."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.append_packed(pack(key_states), pack(value_states))
        # Dequantize-then-attend is the CPU rehearsal: a fused int8 attention is the GPU fast path
        # still to come (an H100 measurement found dequantize-then-attend 9x slower at 128K).
        return unpack(keys, key_states.dtype), unpack(values, value_states.dtype)

    def append_packed(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append packed rows as they are; returns every slot's packed rows (views)."""
        return super().update(keys, values)


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
    def from_packed(cls, hf_config, dtype: torch.dtype, layers: list[tuple[torch.Tensor, torch.Tensor]],
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

    def clone_prefix(self, length: int) -> Int8Cache:
        """An independent copy of the first `length` positions, codes and scales as they are."""
        return Int8Cache.from_packed(self.config, self.dtype, self.stored_layers(length), self.max_positions)
