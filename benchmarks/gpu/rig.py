"""What every section of the GPU campaign runs on: the device, the shapes, the contexts and the time
left. A GPU run uses Llama-3.1-8B's shape at 1K-128K positions where the card holds it (Llama-3.2-3B's
below about 22 GB), and only the contexts that fit its memory and the host's (the others are named
with the reason); the dry run, the same code on the CPU with a toy Llama at 1-2K positions, so a
first real GPU cannot break the campaign."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .shapes import LLAMA_31_8B, LLAMA_32_1B, LLAMA_32_3B, TOY_DRAFT, TOY_TARGET, kv_bytes_per_token, weight_bytes

GPU_CONTEXTS = (1024, 32768, 131072)
QUANTIZED_CONTEXTS = (1024, 32768)
OFFLOADED_CONTEXTS = (32768, 131072)
GPU_SHARE = 0.95  # of the card's free memory a run may plan to use: the allocator's slack
KV_GROWTH = 1.25  # the engine's cache grows by a quarter (kv/full.py)
PREFILL_SLACK = 2**30  # a prefill chunk's temporaries and the logits, with room
PINNED_ROUNDING = 2  # pinned blocks are rounded up to powers of two: up to twice the KV in host memory


@dataclass(frozen=True)
class Rig:
    dry_run: bool
    device: str
    dtype: torch.dtype
    shape_name: str
    shape: dict  # the target's LlamaConfig fields
    draft_shape: dict  # TriForce's draft (over a StreamingLLM cache)
    contexts: tuple[int, ...]  # KV on the device: where steps and verifications are timed
    quantized_contexts: tuple[int, ...]  # the same, for each weight kind (fewer: four models to time)
    offloaded_contexts: tuple[int, ...]  # KV in host memory, streamed per layer
    sizes: tuple[int, ...]  # tokens per forward: a decode step (1) up to a verification
    prefill_chunk: int  # the plan's chunk with the KV on the device
    offloaded_prefill_chunk: int  # the plan's largest chunk with the KV offloaded
    retrieval_budget: int
    draft_window: int
    repeats: int
    left_out: tuple[str, ...]  # contexts this machine cannot hold, and why
    deadline: float  # time.monotonic() past which no section starts
    repo_root: Path

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


def gpu_rig(budget_s: float, repo_root: Path) -> Rig:
    import psutil

    gpu_bytes = torch.cuda.mem_get_info()[0]  # free: a desktop may hold part of the card
    shape_name, shape = "Llama-3.1-8B shape", LLAMA_31_8B
    contexts, left_out = fitting_contexts(shape, GPU_CONTEXTS, gpu_bytes)
    if not contexts:  # the 8B shape does not fit even with a short context: a 3B one does the timing
        shape_name, shape = "Llama-3.2-3B shape", LLAMA_32_3B
        contexts, left_out = fitting_contexts(shape, GPU_CONTEXTS, gpu_bytes)
    offloaded, host_left_out = hosted_contexts(shape, OFFLOADED_CONTEXTS, psutil.virtual_memory().available)
    return Rig(dry_run=False, device="cuda", dtype=torch.bfloat16, shape_name=shape_name, shape=shape,
               draft_shape=LLAMA_32_1B, contexts=contexts,
               quantized_contexts=tuple(context for context in QUANTIZED_CONTEXTS if context in contexts),
               offloaded_contexts=offloaded, sizes=(1, 2, 4, 8, 16), prefill_chunk=2048,
               offloaded_prefill_chunk=8192, retrieval_budget=4096, draft_window=1020, repeats=5,
               left_out=left_out + host_left_out, deadline=time.monotonic() + budget_s, repo_root=repo_root)


def fitting_contexts(shape: dict, contexts: tuple[int, ...], gpu_bytes: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The contexts whose bf16 weights, grown KV and prefill temporaries fit the card."""
    kept, left_out = [], []
    for context in contexts:
        need = weight_bytes(shape) + KV_GROWTH * context * kv_bytes_per_token(shape) + PREFILL_SLACK
        if need <= GPU_SHARE * gpu_bytes:
            kept.append(context)
        else:
            left_out.append(f"{context:,} positions on the GPU: need about {need / 1e9:.0f} GB, the card has "
                            f"{gpu_bytes / 1e9:.0f} GB free")
    return tuple(kept), tuple(left_out)


def hosted_contexts(shape: dict, contexts: tuple[int, ...], ram_bytes: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The offloaded contexts whose pinned KV fits the host's available memory."""
    kept, left_out = [], []
    for context in contexts:
        need = PINNED_ROUNDING * context * kv_bytes_per_token(shape)
        if need <= ram_bytes:
            kept.append(context)
        else:
            left_out.append(f"{context:,} positions offloaded: up to {need / 1e9:.0f} GB pinned, "
                            f"{ram_bytes / 1e9:.0f} GB available")
    return tuple(kept), tuple(left_out)


def dry_rig(budget_s: float, repo_root: Path) -> Rig:
    return Rig(dry_run=True, device="cpu", dtype=torch.float32, shape_name="toy Llama", shape=TOY_TARGET,
               draft_shape=TOY_DRAFT, contexts=(256, 1024, 2048), quantized_contexts=(256, 1024), offloaded_contexts=(1024, 2048),
               sizes=(1, 2, 4, 8, 16), prefill_chunk=512, offloaded_prefill_chunk=1024, retrieval_budget=256,
               draft_window=124, repeats=2, left_out=(), deadline=time.monotonic() + budget_s, repo_root=repo_root)


def goal(name: str, value: float | None, target: str, where: str) -> dict:
    """One of the issue's figures against its goal ('<= 1.2', '>= 0.75'; both bounds: '0.75..1.25')."""
    if value is None:
        return {"name": name, "value": None, "goal": target, "met": None, "where": where}
    if ".." in target:
        low, high = (float(part) for part in target.split(".."))
        met = low <= value <= high
    else:
        sign, bound = target.split()
        met = value <= float(bound) if sign == "<=" else value >= float(bound)
    return {"name": name, "value": round(value, 4), "goal": target, "met": met, "where": where}
