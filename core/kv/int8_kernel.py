"""The 8-bit KV's Triton kernels (kv/int8.py's packed rows, kv/int8_rows.py's format): attention of
a few queries over the packed rows in one kernel, each code dequantized in registers (the KV is
read once, at 1 byte an element plus its scales); the merge of its splits; and the packing of new
keys and values straight into the cache's buffer.

Why: dequantizing a layer into a bf16 copy and attending to the copy writes and reads the KV
again; on an H100 that took 8.3-9.0x a bf16 KV's attention for half its bytes (campaign `kv8`),
so the plan prices an 8-bit KV too slow to choose on the GPU. llama.cpp's q8_0 cache is read in
its attention kernel the same way.

The kernel attends to the dequantized values exactly as stored: a row's keys enter the scores as
(query . codes) x scale and its values the output as (weight x scale) . codes, the same sums as
over codes x scale, rounded in another order. The sequence is split among programs (flash
decoding) so that a decode step's few query rows still fill the GPU; each split gives its output
and log-sum-exp, merged here exactly.

Triton comes with PyTorch's CUDA wheels on Linux, not on Windows (kv/int8_attention.py then keeps
the dequantized path). On the CPU the same kernel runs in Triton's interpreter: the tests'
rehearsal of the GPU path, never a production one (Triton reads TRITON_INTERPRET=1 when it is
first imported: tests/conftest.py sets it where there is no CUDA).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .int8_rows import pack, unpack

# Copies of a block's codes in flight: two (double buffering) keep a half-precision program within
# 25-42 KB of shared memory; Triton's default three take 40-59 KB, and float32 at 64 rows 116 KB,
# over an RTX 30/40 card's 99 KB.
STAGES = 2


def tiles(rows: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(query rows a program takes, KV positions an iteration reads, warps) for `rows` query rows
    of `dtype`, sized by ptxas's register use (sm_86/90, tests/test_triton_compile.py): half
    precision at 32-64 rows spills with 4 warps, not with 8; float32's dot products (no tensor
    cores in IEEE mode) spill kilobytes a thread past 16 rows and 32 positions."""
    if dtype == torch.float32:
        return 16, 32, 8
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return block_m, 64, 4 if block_m == 16 else 8

PROGRAMS_PER_CPU_RUN = 8  # the interpreter's share of splits: enough to exercise the merge


@triton.jit
def _attend_block(query, best, mass, total, first, end, past, allowed, row_ids, row_held, new_tokens, head, dims,
                  dim_held, key_codes, key_scales, value_codes, value_scales, scale_log2, code_head_words,
                  code_row_words, scale_head_stride, scale_row_stride, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                  MASKED: tl.constexpr):
    """The online softmax's running (best, mass, total) after positions [first, first + BLOCK_N) up
    to `end`; where MASKED, the new tokens' positions (from `past` on) under `allowed`."""
    positions = first + tl.arange(0, BLOCK_N)
    held = positions < end  # every block holds at least its first position
    # Strides given in 4-byte words: the compiler then knows every row starts 4-byte aligned and
    # copies 4 codes at a time, asynchronously ahead of use (byte strides: one load per code).
    codes_at = (head.to(tl.int64) * code_head_words * 4 + positions[:, None].to(tl.int64) * (code_row_words * 4)
                + dims[None, :])  # int64: a layer's buffer may pass 2 GB (8 KV heads past 2M positions)
    scales_at = head.to(tl.int64) * scale_head_stride + positions.to(tl.int64) * scale_row_stride
    code_held = held[:, None] & dim_held[None, :]
    keys = tl.load(key_codes + codes_at, mask=code_held, other=0).to(query.dtype)  # |code| <= 127: exact
    key_scale = tl.load(key_scales + scales_at, mask=held, other=0.0)
    if IEEE:  # fp32 queries: no TF32 rounding
        scores = tl.dot(query, tl.trans(keys), input_precision="ieee")
    else:
        scores = tl.dot(query, tl.trans(keys))
    if MASKED:  # row r is new token r mod new_tokens: it sees the new tokens `allowed` says
        sees = tl.load(allowed + (row_ids % new_tokens)[:, None] * new_tokens + (positions - past)[None, :],
                       mask=row_held[:, None] & held[None, :], other=0)
        visible = (sees != 0) & held[None, :]
    else:
        visible = tl.broadcast_to(held[None, :], scores.shape)
    scores = tl.where(visible, scores * (key_scale * scale_log2)[None, :], float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, 1))
    shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # a row that has seen nothing yet: no NaN
    kept = tl.exp2(best - shift)
    weights = tl.exp2(scores - shift[:, None])
    mass = mass * kept + tl.sum(weights, 1)
    values = tl.load(value_codes + codes_at, mask=code_held, other=0).to(query.dtype)
    value_scale = tl.load(value_scales + scales_at, mask=held, other=0.0)
    # fp16 holds weight x scale badly where both are small (subnormal below 6e-5): the scales go
    # in relative to the block's largest, which multiplies the block's float32 sum instead.
    largest = tl.max(value_scale, 0)
    largest = tl.where(largest > 0, largest, 1.0)
    scaled = (weights * (value_scale / largest)[None, :]).to(query.dtype)
    if IEEE:
        total = total * kept[:, None] + tl.dot(scaled, values, input_precision="ieee") * largest
    else:
        total = total * kept[:, None] + tl.dot(scaled, values) * largest
    return new_best, mass, total


