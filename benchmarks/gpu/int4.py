"""4-bit weights through PyTorch's own int4 kernel (tinygemm: `aten._weight_int4pack_mm`, what
torchao's int4 weight-only layout runs on sm80+), to time it beside bitsandbytes' nf4 without a
new dependency. Asymmetric, one bf16 scale and zero point per group of 128 input weights.

The dequantized value of a 4-bit code q is (q - 8) * scale + zero (torchao's convention)."""

from __future__ import annotations

import torch
from torch import nn

GROUP = 128
INNER_K_TILES = 8  # tinygemm's tiling of the packed weight (2, 4 or 8); 8 is torchao's default


def quantize(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (codes int32 [out, in] in 0..15, scales_and_zeros [in / group, out, 2])."""
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-6) / 15
    codes = ((grouped - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    zero = low + 8 * scale
    scales_and_zeros = torch.cat([scale, zero], -1).transpose(0, 1).contiguous()  # [groups, out, 2]
    return codes, scales_and_zeros


def dequantize(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The weight the kernel multiplies by: [out, in] in fp32 (the tests' reference)."""
    out_features, in_features = codes.shape
    scale, zero = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [out, groups] each
    grouped = codes.float().reshape(out_features, in_features // group, group)
    return ((grouped - 8) * scale[..., None] + zero[..., None]).reshape(out_features, in_features)


class Int4Linear(nn.Module):
    """A bias-free linear layer over packed 4-bit weights, on CUDA (tinygemm) or the CPU."""

    def __init__(self, weight: torch.Tensor, compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales_and_zeros = quantize(weight)
        self.compute_dtype = compute_dtype
        self.cuda_kernel = weight.device.type == "cuda"
        if self.cuda_kernel:
            packed_bytes = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(packed_bytes, INNER_K_TILES)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(compute_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.compute_dtype)
        mm = torch.ops.aten._weight_int4pack_mm if self.cuda_kernel else torch.ops.aten._weight_int4pack_mm_for_cpu
        out = mm(rows, self.packed, GROUP, self.scales_and_zeros)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def max_relative_error(linear: Int4Linear, weight: torch.Tensor, rows: int = 4) -> float:
    """How far the kernel's product lies from the dequantized weight's (packing checked, not
    quantization): near bf16 rounding when the layout is right, order 1 when it is not."""
    codes, scales_and_zeros = quantize(weight)
    reference_weight = dequantize(codes, scales_and_zeros.to(linear.compute_dtype))
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device)
    x = x.to(linear.compute_dtype).float()
    expected = x @ reference_weight.T
    got = linear(x).float()
    return ((got - expected).norm() / expected.norm()).item()
