"""Attention split in two parts over disjoint sets of keys, merged exactly by log-sum-exp.

Why: with the full KV in CPU memory, a verification can either stream the KV to the GPU (PCIe
bandwidth) or compute attention over the CPU-resident part where it lies (RAM bandwidth, often
higher on desktops) and send only queries and one output row per query head back and forth.
The two parts' softmax-weighted sums merge exactly:

    out = (out_a * exp(lse_a) + out_b * exp(lse_b)) / (exp(lse_a) + exp(lse_b))
"""

from __future__ import annotations

import torch


def attention_with_lse(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                       allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """queries [heads, n, d]; keys, values [kv_heads, length, d] (grouped-query attention: each KV
    head serves heads / kv_heads query heads); allowed [n, length] bool or None (all visible).
    Returns (out [heads, n, d], lse [heads, n], both in fp32, or fp64 for fp64 inputs): softmax attention over these keys,
    and the log-sum-exp of its scores (-inf where a query sees none of them)."""
    heads, n, dim = queries.shape
    kv_heads = keys.shape[0]
    # Products in the keys' own dtype (bf16 on the CPU reads half the bytes; accumulation is fp32),
    # softmax in fp32.
    precise = torch.promote_types(keys.dtype, torch.float32)
    grouped = queries.reshape(kv_heads, heads // kv_heads * n, dim).to(keys.dtype)
    scores = (grouped @ keys.transpose(1, 2)).to(precise) * scale  # [kv_heads, group * n, length]
    scores = scores.reshape(heads, n, -1)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [heads, n]
    weights = torch.exp(scores - lse[..., None].clamp(min=torch.finfo(precise).min))
    weights = torch.nan_to_num(weights, nan=0.0)  # rows that see no key here
    weights = weights.reshape(kv_heads, heads // kv_heads * n, keys.shape[1]).to(values.dtype)
    out = (weights @ values).to(precise).reshape(heads, n, dim)
    return out, lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's (out, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).nan_to_num(0.0)[..., None]
    weight_b = torch.exp(lse_b - lse).nan_to_num(0.0)[..., None]
    return out_a * weight_a + out_b * weight_b