# Lengths change every step, and a head's stride with the cache's capacity: specializing on them
# (Triton's divisible-by-16 variants) would compile the kernel again in mid-answer.
@triton.jit(do_not_specialize=["rows", "past", "new_tokens", "split_length", "code_head_words", "scale_head_stride"])
def _attend_packed(queries, key_codes, key_scales, value_codes, value_scales, out, lse, past_at, allowed,
                   rows, past, new_tokens, split_length, head_dim, scale_log2,
                   query_head_stride, query_row_stride, code_head_words, code_row_words,
                   scale_head_stride, scale_row_stride,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                   PAST_ON_DEVICE: tl.constexpr, MASK_NEW: tl.constexpr):
    """One (block of query rows, KV head, split of the sequence): its normalized output and
    log-sum-exp (natural log) over positions [split x split_length, +split_length) of the `past`
    (read from `past_at` where PAST_ON_DEVICE: a CUDA graph's replay) and the `new_tokens` after
    it. Every row sees the past; where MASK_NEW, row r sees new token j where `allowed`
    [new_tokens, new_tokens] (uint8) holds (r mod new_tokens, j), else every new token. A split
    that sees nothing gives zeros and a log-sum-exp of -inf: no weight in the merge."""
    row_block, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row_ids = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_held, dim_held = row_ids < rows, dims < head_dim
    query = tl.load(queries + head * query_head_stride + row_ids[:, None] * query_row_stride + dims[None, :],
                    mask=row_held[:, None] & dim_held[None, :], other=0.0)
    if PAST_ON_DEVICE:
        past = tl.load(past_at)
    start = split * split_length
    end = tl.minimum(start + split_length, past + new_tokens)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the log2-scaled scores
    mass = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - best)
    total = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The past, which every row sees, then (where masked) the new tokens' positions under the mask.
    unmasked_end = tl.minimum(end, past) if MASK_NEW else end
    for first in range(start, unmasked_end, BLOCK_N):
        best, mass, total = _attend_block(query, best, mass, total, first, unmasked_end, past, allowed, row_ids,
                                          row_held, new_tokens, head, dims, dim_held, key_codes, key_scales,
                                          value_codes, value_scales, scale_log2, code_head_words, code_row_words,
                                          scale_head_stride, scale_row_stride, BLOCK_N, IEEE, False)
    if MASK_NEW:
        for first in range(tl.maximum(start, past), end, BLOCK_N):
            best, mass, total = _attend_block(query, best, mass, total, first, end, past, allowed, row_ids,
                                              row_held, new_tokens, head, dims, dim_held, key_codes, key_scales,
                                              value_codes, value_scales, scale_log2, code_head_words,
                                              code_row_words, scale_head_stride, scale_row_stride, BLOCK_N, IEEE,
                                              True)
    part = (split * tl.num_programs(1) + head) * rows + row_ids
    seen = mass > 0
    divisor = tl.where(seen, mass, 1.0)  # an empty split: total 0, so out 0
    tl.store(out + part[:, None] * head_dim + dims[None, :], total / divisor[:, None],
             mask=row_held[:, None] & dim_held[None, :])
    tl.store(lse + part, tl.where(seen, (best + tl.log2(divisor)) * 0.6931471805599453, float("-inf")), mask=row_held)


