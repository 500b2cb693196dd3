"""The automatic precision's candidates and its choice among them.

A candidate is a placement of the target: its weights (unquantized, 4-bit nf4, nf4 with the output
head too) x its full KV (on the GPUs in the compute dtype, on the GPUs in 8 bits, or offloaded to
pinned RAM) x the draft (on the GPU, or left out) x the prefill chunk x the embedding (on the GPU,
or in RAM). Each that fits is finished as a plan, its mode and speculation chosen as for any
layout (assemble.finish), and the plan is the one with the least predicted time to an answer
(cost.answer_seconds), the most precise among equals.

LLM.int8 weights are a candidate only when asked for (Overrides.quantization): its one-token
decode measured slower than bf16's (13.1 against 9.5 ms of GPU time at 32K on an H100,
bench/2026-11-26-h100-campaign.json `quantized`).
"""

from __future__ import annotations

from ..hardware import HardwareProfile
from ..registry import ModelPair
from .assemble import RETRIEVAL_BUDGET, choose_mode, finish
from .cost import answer_seconds
from .dsi import DSI_MARGIN
from .memory import Layout, prefill_chunks, uses_draft
from .reasons import auto_weights_reason
from .types import Overrides, Plan

AUTO_TIERS = (("none", False), ("nf4", False), ("nf4", True))  # (quantization, output head too), most precise first
KV_PLACES = ((True, False), (True, True), (False, False))  # (on the GPUs, in 8 bits), most precise first


def candidate_layouts(profile: HardwareProfile, pair: ModelPair, context: int, mode: str, budget: int,
                      overrides: Overrides) -> list[Layout]:
    """Every placement of the grid, fitting or not, most precise first (a GPU machine's)."""
    tiers = ((("int8", False),) if overrides.quantization == "int8" else
             tuple(tier for tier in AUTO_TIERS if overrides.quantization in (None, tier[0])))
    return [Layout(profile, pair, context, mode, budget, overrides, quantization, kv_on_chip, with_draft, chunk,
                   head_quantized, embedding_on_cpu, kv_int8)
            for quantization, head_quantized in tiers
            for kv_on_chip, kv_int8 in KV_PLACES
            for with_draft in ((True, False) if uses_draft(pair, mode) else (True,))
            for chunk in prefill_chunks(profile, kv_on_chip)
            for embedding_on_cpu in (False, True)]


def candidates(profile: HardwareProfile, pair: ModelPair, context: int,
               overrides: Overrides | None = None) -> tuple[Plan, ...]:
    """Every placement of the grid that fits, finished as a plan, most precise first; none on a
    machine without a GPU (its one placement is the exact one) or past the pair's context."""
    overrides = overrides or Overrides()
    if not profile.gpus or context > pair.context_length:
        return ()
    reasons: dict[str, str] = {}
    budget = overrides.retrieval_budget or RETRIEVAL_BUDGET
    mode = choose_mode(profile, context, budget, overrides, reasons)
    return tuple(finish(layout, dict(reasons), auto_weights_reason(layout))
                 for layout in candidate_layouts(profile, pair, context, mode, budget, overrides) if layout.fits)


def time_to_answer(plan: Plan) -> float | None:
    """Seconds to read a prompt filling the plan's context less a typical answer, then write it."""
    return answer_seconds(plan.predicted_prefill_seconds, plan.predicted_tokens_per_second, plan.context)


def ranking_seconds(plan: Plan) -> float | None:
    """The time to an answer that candidates are compared by: a DSI plan's decode counts
    DSI_MARGIN slower, the margin its cost model leaves for what its instances add (dsi.py)."""
    if plan.mode != "dsi" or not plan.predicted_tokens_per_second:
        return time_to_answer(plan)
    return answer_seconds(plan.predicted_prefill_seconds, plan.predicted_tokens_per_second / DSI_MARGIN, plan.context)


def fastest(found: tuple[Plan, ...]) -> Plan | None:
    """The plan of `found` with the least time to an answer (`ranking_seconds`), the first (most
    precise) among equals; None when there is none or one is not predicted (bandwidths not measured)."""
    times = [ranking_seconds(plan) for plan in found]
    if not found or None in times:
        return None
    return found[min(range(len(found)), key=times.__getitem__)]
