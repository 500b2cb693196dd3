"""The `kv8` section: what attention costs over an 8-bit KV (int8 codes with one scale per position
and KV head, about the bytes of llama.cpp's q8_0 cache) against a bf16 KV, without a fused kernel:
dequantize the layer, then SDPA with grouped-query attention as transformers calls it for a decode
step (`enable_gqa`, queries [1, heads, n, head_dim] as the projections leave them). One layer is
timed and scaled to the model's layers: on CUDA by the GPU's busy time (a wall clock mostly times
the launch at short contexts), on the CPU by the wall clock. The bf16 KV is laid out as kv/full.py
keeps it: views of a buffer with spare capacity.

Also timed: the same bf16 attention with the query heads folded into the query length (one KV head's
group stacked as rows, as kv/queries.py folds masked multi-token forwards on CUDA). On the H100 cuDNN
gives that shape another engine, 7-8x slower at 32-128K (bench/ notes); each row names its kernels.

Why measure the naive path: an 8-bit KV halves what must fit in VRAM, but dequantizing writes a
bf16 copy and reads it again, so per step it moves more bytes than the bf16 KV it replaces (8.3-9x
the bf16 attention's time on an H100). Beside it, the fused kernel the engine now uses where Triton
runs (core/kv/int8_kernel.py: the packed rows read once, dequantized in registers, a
verification's new tokens under their causal mask, the splits merged), called as the engine
calls it: `fused_over_bf16` is what planning/efficiency.py's KV["int8"] is to be derived from."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ...core.kv import int8_attention
from ...core.kv.full import GROWTH
from ...core.kv.int8_rows import pack
from .clock import free_memory, kernel_profile, wall_seconds
from .rig import Rig


def run(rig: Rig, report: dict) -> dict:
    shape = rig.shape
    layers, kv_heads, head_dim = shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"]
    group = shape["num_attention_heads"] // kv_heads
    generator = torch.Generator(rig.device).manual_seed(0)
    rows = []
    for length in sorted({*rig.contexts, *rig.offloaded_contexts}):
        capacity = int(length * GROWTH)
        keys, values = (torch.randn(1, kv_heads, capacity, head_dim, device=rig.device, dtype=rig.dtype,
                                    generator=generator)[:, :, :length] for _ in range(2))
        (key_codes, key_scale), (value_codes, value_scale) = _quantize(keys), _quantize(values)
        key_rows, value_rows = (_packed(tensor, capacity) for tensor in (keys, values))
        for n in (1, max(rig.sizes)):
            # [1, heads, n, head_dim] with the strides q_proj(...).view(...).transpose(1, 2) leaves
            queries = torch.randn(1, n, kv_heads * group, head_dim, device=rig.device, dtype=rig.dtype,
                                  generator=generator).transpose(1, 2)
            folded = queries.reshape(1, kv_heads, group * n, head_dim)

            def plain():
                return F.scaled_dot_product_attention(queries, keys, values, enable_gqa=True)

            def dequantized():
                return F.scaled_dot_product_attention(queries, key_codes.to(rig.dtype) * key_scale,
                                                      value_codes.to(rig.dtype) * value_scale, enable_gqa=True)

            def folded_heads():
                return F.scaled_dot_product_attention(folded, keys, values)

            causal = torch.ones(n, n, dtype=torch.bool, device=rig.device).tril()

            def fused():  # as the engine calls it: one token sees all; a verification's new tokens are causal
                from ...core.kv import int8_kernel  # needs Triton: imported only where it runs
                if n == 1:
                    return int8_kernel.attend_packed(folded[0], key_rows, value_rows, head_dim ** -0.5)
                return int8_kernel.attend_packed(folded[0], key_rows, value_rows, head_dim ** -0.5, n, causal)

            (bf16_s, bf16_kernel), (int8_s, int8_kernel), (folded_s, folded_kernel) = (
                _seconds(run, rig, layers) for run in (plain, dequantized, folded_heads))
            row = {"context": length, "tokens": n, "bf16_kv_s": bf16_s, "int8_kv_dequantized_s": int8_s,
                   "int8_over_bf16": int8_s / bf16_s, "bf16_folded_heads_s": folded_s,
                   "kernels": {"bf16": bf16_kernel, "int8": int8_kernel, "bf16_folded_heads": folded_kernel},
                   "kv_bytes_bf16": 2 * layers * keys.numel() * keys.element_size(),
                   "kv_bytes_int8": 2 * layers * (key_codes.numel() + key_scale.numel() * key_scale.element_size()),
                   "int8_attention": int8_attention.ROUTE.describe(torch.device(rig.device), rig.dtype)}
            # The dry run rehearses the kernel where Triton's interpreter is on (under the tests).
            rehearsed = rig.dry_run and os.environ.get("TRITON_INTERPRET") == "1"
            if (row["int8_attention"] == "fused kernel" or rehearsed) and group * n <= int8_attention.MAX_ROWS:
                fused_s, row["kernels"]["int8_fused"] = _seconds(fused, rig, layers)
                # planning/efficiency.py's KV figure: stored bytes read per second, against bf16's
                row.update(int8_kv_fused_s=fused_s, fused_over_bf16=fused_s / bf16_s,
                           fused_efficiency=(row["kv_bytes_int8"] / fused_s) / (row["kv_bytes_bf16"] / bf16_s))
            rows.append(row)
        del keys, values, key_codes, value_codes, key_rows, value_rows
        free_memory(rig.device)
    return {"clock": "GPU busy time" if rig.device == "cuda" else "wall time", "rows": rows}


def _seconds(run, rig: Rig, layers: int) -> tuple[float, str | None]:
    """One layer's seconds times the layers, and the kernel that took longest (CUDA only)."""
    busy, kernel = kernel_profile(run, rig.device)
    seconds = busy if busy is not None else wall_seconds(run, rig.device, rig.repeats)
    return seconds * layers, kernel


def _packed(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    """The engine's 8-bit rows of [1, kv_heads, length, d] as kv/int8.py keeps them: a view of
    [kv_heads, capacity, d + 4] packed rows."""
    length = tensor.shape[2]
    rows = torch.zeros(tensor.shape[1], capacity, tensor.shape[3] + 4, dtype=torch.int8, device=tensor.device)
    rows[:, :length] = pack(tensor[0])
    return rows[:, :length]


def _quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per (KV head, position): codes and a scale of the tensor's dtype."""
    scale = tensor.abs().amax(-1, keepdim=True).float().clamp(min=1e-8) / 127
    codes = (tensor.float() / scale).round().clamp(-127, 127).to(torch.int8)
    return codes, scale.to(tensor.dtype)
