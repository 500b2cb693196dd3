"""Will a pair fit this machine? A stated estimate from the registry's shapes, until the planner
(which also places caches and picks quantization) replaces it.

The estimate: both models' weights in bf16 (or 4-bit, at 4.5 bits per parameter with the
quantization scales), a 4K-token retrieval cache and a 1K-token draft cache on the GPU, and 1.5 GB
for the CUDA context and activations; the full KV cache of the pair's context in CPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from .files import human_size
from .registry import ModelPair

GPU_OVERHEAD_BYTES = int(1.5e9)
RETRIEVAL_TOKENS = 4096
DRAFT_CACHE_TOKENS = 1024
FOUR_BIT = 4.5  # bits per parameter, scales included
RAM_SHARE = 0.8  # of the machine's RAM, the most the offloaded KV may take
MIN_CONTEXT = 8192


@dataclass(frozen=True)
class Machine:
    gpu_bytes: int  # the largest CUDA GPU's memory; 0 without one
    ram_bytes: int


@dataclass(frozen=True)
class Fit:
    fits: bool
    verdict: str  # a few words for a table
    reason: str  # one sentence with the figures


def this_machine() -> Machine:
    import psutil
    import torch

    gpu = max((torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())),
              default=0) if torch.cuda.is_available() else 0
    return Machine(gpu, psutil.virtual_memory().total)


def gpu_bytes_needed(pair: ModelPair, bits: int | None = None) -> int:
    weights = sum(model.weight_bytes(FOUR_BIT if bits == 4 else None) for model in pair.models)
    caches = pair.target.kv_bytes_per_token() * RETRIEVAL_TOKENS
    if pair.draft is not None:
        caches += pair.draft.kv_bytes_per_token() * DRAFT_CACHE_TOKENS
    return weights + caches + GPU_OVERHEAD_BYTES


def estimate_fit(pair: ModelPair, machine: Machine) -> Fit:
    if pair.source == "embedded":
        return Fit(True, "fits (CPU)", "the built-in model runs on the CPU in about 1 GB of memory")
    per_token = pair.target.kv_bytes_per_token()
    context = min(pair.context_length, int(RAM_SHARE * machine.ram_bytes // per_token) // 1024 * 1024)
    full_kv = per_token * context
    if context < min(MIN_CONTEXT, pair.context_length):
        return Fit(False, "too big (RAM)", f"even a {MIN_CONTEXT:,}-token KV cache needs more than "
                                           f"{RAM_SHARE:.0%} of this machine's {human_size(machine.ram_bytes)} of RAM")
    shorter = f" up to {context // 1024}K tokens" if context < pair.context_length else ""
    if machine.gpu_bytes == 0:
        return Fit(False, "no GPU", f"needs a CUDA GPU with about {human_size(gpu_bytes_needed(pair, 4))} "
                                    "(4-bit weights); this machine has none")
    for bits, label in ((None, "fits (bf16)"), (4, "fits (4-bit)")):
        needed = gpu_bytes_needed(pair, bits)
        if needed <= machine.gpu_bytes:
            return Fit(True, label + shorter, f"about {human_size(needed)} of {human_size(machine.gpu_bytes)} GPU memory, "
                                              f"{human_size(full_kv)} of KV for {context:,} tokens in CPU memory")
    return Fit(False, "too big (GPU)", f"needs about {human_size(gpu_bytes_needed(pair, 4))} of GPU memory even with "
                                       f"4-bit weights; the GPU has {human_size(machine.gpu_bytes)}")
