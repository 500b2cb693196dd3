"""What every section of the GPU campaign runs on: the device, the shapes, the contexts and the time
left. A GPU run uses Llama-3.1-8B's shape at 1K-128K positions; the dry run, the same code on the
CPU with a toy Llama at 1-2K positions, so a first real GPU cannot break the campaign."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .shapes import LLAMA_31_8B, LLAMA_32_1B, TOY_DRAFT, TOY_TARGET


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
    deadline: float  # time.monotonic() past which no section starts
    repo_root: Path

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


def gpu_rig(budget_s: float, repo_root: Path) -> Rig:
    return Rig(dry_run=False, device="cuda", dtype=torch.bfloat16, shape_name="Llama-3.1-8B shape",
               shape=LLAMA_31_8B, draft_shape=LLAMA_32_1B, contexts=(1024, 32768, 131072),
               quantized_contexts=(1024, 32768),
               offloaded_contexts=(32768, 131072), sizes=(1, 2, 4, 8, 16), prefill_chunk=2048,
               offloaded_prefill_chunk=8192, retrieval_budget=4096, draft_window=1020, repeats=5,
               deadline=time.monotonic() + budget_s, repo_root=repo_root)


def dry_rig(budget_s: float, repo_root: Path) -> Rig:
    return Rig(dry_run=True, device="cpu", dtype=torch.float32, shape_name="toy Llama", shape=TOY_TARGET,
               draft_shape=TOY_DRAFT, contexts=(256, 1024, 2048), quantized_contexts=(256, 1024), offloaded_contexts=(1024, 2048),
               sizes=(1, 2, 4, 8, 16), prefill_chunk=512, offloaded_prefill_chunk=1024, retrieval_budget=256,
               draft_window=124, repeats=2, deadline=time.monotonic() + budget_s, repo_root=repo_root)


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