def scale_view(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The float32 scales [kv_heads, length] stored after each packed row's codes, as a view."""
    return rows.view(torch.float32)[..., head_dim // 4]


def attend_packed(queries: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor, scale: float,
                  new_tokens: int = 0, allowed: torch.Tensor | None = None,
                  past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """queries [kv_heads, rows, d] (each KV head's query rows: its group folded with the tokens,
    row = member x new_tokens + token), key_rows and value_rows [kv_heads, positions, d + 4]
    packed int8 (d a multiple of 4, rows contiguous, both with the same strides, multiples of 4
    bytes): a past, then `new_tokens` new rows. Every row sees the whole past, and the new rows
    that `allowed` [new_tokens, new_tokens] (bool, on the device; None: all) lets its token see.
    `past` ([1] int32 on the device, >= 1: what a CUDA graph reads at replay, the rows then a
    whole buffer) gives the past's length; else it is positions - new_tokens. Returns (out
    [kv_heads, rows, d] float32, lse [kv_heads, rows] float32, natural log)."""
    kv_heads, rows, head_dim = queries.shape
    if key_rows.stride(0) % 4 or key_rows.stride(1) % 4:
        raise ValueError(f"packed rows need strides in whole 4-byte words, not {key_rows.stride()}")
    if queries.stride(-1) != 1:
        queries = queries.contiguous()
    positions = key_rows.shape[1]
    block_m, block_n, warps = tiles(rows, queries.dtype)
    row_blocks, position_blocks = triton.cdiv(rows, block_m), triton.cdiv(positions, block_n)
    wanted = (4 * torch.cuda.get_device_properties(queries.device).multi_processor_count
              if queries.is_cuda else PROGRAMS_PER_CPU_RUN)
    splits = max(1, min(position_blocks, wanted // (kv_heads * row_blocks)))
    split_length = triton.cdiv(position_blocks, splits) * block_n
    splits = triton.cdiv(positions, split_length)  # none starts past the last position
    out = torch.empty(splits, kv_heads, rows, head_dim, dtype=torch.float32, device=queries.device)
    lse = torch.empty(splits, kv_heads, rows, dtype=torch.float32, device=queries.device)
    key_scales, value_scales = scale_view(key_rows, head_dim), scale_view(value_rows, head_dim)
    _attend_packed[(row_blocks, kv_heads, splits)](
        queries, key_rows, key_scales, value_rows, value_scales, out, lse, out if past is None else past,
        out if allowed is None else allowed.view(torch.uint8),
        rows, positions - new_tokens if past is None else 0, new_tokens, split_length, head_dim,
        scale * math.log2(math.e), queries.stride(0), queries.stride(1), key_rows.stride(0) // 4,
        key_rows.stride(1) // 4, key_scales.stride(0), key_scales.stride(1),
        BLOCK_M=block_m, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=block_n,
        IEEE=queries.dtype == torch.float32, PAST_ON_DEVICE=past is not None, MASK_NEW=allowed is not None,
        num_stages=STAGES, num_warps=warps)
    if splits == 1:
        return out[0], lse[0]
    merged, merged_lse = torch.empty_like(out[0]), torch.empty_like(lse[0])
    _merge_splits[(kv_heads * rows,)](out, lse, merged, merged_lse, splits, kv_heads * rows, head_dim,
                                      BLOCK_S=SPLITS_PER_STEP, BLOCK_D=triton.next_power_of_2(head_dim))
    return merged, merged_lse


# Splits merged per iteration: a fixed block (one compiled kernel whatever the split count, which
# grows with the context) small enough to stay in registers (66 splits of 128 values would not).
SPLITS_PER_STEP = 16


# One kernel where torch's merge took eight small ones a layer (logsumexp's own four among them).
@triton.jit(do_not_specialize=["splits", "parts"])
def _merge_splits(out, lse, merged, merged_lse, splits, parts, head_dim, BLOCK_S: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """One query row (of parts = kv_heads x rows): its splits' outputs [splits, parts, d] weighted by
    exp(lse - their log-sum-exp); a split of lse -inf (it saw nothing) weighs nothing."""
    part = tl.program_id(0)
    dims = tl.arange(0, BLOCK_D)
    dim_held = dims < head_dim
    best = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for first in range(0, splits, BLOCK_S):
        split_ids = first + tl.arange(0, BLOCK_S)
        best = tl.maximum(best, tl.load(lse + split_ids * parts + part, mask=split_ids < splits, other=float("-inf")))
    top = tl.max(best, 0)  # finite: every row sees at least one position
    mass = tl.zeros([BLOCK_S], tl.float32)
    total = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for first in range(0, splits, BLOCK_S):
        split_ids = first + tl.arange(0, BLOCK_S)
        split_held = split_ids < splits
        weights = tl.exp(tl.load(lse + split_ids * parts + part, mask=split_held, other=float("-inf")) - top)
        mass += weights
        total += weights[:, None] * tl.load(out + (split_ids[:, None] * parts + part) * head_dim + dims[None, :],
                                            mask=split_held[:, None] & dim_held[None, :], other=0.0)
    whole = tl.sum(mass, 0)
    tl.store(merged + part * head_dim + dims, tl.sum(total, 0) / whole, mask=dim_held)
    tl.store(merged_lse + part, top + tl.log(whole))


TOKENS_PER_PACK = 16  # new tokens a program packs


@triton.jit(do_not_specialize=["tokens", "first_slot", "out_head_words"])
def _pack_rows(states, rows_out, slots, tokens, first_slot, head_dim, state_head_stride, state_token_stride,
               out_head_words, out_row_words, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
               SLOTS_ON_DEVICE: tl.constexpr):
    """kv/int8_rows.py's `pack` for BLOCK_T tokens of one KV head, bit for bit: scale = absmax / 127,
    codes = round(x / scale) half to even, clamped to +-127, all in float32 with correctly rounded
    division; written at slots first_slot + t, or slots[t] (a replayable step's)."""
    token_block, head = tl.program_id(0), tl.program_id(1)
    token_ids, dims = token_block * BLOCK_T + tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_D)
    token_held, dim_held = token_ids < tokens, dims < head_dim
    held = token_held[:, None] & dim_held[None, :]
    x = tl.load(states + head * state_head_stride + token_ids[:, None] * state_token_stride + dims[None, :],
                mask=held, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), 1), tl.full([BLOCK_T], 127.0, tl.float32))
    ratio = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
    nearest = tl.floor(ratio + 0.5)  # exact: |ratio| <= 128, far below 2^23
    halfway_odd = (nearest - ratio == 0.5) & (nearest - 2.0 * tl.floor(nearest * 0.5) == 1.0)
    codes = tl.minimum(tl.maximum(tl.where(halfway_odd, nearest - 1.0, nearest), -127.0), 127.0)
    if SLOTS_ON_DEVICE:
        slot = tl.load(slots + token_ids, mask=token_held, other=0)
    else:
        slot = first_slot + token_ids
    row = rows_out + head.to(tl.int64) * out_head_words * 4 + slot.to(tl.int64) * (out_row_words * 4)
    tl.store(row[:, None] + dims[None, :], codes.to(tl.int8), mask=held)
    tl.store((row + head_dim).to(tl.pointer_type(tl.float32)), scale, mask=token_held)


def pack_rows(states: torch.Tensor, rows: torch.Tensor, at: int | torch.Tensor) -> None:
    """Pack `states` [kv_heads, n, d] (fp16, bf16 or fp32; d a multiple of 4) into `rows`
    [kv_heads, capacity, d + 4] from slot `at` on, or at the slots `at` [n] (long, on the device)."""
    kv_heads, tokens, head_dim = states.shape
    if states.stride(-1) != 1:
        states = states.contiguous()
    if rows.stride(0) % 4 or rows.stride(1) % 4 or rows.shape[-1] != head_dim + 4:
        raise ValueError(f"packed rows [{rows.shape}, strides {rows.stride()}] cannot take {head_dim} codes")
    on_device = isinstance(at, torch.Tensor)
    _pack_rows[(triton.cdiv(tokens, TOKENS_PER_PACK), kv_heads)](
        states, rows, at if on_device else rows, tokens, 0 if on_device else at, head_dim,
        states.stride(0), states.stride(1), rows.stride(0) // 4, rows.stride(1) // 4,
        BLOCK_T=TOKENS_PER_PACK, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), SLOTS_ON_DEVICE=on_device)


def self_check(device: torch.device, dtype: torch.dtype) -> None:
    """Run each kernel variant the engine launches once on `device`, at head sizes 64 and 128,
    against torch: packing bit for bit (from a slot, and at a graph's slots); attention for one
    token, verifications of 4, 8 and 16 tokens under a causal mask (16-, 32- and 64-row blocks)
    and a graph's steps of 1 and 16 tokens (the past's length on the device), each over several
    splits (so the merge too), within the rounding of `dtype`. Raises where a kernel builds but
    computes wrongly here (a compiler or driver fault on a GPU no test ran on), so that its route
    falls back before the first answer; compiles them all now rather than in mid-answer."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, length, groups = 2, 150, 4

    def random(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    for head_dim in (64, 128):
        stored = []
        for at in (0, torch.arange(length, device=device)):  # keys from slot 0; values at slots (a graph's)
            states = random(kv_heads, length, head_dim) * 3
            rows = torch.full((kv_heads, length + 10, head_dim + 4), 127, dtype=torch.int8, device=device)
            pack_rows(states, rows, at)
            if not torch.equal(rows[:, :length], pack(states)):
                raise RuntimeError("self-check: the packing kernel's bytes differ from torch's")
            stored.append(rows)
        keys, values = (unpack(rows[:, :length], torch.float32) for rows in stored)
        for tokens, on_device in ((1, False), (4, False), (8, False), (16, False), (1, True), (16, True)):
            causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
            queries = random(kv_heads, groups * tokens, head_dim)
            held = [rows[:, :length] for rows in stored]
            if on_device:  # a graph's step: the whole buffers, the past's length read on the device
                past = torch.tensor([length - tokens], dtype=torch.int32, device=device)
                out, _ = attend_packed(queries, *stored, head_dim ** -0.5, tokens, causal, past=past)
            elif tokens == 1:
                out, _ = attend_packed(queries, *held, head_dim ** -0.5)
            else:
                out, _ = attend_packed(queries, *held, head_dim ** -0.5, tokens, causal)
            visible = torch.ones(groups * tokens, length, dtype=torch.bool, device=device)
            visible[:, length - tokens:] = causal[torch.arange(groups * tokens, device=device) % tokens]
            scores = (queries.float() @ keys.transpose(-1, -2) * head_dim ** -0.5).masked_fill(~visible, float("-inf"))
            expected = torch.softmax(scores, -1) @ values
            error = (out - expected).abs().max().item()
            if not error <= 0.02 * expected.abs().max().item():  # bf16's rounding of the weights: 0.4%
                raise RuntimeError(f"self-check: the attention kernel ({tokens} tokens, head size {head_dim}"
                                   f"{', length on the device' if on_device else ''}) is off by {error:.3g}")
