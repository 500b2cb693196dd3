"""Which attention reads an 8-bit KV (kv/int8.py): the fused kernel (kv/int8_kernel.py) where it
runs, else the rows dequantized into the model's dtype for the ordinary path. Where it runs, new
keys and values are packed into the cache by a kernel too (`pack_into`).

Where `reads_packed` says so, the cache hands attention its packed rows as stored, and attention
(kv/queries.py) calls `attend`. That answers None where the fused route does not apply, and the
caller dequantizes the rows and goes on as for any cache:
- a prefill chunk's many query rows (past MAX_ROWS): dequantizing once per chunk costs little per
  query there, and flash attention is tuned for long query blocks (this kernel, for a few rows);
- a mask that hides part of the past (the kernel takes the causal or tree mask among the new
  tokens only);
- a kernel that fails to build or launch on this machine: the dequantized path from then on
  (core/triton_route.py).
"""

from __future__ import annotations

import torch

from ..triton_route import TritonRoute
from .device_length import DeviceStep
from .past_attention import NewTokenMask

# A KV head's query rows (its group's query heads x the new tokens) up to which the kernel is used:
# a 64-token verification with 4 query heads a KV head.
MAX_ROWS = 256
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # its sums are float32: no float64
# Larger heads (256) need over 99 KB of shared memory a program at 64 rows (an RTX 30/40's limit):
# they keep the dequantized path.
MAX_HEAD_DIM = 128
ROUTE = TritonRoute(".kv.int8_kernel", "dequantized")


def reads_packed(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention on `device` with queries of `dtype` takes an 8-bit cache's packed rows
    (of `head_dim` codes) as stored."""
    return (dtype in KERNEL_DTYPES and head_dim % 4 == 0 and head_dim <= MAX_HEAD_DIM
            and ROUTE.runs_on(device, dtype))


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
    new token sees the whole past, the past and the new tokens under their mask, all in the
    kernel. Returns [1, n, heads, d] in the query's dtype, or None (then dequantize and attend as
    usual)."""
    batch, heads, n, dim = query.shape
    kv_heads, length = key_rows.shape[1], key_rows.shape[2]
    groups = heads // kv_heads
    whole = n == 1 and attention_mask is None
    if (groups * n > MAX_ROWS or not reads_packed(query.device, query.dtype, dim)
            or key_rows.stride() != value_rows.stride()  # the kernel walks both with the keys' strides
            or not (whole or (visible is not None and length > n))):
        return None
    folded = query.reshape(batch, kv_heads, groups * n, dim)
    try:
        if whole:
            out, _ = ROUTE.kernel.attend_packed(folded[0], key_rows[0], value_rows[0], scale)
        else:
            out, _ = ROUTE.kernel.attend_packed(folded[0], key_rows[0], value_rows[0], scale, n,
                                                visible.allowed_on(query.device))
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # a kernel that does not build or run here (Triton or driver too old)
        ROUTE.fail(query.device, error)
        return None
    return unfolded(out, query)


def attend_step(query: torch.Tensor, key_buffer: torch.Tensor, value_buffer: torch.Tensor, step: DeviceStep,
                scale: float) -> torch.Tensor:
    """A replayable step (kv/device_length.py) over an 8-bit cache's whole buffers [1, kv_heads,
    capacity, d + 4], the new rows written at `step.slots`: the past's `step.past` rows (the
    length read on the device) and the new ones under their mask, in the kernel. Returns [1, n,
    heads, d] in the query's dtype."""
    batch, heads, n, dim = query.shape
    folded = query.reshape(batch, key_buffer.shape[1], heads // key_buffer.shape[1] * n, dim)
    out, _ = ROUTE.kernel.attend_packed(folded[0], key_buffer[0], value_buffer[0], scale, n, step.allowed,
                                        past=step.past)
    return unfolded(out, query)


def unfolded(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The kernel's out [kv_heads, groups x n, d] (float32) for `query` [1, heads, n, d] as
    attention returns it: [1, n, heads, d] in the query's dtype."""
    batch, heads, n, dim = query.shape
    return out.reshape(batch, heads, n, dim).transpose(1, 2).to(query.dtype, memory_format=torch.contiguous_format)
