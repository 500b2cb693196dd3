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

ATTENTION = "specchat_sdpa"

_recording: contextvars.ContextVar[dict[int, torch.Tensor] | None] = contextvars.ContextVar(
    "specchat_queries", default=None)


def _sdpa_recording_queries(module, query, key, value, attention_mask, **kwargs):
    recorded = _recording.get()
    if recorded is not None:
        recorded[module.layer_idx] = query.detach()  # [1, heads, n, head_dim], after RoPE
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


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
