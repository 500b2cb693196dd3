"""Which attention reads an 8-bit KV (kv/int8.py): the fused kernel (kv/int8_kernel.py) where it
runs, else the rows dequantized into the model's dtype for the ordinary path. Where it runs, new
keys and values are packed into the cache by a kernel too (`pack_into`).

Where `reads_packed` says so, the cache hands attention its packed rows as stored, and attention
(kv/queries.py) calls `attend`. That answers None where the fused route does not apply, and the
caller dequantizes the rows and goes on as for any cache:
- a prefill chunk's many query rows (past MAX_ROWS): dequantizing once per chunk costs little per
  query there, and flash attention is tuned for long query blocks (this kernel, for a few rows);
- a mask that hides part of the past (only the causal or tree mask among new tokens is handled:
  the new tokens are dequantized and attended as kv/past_attention.py does, then merged);
- a kernel that fails to build or launch on this machine: the dequantized path from then on
  (core/triton_route.py).
"""

from __future__ import annotations

import torch

from ..triton_route import TritonRoute
from .device_length import DeviceStep
from .int8_rows import unpack
from .past_attention import NewTokenMask, attend_new_and_merge, fused_attention_with_lse, merge_past_and_new

# A KV head's query rows (its group's query heads x the new tokens) up to which the kernel is used:
# a 64-token verification with 4 query heads a KV head.
MAX_ROWS = 256
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # its sums are float32: no float64
ROUTE = TritonRoute(".kv.int8_kernel", "dequantized")


def reads_packed(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether attention on `device` with queries of `dtype` takes an 8-bit cache's packed rows as
    stored."""
    return dtype in KERNEL_DTYPES and ROUTE.runs_on(device, dtype)


def pack_into(states: torch.Tensor, rows: torch.Tensor, at: int | torch.Tensor) -> bool:
    """Quantize `states` [1, kv_heads, n, d] into the packed `rows` [1, kv_heads, capacity, d + 4]
    from slot `at` on (or at the slots `at`) in one kernel, where `reads_packed` says the kernels
    run; False where the kernel failed (the caller packs them in torch: the same bits)."""
    try:
        ROUTE.kernel.pack_rows(states[0], rows[0], at)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # a kernel that does not build or run here
        ROUTE.fail(states.device, error)
        return False
    return True


def attend(query: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor, scale: float,
           visible: NewTokenMask | None, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """query [1, heads, n, d]; key_rows, value_rows [1, kv_heads, length, d + 4] packed, the last n
    the new tokens'. Attends every position (one token, no mask) or, where `visible` says every
    new token sees the whole past, the past in the kernel and the new tokens under their mask.
    Returns [1, n, heads, d] in the query's dtype, or None (then dequantize and attend as usual)."""
    batch, heads, n, dim = query.shape
    kv_heads, length = key_rows.shape[1], key_rows.shape[2]
    groups = heads // kv_heads
    whole = n == 1 and attention_mask is None
    if (groups * n > MAX_ROWS or dim % 4 or not reads_packed(query.device, query.dtype)
            or key_rows.stride() != value_rows.stride()  # the kernel walks both with the keys' strides
            or not (whole or (visible is not None and length > n))):
        return None
    folded = query.reshape(batch, kv_heads, groups * n, dim)
    seen = length if whole else length - n
    try:
        out, lse = ROUTE.kernel.attend_packed(folded[0], key_rows[0, :, :seen], value_rows[0, :, :seen], scale)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # a kernel that does not build or run here (Triton or driver too old)
        ROUTE.fail(query.device, error)
        return None
    if whole:
        return out.reshape(batch, heads, n, dim).transpose(1, 2).to(query.dtype)
    new_keys, new_values = (unpack(rows[:, :, seen:], query.dtype) for rows in (key_rows, value_rows))
    return attend_new_and_merge(query, folded, (out[None], lse[None]), new_keys, new_values, scale, visible)


def attend_step(query: torch.Tensor, key_buffer: torch.Tensor, value_buffer: torch.Tensor, step: DeviceStep,
                scale: float) -> torch.Tensor:
    """A replayable step (kv/device_length.py) over an 8-bit cache's whole buffers [1, kv_heads,
    capacity, d + 4], the new rows written at `step.slots`: the past's `step.past` rows in the
    kernel (the length read on the device), the new ones dequantized under their mask, merged.
    Returns [1, n, heads, d] in the query's dtype."""
    batch, heads, n, dim = query.shape
    kv_heads = key_buffer.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * n, dim)
    out, lse = ROUTE.kernel.attend_packed(folded[0], key_buffer[0], value_buffer[0], scale, length=step.past)
    new = fused_attention_with_lse(folded, *(unpack(buffer.index_select(2, step.slots), query.dtype)
                                             for buffer in (key_buffer, value_buffer)),
                                   scale, step.new_mask.folded_bias(kv_heads, groups, query.dtype, query.device))
    if new is None:
        raise RuntimeError(f"no fused attention kernel with a bias for {query.dtype} on {query.device.type}")
    return merge_past_and_new((out[None], lse[None]), new, query)

