"""A few tokens (a verification: 2-64 rows) through a 4-bit NF4 linear layer in one Triton kernel,
the weight dequantized in registers: the packed weight is read once, at half a byte an element
plus its block's scale.

Why: bitsandbytes runs a one-token forward through its fused 4-bit kernel, but several tokens
through a dequantize-then-matmul path that writes and reads a bf16 copy of every weight: on an
H100 a 16-token verification took 2.2x a one-token step over nf4 weights (1.3x over bf16), so
speculation paid little on a 4-bit target (campaign `quantized`).

The layout is bitsandbytes' (0.45-0.50, no nested statistics): the weight [out, in] flattened row
by row, two codes a byte (the even element in the high nibble), one float32 absmax per 64
consecutive elements, a code's value `code_table[code] x absmax`. The kernel looks a byte's two
values up at once, in a 256-entry table of pairs (`code_pairs`). As bitsandbytes does before its
matmul, each value is rounded to the compute dtype, then multiplied and summed in float32: the
same weights as the model loaded, summed in another order. The inner dimension is split among
programs when the output alone would leave the GPU idle; the partial sums are added here, in a
fixed order (no atomics: the same inputs give the same bits).

On the CPU the kernel runs in Triton's interpreter: the tests' rehearsal, never a production path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64  # elements per absmax, and the inner dimension one iteration covers
BLOCK_OUT = 64  # output columns per program
# Blocks of 64 inner elements an iteration reads (per column, 32 bytes each): two keep more bytes in
# flight than one (a design guess until a GPU times both: benchmarks/gpu/weights.py `kernel_rows`);
# four would need up to 108 KB of shared memory (64 rows), over an RTX 30/40 card's 99 KB a block
# (tests/test_triton_compile.py).
BLOCKS_PER_STEP = 2
PROGRAMS_PER_CPU_RUN = 8  # the interpreter's share of splits: enough to exercise the sum


@triton.jit(do_not_specialize=["rows"])  # a verification's size changes every step: one compile for all
def _nf4_matmul(x, packed, absmax, code_pairs, partial, rows, inner, outputs, blocks_per_split,
                x_row_stride, BLOCK_M: tl.constexpr, BLOCK_OUT: tl.constexpr, HALF: tl.constexpr,
                STEP: tl.constexpr, IEEE: tl.constexpr):
    """Program (output block, split): partial[split, rows, outputs block] = x[:, split's inner
    range] @ W[outputs block, split's inner range]^T, in float32, STEP blocks an iteration (the
    split's blocks a multiple of STEP)."""
    out_block, split = tl.program_id(0), tl.program_id(1)
    row_ids = tl.arange(0, BLOCK_M)
    columns = out_block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    step_bytes = tl.arange(0, STEP * HALF)  # byte j from a step's start holds elements 2j (high nibble) and 2j + 1
    row_held, column_held = row_ids < rows, columns < outputs
    blocks = inner // (2 * HALF)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, blocks)
    total = tl.zeros([BLOCK_M, BLOCK_OUT], tl.float32)
    for block in range(first, last, STEP):
        start = block * 2 * HALF
        # The rows' elements read contiguously (vector loads), then split into even and odd ones.
        x_run = tl.load(x + row_ids[:, None] * x_row_stride + start + tl.arange(0, 2 * STEP * HALF)[None, :],
                        mask=row_held[:, None], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x_run, [BLOCK_M, STEP * HALF, 2]))
        # Element (column, start + 2j) of the flattened weight is in byte column x inner / 2 + start / 2 + j
        # (the offsets written so that the compiler sees each column's bytes aligned: vector loads).
        bytes_at = columns[:, None].to(tl.int64) * (inner // 2) + block * HALF + step_bytes[None, :]  # past 2^31 too
        codes = tl.load(packed + bytes_at, mask=column_held[:, None], other=0).to(tl.int32)
        # Both values of a byte in one gather: its pair's low word is the high nibble's value, bit for bit.
        pair = tl.load(code_pairs + codes)
        high = (pair & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        low = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        scale = tl.load(absmax + columns[:, None] * blocks + block + tl.arange(0, STEP)[None, :],  # each block's
                        mask=column_held[:, None], other=0.0)[:, :, None]
        high = tl.reshape(tl.reshape(high, [BLOCK_OUT, STEP, HALF]) * scale, [BLOCK_OUT, STEP * HALF]).to(x_even.dtype)
        low = tl.reshape(tl.reshape(low, [BLOCK_OUT, STEP, HALF]) * scale, [BLOCK_OUT, STEP * HALF]).to(x_even.dtype)
        if IEEE:  # float32 activations: no TF32 rounding
            total += tl.dot(x_even, tl.trans(high), input_precision="ieee")
            total += tl.dot(x_odd, tl.trans(low), input_precision="ieee")
        else:
            total += tl.dot(x_even, tl.trans(high)) + tl.dot(x_odd, tl.trans(low))
    tl.store(partial + (split * rows + row_ids[:, None]) * outputs + columns[None, :], total,
             mask=row_held[:, None] & column_held[None, :])


def code_pairs(code_table: torch.Tensor) -> torch.Tensor:
    """The 256 bytes' value pairs for a 16-entry float32 code table, as int64 [256]: byte b's low
    word holds the bits of code_table[b >> 4] (its high nibble, the even element), its high word
    those of code_table[b & 15]."""
    bits = code_table.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    byte = torch.arange(256, device=code_table.device)
    return bits[byte >> 4] | (bits[byte & 15] << 32)


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, pairs: torch.Tensor,
               outputs: int, bias: torch.Tensor | None = None, blocks_per_step: int = BLOCKS_PER_STEP) -> torch.Tensor:
    """x [rows, inner] (rows <= 64, inner a multiple of 64, rows contiguous) @ W^T (+ bias) for the
    NF4 weight W [outputs, inner] stored as `packed` (uint8, outputs x inner / 2), `absmax`
    (float32, one per 64 elements) and the code table's `pairs` (`code_pairs`). Returns [rows,
    outputs] in x's dtype, rounded once (the bias added to the float32 sums, as a matmul's epilogue
    does)."""
    rows, inner = x.shape
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    out_blocks, blocks = triton.cdiv(outputs, BLOCK_OUT), inner // BLOCK
    wanted = (4 * torch.cuda.get_device_properties(x.device).multi_processor_count
              if x.is_cuda else PROGRAMS_PER_CPU_RUN)
    # float32 tiles take twice the shared memory: one block a step keeps them within a card's limit
    step = blocks_per_step if blocks % blocks_per_step == 0 and x.dtype != torch.float32 else 1
    splits = max(1, min(blocks // step, wanted // out_blocks))
    blocks_per_split = triton.cdiv(blocks // step, splits) * step
    splits = triton.cdiv(blocks, blocks_per_split)  # none left empty
    partial = torch.empty(splits, rows, outputs, dtype=torch.float32, device=x.device)
    _nf4_matmul[(out_blocks, splits)](x, packed, absmax, pairs, partial, rows, inner, outputs,
                                      blocks_per_split, x.stride(0), BLOCK_M=block_m, BLOCK_OUT=BLOCK_OUT,
                                      HALF=BLOCK // 2, STEP=step, IEEE=x.dtype == torch.float32)
    total = partial[0] if splits == 1 else partial.sum(0)
    return (total if bias is None else total + bias.to(x.dtype).float()).to(x.dtype)


def self_check(device: torch.device, dtype: torch.dtype) -> None:
    """Run the kernel on `device` for 5, 24 and 48 rows (its 16-, 32- and 64-row blocks) at a small
    shape (160 outputs, inner 256: several splits and a partial output block) against torch's
    product with the same dequantized weight, within the rounding of `dtype`. Raises where it
    builds but computes wrongly here (a compiler or driver fault on a GPU no test ran on), so that
    its route falls back before the first answer; compiles each variant now, not in mid-answer."""
    generator = torch.Generator().manual_seed(0)
    outputs, inner = 160, 256
    packed = torch.randint(0, 256, (outputs * inner // 2,), generator=generator, dtype=torch.uint8).to(device)
    absmax = torch.rand(outputs * inner // BLOCK, generator=generator).to(device) + 0.5
    code_table = torch.linspace(-1.0, 1.0, 16).to(device)
    high, low = code_table[packed.long() >> 4], code_table[packed.long() & 15]
    weight = (torch.stack([high, low], -1).reshape(-1, BLOCK) * absmax[:, None]).reshape(outputs, inner).to(dtype)
    for rows in (5, 24, 48):
        x = torch.randn(rows, inner, generator=generator).to(device, dtype)
        expected = x.float() @ weight.float().T
        error = (nf4_matmul(x, packed, absmax, code_pairs(code_table), outputs).float() - expected).abs().max().item()
        if not error <= 0.02 * expected.abs().max().item():
            raise RuntimeError(f"self-check: the 4-bit matmul kernel ({rows} rows) is off by {error:.3g}")
