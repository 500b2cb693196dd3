"""The 8-bit KV's row format: a row (one token of one KV head) holds head_dim int8 codes with a
symmetric absmax scale, followed by the 4 bytes of that float32 scale.

A scale thus travels with its codes through everything that drops or moves slots (`crop`,
`keep_slots`, the rollback of a stopped forward in interrupt.py), streaming (kv/offload.py) and
saved documents. Scales are float32 rather than the model's dtype: a bf16 scale keeps 8 bits,
adding up to 0.4% error to every value of its row, for 2 bytes saved per row against head_dim
(often 128) of codes.
"""

from __future__ import annotations

import torch

LEVELS = 127  # codes -127 .. 127: symmetric, so zero is exact and -128 goes unused
SCALE_BYTES = 4  # a float32 scale, stored as int8 bytes after its row's codes


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes int8 [..., d], scale float32 [..., 1]), per row: scale = absmax / 127
    and codes = round(x / scale), so |x - codes * scale| <= scale / 2. An all-zero row gets
    scale 0 and codes 0."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    absmax = wide.abs().amax(-1, keepdim=True)
    # Divided by a tensor: CUDA divides a tensor by a Python number as a product with its
    # reciprocal, a bit off correct rounding in some rows; the CPU and the packing kernel
    # (kv/int8_kernel.py) round correctly, and every device must store the same bytes.
    scale = (absmax / torch.full_like(absmax, LEVELS)).to(torch.float32)
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
