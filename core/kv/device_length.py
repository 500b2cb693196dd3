"""A forward whose positions live on the device: KV writes and attention that a CUDA graph can replay.

A captured graph replays fixed kernels on fixed addresses: the Python numbers of a decode step
(how long the past is, where the new entries go) cannot reach it. Here they are small device
tensors that the step runner (core/step_graphs.py) fills before each replay. `slots` [n] says
where the n new keys and values are written into each layer's whole buffer (`index_copy_`,
kv/full.py), `past` [1] how many slots every new token sees before them. Attention reads the
past with a kernel that takes its length from the device (flash attention's `seqused_k`, the
memory-efficient kernel's `seqlen_k`; masked arithmetic where neither exists), the new tokens
among themselves under their n x n mask, and merges the two by log-sum-exp as the eager path
does (kv/past_attention.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .past_attention import NewTokenMask, fused_attention_with_lse, merge_past_and_new


@dataclass
class DeviceStep:
    """The device-side numbers of one forward of n new tokens, filled in place before a replay,
    and the kernels' fixed arguments for a buffer of `capacity` slots."""
    past: torch.Tensor  # [1] int32: slots before the new tokens, all seen by every new token (>= 1)
    allowed: torch.Tensor  # [n, n] bool: which new tokens each new token sees (a chain's or a tree's mask)
    query_bounds: torch.Tensor  # [2] int32: 0 and n (flash attention's one sequence of queries)
    key_bounds: torch.Tensor  # [2] int32: 0 and the capacity
    slots: torch.Tensor = field(init=False)  # [n] long: where the new entries go, past .. past + n - 1
    new_mask: NewTokenMask = field(init=False)
    # {layer: queries [1, heads, n, d]} where the forward records them (TriForce's retrieval scores
    # with them): the tensors a capture made, rewritten by every replay; None: not recorded
    queries: dict[int, torch.Tensor] | None = field(default=None, init=False)

    @classmethod
    def empty(cls, n: int, capacity: int, device: torch.device) -> DeviceStep:
        """Allocated outside any capture (a host-to-device copy cannot be captured)."""
        def int32(*values):
            return torch.tensor(values, dtype=torch.int32, device=device)
        return cls(int32(1), torch.ones(n, n, dtype=torch.bool, device=device).tril(), int32(0, n), int32(0, capacity))

    def fill(self, start: int, allowed: torch.Tensor | None) -> None:
        """`start` slots of past; `allowed` [n, n] (None: causal). Written into the same tensors,
        so that a captured graph reads them."""
        self.past.fill_(start)
        n = self.allowed.shape[0]
        self.allowed.copy_(torch.ones(n, n, dtype=torch.bool).tril() if allowed is None else allowed)


_active: contextvars.ContextVar[DeviceStep | None] = contextvars.ContextVar("specchat_device_step", default=None)


@contextlib.contextmanager
def device_step(step: DeviceStep) -> Iterator[None]:
    """Within the block, cache layers write at `step.slots` and attention reads by `step.past`.
    The mask's folded bias is rebuilt inside the block, so a capture records its kernels."""
    n = step.allowed.shape[0]
    step.slots = step.past.to(torch.long) + torch.arange(n, device=step.past.device)
    step.new_mask = NewTokenMask(step.allowed, n)
    token = _active.set(step)
    try:
        yield
    finally:
        _active.reset(token)


def active_step() -> DeviceStep | None:
    return _active.get()


def attend(query: torch.Tensor, key_buffer: torch.Tensor, value_buffer: torch.Tensor, step: DeviceStep,
           scale: float) -> torch.Tensor:
    """query [1, heads, n, d]; key and value buffers [1, kv_heads, capacity, d], the new tokens'
    entries already written at `step.slots`. Returns [1, n, heads, d] in the query's dtype."""
    batch, heads, n, dim = query.shape
    kv_heads = key_buffer.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * n, dim)  # the group's heads as rows: no KV copies
    old = _past(folded, key_buffer, value_buffer, step, scale)
    new = fused_attention_with_lse(folded, key_buffer.index_select(2, step.slots),
                                   value_buffer.index_select(2, step.slots), scale,
                                   step.new_mask.folded_bias(kv_heads, groups, query.dtype, query.device))
    if new is None:
        raise RuntimeError(f"no fused attention kernel with a bias for {query.dtype} on {query.device.type}")
    return merge_past_and_new(old, new, query)


# Kernels that failed here once, by (device type, dtype): the next choice is taken from then on.
_failed: set[tuple[str, torch.dtype, str]] = set()


def _past(folded: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: DeviceStep,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [1, kv_heads, rows, d], lse [1, kv_heads, rows]) of `folded` [1, kv_heads, rows, d]
    over the first `step.past` slots of the buffers."""
    kind = (folded.device.type, folded.dtype)
    if folded.is_cuda and folded.dtype in (torch.float16, torch.bfloat16) and (*kind, "flash") not in _failed:
        try:
            return _flash_past(folded, keys, values, step, scale)
        except RuntimeError:  # no flash kernel for this GPU (before Ampere) or this head size
            _failed.add((*kind, "flash"))
    if folded.is_cuda:
        return _efficient_past(folded, keys, values, step.past, scale)
    return _masked_past(folded, keys, values, step.past, scale)


def _flash_past(folded, keys, values, step, scale):
    """Flash attention's variable-length form: one sequence whose keys are the buffer's slots,
    of which `seqused_k` are read. The query goes in unfolded ([n, heads, d]: the kernel serves
    grouped heads itself, and splits a few queries' work along a long past); out and lse come
    back folded (head h = kv_head * groups + member, folded row = member * n + query)."""
    _, kv_heads, rows, dim = folded.shape
    n = step.allowed.shape[0]
    query = folded.reshape(kv_heads * (rows // n), n, dim).transpose(0, 1)  # [n, heads, d]
    out, lse = torch.ops.aten._flash_attention_forward.default(
        query, keys[0].transpose(0, 1), values[0].transpose(0, 1), step.query_bounds, step.key_bounds,
        n, keys.shape[2], 0.0, False, False, scale=scale, seqused_k=step.past)[:2]
    # out [n, heads, d]; lse [heads, n] (or [1, heads, n]): one sequence either way
    return out.transpose(0, 1).reshape(1, kv_heads, rows, dim), lse.reshape(1, kv_heads, rows)


def _efficient_past(folded, keys, values, past, scale):
    """The memory-efficient kernel (every dtype) with the key count read from `seqlen_k`."""
    _, kv_heads, rows, _ = folded.shape
    out, lse = torch.ops.aten._efficient_attention_forward.default(
        folded.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), None, None, None, None, None,
        0.0, 0, True, scale=scale, seqlen_k=past)[:2]
    return out.transpose(1, 2), lse[..., :rows]  # its lse rows are padded to a multiple of 32


def _masked_past(folded, keys, values, past, scale):
    """Exact arithmetic over the whole buffer with the slots from `past` on masked out: the
    reference the kernels above are checked against, and the path off CUDA."""
    unwritten = torch.arange(keys.shape[2], device=past.device) >= past.to(torch.long)  # [capacity]
    scores = (folded @ keys.transpose(-1, -2)) * scale  # [1, kv_heads, rows, capacity]
    scores = scores.masked_fill(unwritten, float("-inf"))
    lse = scores.logsumexp(-1)
    # Slots never written hold whatever the memory held (NaN included): weight 0 would not cancel it.
    return (scores - lse[..., None]).exp() @ values.masked_fill(unwritten[:, None], 0.0), lse
