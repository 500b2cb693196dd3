"""Attention of a multi-token forward (a verification, chain or tree, or a prefill chunk) split
into the cached past and the new tokens, merged exactly by log-sum-exp.

Why: under an arbitrary mask SDPA leaves its fused kernels for cuDNN's or the math path. At 32K
positions on an H100 (Llama-3.1-8B shape) that masked kernel took about 24 ms of an 8-token
verification's 33.7 ms of GPU time, against under 2 ms unmasked for one token. But every new
token sees the whole past, so the past needs no mask: flash attention reads it once. Only the
new tokens' n x n block carries the causal or tree mask, as a small additive bias. Both parts
fold the query heads that share a KV head into the query length (no KV copies; the bias's rows
are repeated instead), and merge as

    out = out_new + (out_past - out_new) * sigmoid(lse_past - lse_new)

(the past's share of the softmax mass). Few operations on purpose: a one-token forward of the
8B shape is already launch-bound, and every extra small kernel per layer shows in wall time.

The fused kernels give their log-sum-exp only through private aten ops: they are used where they
exist and work for the device and dtype; otherwise `past_and_new_attention` answers None and the
caller keeps plain SDPA.
"""

from __future__ import annotations

import torch

# (device type, dtype, with a bias) whose fused op failed once (missing, or not built for it).
_unavailable: set[tuple[str, torch.dtype, bool]] = set()
# New tokens from which a causal block (a prefill chunk) takes the kernels' causal mode rather than
# a folded bias: verifications (up to 128 tokens) keep the bias path measured on the H100, one
# kernel fewer per layer; a chunk's bias would grow as groups * n^2.
CAUSAL_KERNEL_FROM = 256


class NewTokenMask:
    """The new tokens' mask among themselves, [n, n] bool (None: causal), on the device as a
    bool tensor or as an additive bias for folded queries, each built once per forward and shared
    by every layer."""

    def __init__(self, allowed: torch.Tensor | None, n: int):
        self.allowed, self.n = allowed, n
        self._biases: dict[tuple, torch.Tensor] = {}
        self._allowed: dict[torch.device, torch.Tensor] = {}

    def allowed_on(self, device: torch.device) -> torch.Tensor:
        """[n, n] bool on `device`: which new tokens each new token sees."""
        if device not in self._allowed:
            allowed = torch.ones(self.n, self.n, dtype=torch.bool).tril() if self.allowed is None else self.allowed
            self._allowed[device] = allowed.to(device).contiguous()
        return self._allowed[device]

    def folded_bias(self, kv_heads: int, groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[1, kv_heads, groups * n, n] (one copy, expanded): 0 where allowed, -inf elsewhere;
        row = member * n + query."""
        key = (kv_heads, groups, dtype, device)
        if key not in self._biases:
            n = self.n
            allowed = (torch.ones(n, n, dtype=torch.bool, device=device).tril() if self.allowed is None
                       else self.allowed.to(device))
            width = -(-n // 16) * 16  # rows 16-aligned, as the memory-efficient kernel requires
            bias = torch.full((groups * n, width), float("-inf"), dtype=dtype, device=device)
            bias[:, :n].masked_fill_(allowed.repeat(groups, 1), 0.0)
            self._biases[key] = bias[:, :n].expand(1, kv_heads, -1, -1)
        return self._biases[key]


def fused_kernels_known_to_fail(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a fused op failed here before, for the past or for the new tokens."""
    return (device_type, dtype, False) in _unavailable or (device_type, dtype, True) in _unavailable


def fused_attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                             bias: torch.Tensor | None = None,
                             causal: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """query [1, heads, q, d], key and value [1, heads, k, d] (as many heads), bias broadcastable
    to [1, heads, q, k] or None, or `causal` (q == k). Returns (out [1, heads, q, d], lse [1,
    heads, q]) from a fused kernel, or None where there is none: flash (no bias, half precision)
    or memory-efficient attention on CUDA, flash on the CPU."""
    kind = (query.device.type, query.dtype, bias is not None)
    if kind in _unavailable:
        return None
    aten = torch.ops.aten
    try:  # `.default` overloads: a per-layer call, and Python dispatch is most of a decode step's cost
        if query.is_cuda and bias is None and query.dtype in (torch.float16, torch.bfloat16):
            out, lse = aten._scaled_dot_product_flash_attention.default(query, key, value, is_causal=causal,
                                                                        scale=scale)[:2]
        elif query.is_cuda and query.dtype in (torch.float16, torch.bfloat16, torch.float32):
            out, lse = aten._scaled_dot_product_efficient_attention.default(query, key, value, bias, True,
                                                                            is_causal=causal, scale=scale)[:2]
            if lse.shape[-1] != query.shape[2]:  # its rows are padded to a multiple of 32
                lse = lse[..., :query.shape[2]]
        elif query.device.type == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(query, key, value, is_causal=causal,
                                                                                attn_mask=bias, scale=scale)
        else:
            return None
    except torch.OutOfMemoryError:
        raise
    except (AttributeError, RuntimeError, NotImplementedError):  # op missing, or not built for this case
        _unavailable.add(kind)
        return None
    return out, lse


def past_and_new_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                           mask: NewTokenMask) -> torch.Tensor | None:
    """query [1, heads, n, d]; key, value [1, kv_heads, past + n, d], past > 0, the last n being
    the new tokens'. Every query sees all `past` keys, and the new ones as `mask` allows.
    Returns [1, n, heads, d] in the query's dtype, or None where no fused kernel is available."""
    batch, heads, n, dim = query.shape
    kv_heads, past = key.shape[1], key.shape[2] - n
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * n, dim)
    (past_keys, new_keys), (past_values, new_values) = key.split((past, n), 2), value.split((past, n), 2)
    old = fused_attention_with_lse(folded, past_keys, past_values, scale)
    if old is None:
        return None
    return attend_new_and_merge(query, folded, old, new_keys, new_values, scale, mask)


