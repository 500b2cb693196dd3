"""Queries seen by attention, recorded on request: the retrieval cache scores its chunks with them.

transformers hands attention functions the rotated queries, but keeps them to itself. specchat
registers an SDPA attention under its own name that records them while `record_queries` is
active and otherwise does exactly what transformers' SDPA does (same kernel, same mask builder).
Only the model adapter records (`CausalLM.forward_with_queries`): the decoders get the queries as
a return value, never through this module's context variable.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from . import int8_attention
from .device_length import active_step, attend
from .int8_rows import unpack
from .past_attention import NewTokenMask, fused_kernels_known_to_fail, past_and_new_attention

ATTENTION = "specchat_sdpa"

_recording: contextvars.ContextVar[dict[int, torch.Tensor] | None] = contextvars.ContextVar(
    "specchat_queries", default=None)


# Set by `new_tokens_see_the_past` for a multi-token forward in which every new token sees every
# cached position: the new tokens' mask among themselves. Lets attention leave the past unmasked
# (kv/past_attention.py).
_past_visible: contextvars.ContextVar[NewTokenMask | None] = contextvars.ContextVar(
    "specchat_past_visible", default=None)

# Devices where the past is attended without a mask (tests switch it off to compare). Measured
# 2026-11-23 (bench/): on an H100 a 16-token verification at 32K went from 34.9 to 12.1 ms of GPU
# time and a 32K chunked prefill from about 4.3 to 2.2 s; on 2 CPU threads (the embedded model's
# shape) a 7.7K chunked prefill went from 21-24 to 19-20 s, a 16-node tree from 190-230 to
# 140-180 ms, a one-token step (never split) unchanged.
SPLIT_DEVICES = {"cuda", "cpu"}


@contextlib.contextmanager
def new_tokens_see_the_past(mask: torch.Tensor | None, n: int) -> Iterator[None]:
    """Within the block, a forward of `n` tokens under `mask` (4-D [1, 1, n, past + n] on the
    model's device, additive or boolean; None: causal) attends its past without a mask, if every
    new token sees all of it. (The check runs where the mask lies: on a GPU one reduction and a
    wait while the GPU is idle anyway, where the CPU would scan n x past entries.)"""
    visible = None
    if n > 1 and (mask is None or mask.device.type in SPLIT_DEVICES):
        if mask is None:
            visible = NewTokenMask(None, n)
        else:
            allowed = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
            if bool(allowed[:, :-n].all()):
                visible = NewTokenMask(allowed[:, -n:], n)
    token = _past_visible.set(visible)
    try:
        yield
    finally:
        _past_visible.reset(token)


def _sdpa_recording_queries(module, query, key, value, attention_mask, **kwargs):
    step = active_step()
    if step is not None:  # a replayable step: key and value are the layer's whole buffers
        if step.queries is not None:
            step.queries[module.layer_idx] = query.detach()
        scale = kwargs.get("scaling")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        if key.dtype == torch.int8:  # an 8-bit cache's packed buffers (kv/int8_attention.py)
            if not _plain_attention(module, kwargs):  # no such model gets here (Int8Cache refuses them)
                raise RuntimeError("a replayable step over an 8-bit KV needs plain attention")
            return int8_attention.attend_step(query, key, value, step, scale), None
        return attend(query, key, value, step, scale), None
    recorded = _recording.get()
    if recorded is not None:
        recorded[module.layer_idx] = query.detach()  # [1, heads, n, head_dim], after RoPE
    visible = _past_visible.get()
    scale = kwargs.get("scaling")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if key.dtype == torch.int8:  # an 8-bit cache's packed rows, as stored (kv/int8_attention.py)
        if _plain_attention(module, kwargs):
            out = int8_attention.attend(query, key, value, scale, visible, attention_mask)
            if out is not None:
                return out, None
        key, value = unpack(key, query.dtype), unpack(value, query.dtype)
    if visible is not None and _splittable(module, query, key, kwargs):
        out = past_and_new_attention(query, key, value, scale, visible)
        if out is not None:
            return out, None
    n, length = query.shape[2], key.shape[2]
    if attention_mask is None and visible is not None and length > n:  # `_causal_mask` left it to the split
        attention_mask = torch.ones(n, length, dtype=torch.bool, device=query.device).tril(length - n)[None, None]
    if _foldable(module, query, attention_mask):
        return _grouped_attention(module, query, key, value, attention_mask, kwargs.get("scaling")), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _foldable(module, query, attention_mask) -> bool:
    """Grouped KV heads, where transformers' SDPA reads or copies each KV head once per query
    head of its group:
    - several queries under a mask shared by all heads, on a GPU (it copies every key and value;
      on this project's 2-core CPU folding made a 7.7K-token chunked prefill 10-15% slower, so
      the CPU keeps transformers' path there);
    - a decode step's single unmasked query, on the CPU: transformers folds it itself, but not
      once `TRANSFORMERS_SDPA_FORCE_GQA` is set (model.py), and SDPA's own GQA then reads each KV
      head once per query head. Measured at 4K positions (30 layers of the embedded model's
      shape, caches cold): 400 against 510 us a layer folded."""
    if getattr(module, "num_key_value_groups", 1) <= 1:
        return False
    if query.is_cuda:
        return query.shape[2] > 1 and attention_mask is not None and attention_mask.shape[1] == 1
    return query.device.type == "cpu" and query.shape[2] == 1 and attention_mask is None


def _splittable(module, query, key, kwargs) -> bool:
    """A forward of several new tokens after some past, on a device where the split pays, in a
    plain attention layer."""
    n = query.shape[2]
    return query.device.type in SPLIT_DEVICES and n > 1 and key.shape[2] > n and _plain_attention(module, kwargs)


def _plain_attention(module, kwargs) -> bool:
    """No sliding window (its past is not all visible), no logit soft-capping, no attention sinks."""
    return getattr(module, "sliding_window", None) is None and not kwargs.get("softcap") and kwargs.get("s_aux") is None


def _grouped_attention(module, query, key, value, attention_mask, scaling) -> torch.Tensor:
    """Grouped-query attention for a verification (a chain or a tree), or a decode step without a
    mask (`attention_mask` None), without copying the KV.

    The g query heads that share a KV head are folded into the query length, and the mask's
    rows repeated g times: the same scores and softmax as with `repeat_kv`, but each layer's
    keys and values are read once instead of copied g times (at 32K positions on an H100 the
    copies made a 2-64-token forward of Llama-3.1-8B's shape cost 2.5x a 1-token one;
    transformers folds this way only for a single query). Returns [1, n, heads, head_dim].
    """
    groups = module.num_key_value_groups
    batch, heads, n, dim = query.shape
    folded = query.reshape(batch, heads // groups, groups * n, dim)  # row = member * n + query
    mask = None if attention_mask is None else attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, n, dim).transpose(1, 2).contiguous()


def _causal_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask, except for new tokens that see the past causally where the split
    attends it unmasked: None there, so no [new x past + new] mask is built (a 1 GB boolean
    one for an 8,192-token prefill chunk at 128K) that no layer reads. A layer that does not split
    after all (no fused kernel yet known to fail, a sliding window) builds its own."""
    visible, device = _past_visible.get(), torch.device(kwargs.get("device", "cpu"))
    plain_causal = (not args and kwargs.get("attention_mask") is None and kwargs.get("local_size") is None
                    and kwargs.get("mask_function", causal_mask_function) is causal_mask_function)
    if (visible is not None and visible.allowed is None and plain_causal and device.type in SPLIT_DEVICES
            and not fused_kernels_known_to_fail(device.type, kwargs.get("dtype"))):
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTENTION, _sdpa_recording_queries)
AttentionMaskInterface.register(ATTENTION, _causal_mask)


def recording() -> dict[int, torch.Tensor] | None:
    """Where a forward now records its queries ({layer: [1, heads, n, head_dim]}), or None."""
    return _recording.get()


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
