"""Queries seen by attention, recorded on request: the retrieval cache scores its chunks with them.

transformers hands attention functions the rotated queries, but keeps them to itself. specchat
registers an SDPA attention under its own name that records them while `record_queries` is
active and otherwise does exactly what transformers' SDPA does (same kernel, same mask builder).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .split_attention import attention_with_lse, merge

ATTENTION = "specchat_sdpa"

_recording: contextvars.ContextVar[dict[int, torch.Tensor] | None] = contextvars.ContextVar(
    "specchat_queries", default=None)


# Set by an offloaded cache that leaves the attention over its CPU-resident prefix to the CPU:
# (keys, values) [kv_heads, prefix, head_dim] in host memory, for the layer about to attend.
cpu_prefix: contextvars.ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = contextvars.ContextVar(
    "specchat_cpu_prefix", default=None)


def _sdpa_recording_queries(module, query, key, value, attention_mask, **kwargs):
    recorded = _recording.get()
    if recorded is not None:
        recorded[module.layer_idx] = query.detach()  # [1, heads, n, head_dim], after RoPE
    prefix = cpu_prefix.get()
    if prefix is not None:
        cpu_prefix.set(None)
        return _split_attention(module, query, key, value, attention_mask, prefix), None
    if _foldable(module, query, attention_mask):
        return _grouped_attention(module, query, key, value, attention_mask, kwargs.get("scaling")), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _foldable(module, query, attention_mask) -> bool:
    """Several queries under a mask shared by all heads, with grouped KV heads, on a GPU: the
    case where transformers' SDPA copies every key and value once per query head of the group.
    (On this project's 2-core CPU folding made a 7.7K-token chunked prefill 10-15% slower, so
    the CPU keeps transformers' path.)"""
    groups = getattr(module, "num_key_value_groups", 1)
    return (query.is_cuda and groups > 1 and query.shape[2] > 1 and attention_mask is not None
            and attention_mask.shape[1] == 1)


def _grouped_attention(module, query, key, value, attention_mask, scaling) -> torch.Tensor:
    """Grouped-query attention for a verification (a chain or a tree) without copying the KV.

    The g query heads that share a KV head are folded into the query length, and the mask's
    rows repeated g times: the same scores and softmax as with `repeat_kv`, but each layer's
    keys and values are read once instead of copied g times (at 32K positions on an H100 the
    copies made a 2-64-token forward of Llama-3.1-8B's shape cost 2.5x a 1-token one;
    transformers folds this way only for a single query). Returns [1, n, heads, head_dim].
    """
    groups = module.num_key_value_groups
    batch, heads, n, dim = query.shape
    folded = query.reshape(batch, heads // groups, groups * n, dim)  # row = member * n + query
    mask = attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, n, dim).transpose(1, 2).contiguous()


def _split_attention(module, query, key, value, attention_mask, prefix) -> torch.Tensor:
    """Attention over a CPU-resident prefix (on the CPU) and this forward's new keys (on the
    device), merged by log-sum-exp (kv/split_attention.py). Returns [1, n, heads, head_dim]."""
    prefix_keys, prefix_values = prefix
    n, start = query.shape[2], prefix_keys.shape[1]
    if attention_mask is None:  # transformers' causal shortcut
        allowed = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    else:
        tail = attention_mask[0, 0, :, start:start + n]
        allowed = tail if tail.dtype == torch.bool else tail == 0
    scale = module.scaling
    new_out, new_lse = attention_with_lse(query[0], key[0], value[0], scale, allowed)
    old_out, old_lse = attention_with_lse(query[0].cpu(), prefix_keys, prefix_values, scale)
    out = merge(old_out.to(query.device), old_lse.to(query.device), new_out, new_lse)
    return out.to(query.dtype).transpose(0, 1)[None]


AttentionInterface.register(ATTENTION, _sdpa_recording_queries)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@contextlib.contextmanager
def record_queries() -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, every forward of a model using `ATTENTION` stores each layer's queries
    in the yielded dict (layer index -> [1, heads, n, head_dim]); the last forward wins."""
    recorded: dict[int, torch.Tensor] = {}
    token = _recording.set(recorded)
    try:
        yield recorded
    finally:
        _recording.reset(token)