def attend_new_and_merge(query: torch.Tensor, folded: torch.Tensor, old: tuple[torch.Tensor, torch.Tensor],
                         new_keys: torch.Tensor, new_values: torch.Tensor, scale: float,
                         mask: NewTokenMask) -> torch.Tensor | None:
    """The new tokens' part of `past_and_new_attention`, merged with the past's (out, lse) `old`:
    query [1, heads, n, d], folded as [1, kv_heads, groups * n, d]; new_keys, new_values
    [1, kv_heads, n, d]. [1, n, heads, d] in the query's dtype, or None where no fused kernel is
    available."""
    n, kv_heads = query.shape[2], new_keys.shape[1]
    groups = query.shape[1] // kv_heads
    if mask.allowed is None and n >= CAUSAL_KERNEL_FROM:
        # Unfolded, the kernel's own causal mask fits: the new keys and values repeated per query head
        # (2n rows a head) instead of a [groups * n, n] bias (n = 8,192 on the 8B shape: 128 MiB, not 512).
        # Heads h * groups + member unfolded are rows member * n + query of KV head h folded.
        new = fused_attention_with_lse(query, new_keys.repeat_interleave(groups, 1),
                                       new_values.repeat_interleave(groups, 1), scale, causal=True)
        if new is None:
            return None
        new = new[0].reshape(folded.shape), new[1].reshape(folded.shape[:3])
    else:
        new = fused_attention_with_lse(folded, new_keys, new_values, scale,
                                       mask.folded_bias(kv_heads, groups, query.dtype, query.device))
        if new is None:
            return None
    return merge_past_and_new(old, new, query)


def merge_past_and_new(old: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor],
                       query: torch.Tensor) -> torch.Tensor:
    """The attention over past and new keys from each part's (out [1, kv_heads, groups * n, d],
    lse [1, kv_heads, groups * n]) for folded `query` [1, heads, n, d] -> [1, n, heads, d]."""
    batch, heads, n, dim = query.shape
    precise = torch.promote_types(query.dtype, torch.float32)  # the merge's arithmetic
    past_share = torch.sigmoid(old[1] - new[1]).to(precise)[..., None]  # every query sees the past: finite
    merged = torch.lerp(new[0].to(precise), old[0].to(precise), past_share)
    return merged.reshape(batch, heads, n, dim).transpose(1, 2).to(query.dtype, memory_format=torch.contiguous_format)
