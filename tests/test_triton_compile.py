"""The Triton kernels compile for the GPUs they run on, on this machine without one: Triton's
compiler and the ptxas its wheel ships build each kernel (8-bit attention with and without the
new tokens' mask, its merge, 8-bit packing, 4-bit matmul) for compute capability 8.6 (RTX 30),
8.9 (RTX 40) and 9.0 (H100), in the dtypes and with the tiles and launch options the code uses.
Every build's shared memory fits that card's limit for a block, and no thread spills more than a
few hundred bytes of registers (cuobjdump's stack figure). No kernel but the mask's reads loads
its inputs a byte or two at a time (what the 8-bit attention's strides in words, the 4-bit
kernel's contiguous reads of x and its byte offsets are for). The builds run in a subprocess:
this one runs Triton's interpreter (conftest.py), which cannot compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

# The most shared memory a block may use (bytes, opted in as Triton's launcher does), per target.
SHARED_LIMIT = {86: 101376, 89: 101376, 90: 232448}
# A thread's stack, in bytes: a few hundred spilled bytes cost little; kilobytes (float32's dot
# products at 64 rows spilled 11 KB) slow the kernel and make the driver reserve local memory for
# every thread the GPU can hold (11 KB x 2,048 threads x 82 SMs: 1.8 GB on an RTX 3090).
MAX_STACK = 256

BUILDS = r'''
import json, os, re, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specchat.core.kv import int8_kernel
from specchat.core import nf4_kernel

TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def stack_bytes(cubin):
    """Per-thread stack of a build (registers spilled, mostly), from cuobjdump's resource usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", file.name], capture_output=True, text=True).stdout
    return max(int(found) for found in re.findall(r"STACK:(\d+)", usage))

def int8_build(dtype, rows, on_device, mask):
    types = {"queries": f"*{dtype}", "key_codes": "*i8", "key_scales": "*fp32", "value_codes": "*i8",
             "value_scales": "*fp32", "out": "*fp32", "lse": "*fp32", "past_at": "*i32" if on_device else "*fp32",
             "allowed": "*u8" if mask else "*fp32", "scale_log2": "fp32"}
    block_m, block_n, warps = int8_kernel.tiles(rows, TORCH[dtype])
    constants = {"BLOCK_M": block_m, "BLOCK_D": 128, "BLOCK_N": block_n, "IEEE": dtype == "fp32",
                 "PAST_ON_DEVICE": on_device, "MASK_NEW": mask}
    return int8_kernel._attend_packed, types, constants, {"num_stages": int8_kernel.STAGES, "num_warps": warps}

def nf4_build(dtype, block_m, on_device, mask):
    types = {"x": f"*{dtype}", "packed": "*u8", "absmax": "*fp32", "code_pairs": "*i64", "partial": "*fp32"}
    constants = {"BLOCK_M": block_m, "BLOCK_OUT": nf4_kernel.BLOCK_OUT, "HALF": nf4_kernel.BLOCK // 2,
                 # float32 runs one block a step (nf4_matmul); half precision both steps the campaign times
                 "STEP": 1 if dtype == "fp32" or on_device else nf4_kernel.BLOCKS_PER_STEP, "IEEE": dtype == "fp32"}
    return nf4_kernel._nf4_matmul, types, constants, {}

def pack_build(dtype, block_m, on_device, mask):  # block_m: no such block; the tokens a program packs are fixed
    types = {"states": f"*{dtype}", "rows_out": "*i8", "slots": "*i64" if on_device else "*i8"}
    constants = {"BLOCK_T": int8_kernel.TOKENS_PER_PACK, "BLOCK_D": 128, "SLOTS_ON_DEVICE": on_device}
    return int8_kernel._pack_rows, types, constants, {}

def merge_build(dtype, block_m, on_device, mask):  # float32 parts whatever the queries' dtype
    types = {"out": "*fp32", "lse": "*fp32", "merged": "*fp32", "merged_lse": "*fp32"}
    return int8_kernel._merge_splits, types, {"BLOCK_S": int8_kernel.SPLITS_PER_STEP, "BLOCK_D": 128}, {}

ALIGNED_INTEGERS = {"head_dim", "query_head_stride", "query_row_stride", "inner", "outputs", "x_row_stride",
                    "state_head_stride", "state_token_stride"}
KERNELS = (("int8 attention", int8_build), ("nf4 matmul", nf4_build), ("int8 packing", pack_build),
           ("int8 merge", merge_build))
results = []
for name, build in KERNELS:
    for arch, dtype, block_m, on_device, mask in json.loads(sys.argv[1]):
        kernel, types, constants, options = build(dtype, block_m, on_device, mask)
        signature = {arg: "constexpr" if arg in constants else types.get(arg, "i32") for arg in kernel.arg_names}
        # As launched: PyTorch's tensors 16-byte aligned, and the integers that are multiples of 16 at
        # Llama-3.1-8B's shapes (head size, inner and output sizes) specialized as such.
        aligned = [index for index, arg in enumerate(kernel.arg_names)
                   if signature[arg].startswith("*") or arg in ALIGNED_INTEGERS]
        attrs = {(index,): [["tt.divisibility", 16]] for index in aligned}
        try:
            source = ASTSource(kernel, signature, constants, attrs)
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
            results.append({"kernel": name, "arch": arch, "dtype": dtype, "block_m": block_m, "mask": mask,
                            "shared": compiled.metadata.shared, "stack": stack_bytes(compiled.asm["cubin"]),
                            "narrow_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.[bsu](?:8|16)\b", compiled.asm["ptx"]))})
        except Exception as error:
            results.append({"kernel": name, "arch": arch, "dtype": dtype, "block_m": block_m,
                            "error": f"{type(error).__name__}: {str(error)[:500]}"})
print(json.dumps(results))
'''


@pytest.mark.slow
def test_the_kernels_compile_for_rtx_30_to_h100_within_their_shared_memory_and_registers():
    # Half precision on every card, the smallest and the largest row block, the length on the host
    # and on the device (a CUDA graph's); float32 where the GPU campaign's exact runs go
    # (data-center cards) and on an RTX 30; the 8-bit attention with the new tokens' mask (a
    # verification's, a graph's step) and without (one token's step).
    builds = [(86, "fp16", 64, False, True), (86, "bf16", 16, False, False), (86, "bf16", 16, True, True),
              (86, "bf16", 32, False, True), (86, "bf16", 64, False, True), (86, "fp32", 64, False, True),
              (89, "bf16", 64, False, False), (90, "bf16", 64, True, True), (90, "fp32", 64, True, True)]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    completed = subprocess.run([sys.executable, "-c", BUILDS, json.dumps(builds)],
                               capture_output=True, text=True, env=env, timeout=600,
                               cwd=Path(__file__).parent)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    assert len(results) == 4 * len(builds)
    failed = [result for result in results if "error" in result or result["shared"] > SHARED_LIMIT[result["arch"]]
              or result["stack"] > MAX_STACK]
    assert not failed, failed
    # the mask's bytes are the only ones read narrowly, in the blocks of new tokens alone
    assert not [result for result in results if result["narrow_loads"]
                and not (result["kernel"] == "int8 attention" and result["mask"])], results
