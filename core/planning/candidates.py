"""The automatic precision's candidates and its choice among them.

A candidate is a placement of the target: its weights (unquantized, 4-bit nf4, nf4 with the output
head too) x its full KV (on the GPUs, partly on the GPU and the rest offloaded to pinned RAM, or
all offloaded; each in the compute dtype or in 8 bits) x the draft (on the GPU, or left out) x the prefill chunk x the embedding (on the GPU, or in
RAM). Each that fits is finished as a plan, its mode and speculation chosen as for any
layout (assemble.finish) in each mode the context allows (TriForce and chain/tree on a GPU past
twice the retrieval budget; the faster kept), and the plan is the one with the least predicted time
to a document's answers (cost.document_job_seconds), the most precise among equals, a coarser precision only where it
answers PRECISION_MARGIN sooner than every finer one.

LLM.int8 weights are a candidate only when asked for (Overrides.quantization): its one-token
decode measured slower than bf16's (13.1 against 9.5 ms of GPU time at 32K on an H100,
bench/2026-11-26-h100-campaign.json `quantized`).
"""

from __future__ import annotations

from dataclasses import replace

from ..hardware import HardwareProfile
from ..registry import ModelPair
from .assemble import RETRIEVAL_BUDGET, candidate_modes, finish, mode_reasons
from .cost import answer_seconds, document_job_seconds
from .dsi import DSI_MARGIN
from .memory import Layout, prefill_chunks, uses_draft
from .reasons import auto_weights_reason
from .types import Overrides, Plan

AUTO_TIERS = (("none", False), ("nf4", False), ("nf4", True))  # (quantization, output head too), most precise first
# (on the GPUs, in 8 bits, partly on the GPU): on chip, the layers that fit on chip and the rest
# streamed, all streamed; each in the compute dtype and in 8 bits.
KV_PLACES = ((True, False, False), (True, True, False), (False, False, True), (False, True, True),
             (False, False, False), (False, True, False))
# Quantizing changes the answers (the model a user chose is no longer the one that writes them),
# which no one trades for a few percent: a coarser placement must answer this much sooner.
PRECISION_MARGIN = 1.15
MODE_NAMES = {"triforce": "TriForce", "chain": "a chain", "tree": "a tree", "plain": "plain decoding"}


def candidate_layouts(profile: HardwareProfile, pair: ModelPair, context: int, budget: int,
                      overrides: Overrides) -> list[tuple[Layout, ...]]:
    """Every placement of the grid, fitting or not, most precise first (a GPU machine's): each as
    its layouts in the candidate modes (TriForce first)."""
    tiers = ((("int8", False),) if overrides.quantization == "int8" else
             tuple(tier for tier in AUTO_TIERS if overrides.quantization in (None, tier[0])))
    modes = candidate_modes(profile, context, budget, overrides)
    drafts = (True, False) if any(uses_draft(pair, mode) for mode in modes) else (True,)
    return [tuple(Layout(profile, pair, context, mode, budget, overrides, quantization, kv_on_chip, with_draft, chunk,
                         head_quantized, embedding_on_cpu, kv_int8, kv_partial) for mode in modes)
            for quantization, head_quantized in tiers
            for kv_on_chip, kv_int8, kv_partial in KV_PLACES
            for with_draft in drafts
            for chunk in prefill_chunks(profile, kv_on_chip)
            for embedding_on_cpu in (False, True)]


def candidates(profile: HardwareProfile, pair: ModelPair, context: int,
               overrides: Overrides | None = None) -> tuple[Plan, ...]:
    """Every placement of the grid that fits, finished as a plan in its faster mode, most precise
    first; none on a machine without a GPU (its one placement is the exact one) or past the pair's
    context."""
    overrides = overrides or Overrides()
    if not profile.gpus or context > pair.context_length:
        return ()
    budget = overrides.retrieval_budget or RETRIEVAL_BUDGET
    found = (finish_placement(layouts, auto_weights_reason(layouts[0]))
             for layouts in candidate_layouts(profile, pair, context, budget, overrides))
    return tuple(plan for plan in found if plan is not None)


def finish_placement(layouts: tuple[Layout, ...], weights_why: str) -> Plan | None:
    """One placement finished in each of its modes that fits, the faster kept (by the time to an
    answer; TriForce, the first, where not predicted), its mode's reason with both figures; None
    where none fits."""
    plans = [finish(layout, mode_reasons(layout.mode, layout.context, layout.retrieval[0] if layout.retrieval
                                         else RETRIEVAL_BUDGET, layout.overrides), weights_why)
             for layout in layouts if layout.fits]
    if not plans:
        return None
    times = [ranking_seconds(plan) for plan in plans]
    if None in times:
        return plans[0]
    best = min(range(len(plans)), key=times.__getitem__)
    chosen = plans[best]
    others = [plan for index, plan in enumerate(plans) if index != best]
    if chosen.mode == "dsi" or not others and len(layouts) == 1:
        return chosen
    head, _, rest = chosen.reasons["mode"].partition(": ")
    if others:
        other = others[0]
        versus = (f"predicted {chosen.predicted_tokens_per_second:.1f} tok/s against "
                  f"{other.predicted_tokens_per_second:.1f} for {MODE_NAMES.get(other.mode, other.mode)} with these "
                  f"weights")
    else:
        missing = [layout.mode for layout in layouts if not layout.fits]
        versus = ("TriForce's retrieval cache does not fit beside these weights and KV" if "triforce" in missing else
                  f"{' or '.join(missing)} does not fit beside these weights and KV")
    return replace(chosen, reasons={**chosen.reasons, "mode": f"{head}: {versus}; {rest}"})


def time_to_answer(plan: Plan) -> float | None:
    """Seconds to read a prompt filling the plan's context less a typical answer, then write it."""
    return answer_seconds(plan.predicted_prefill_seconds, plan.predicted_tokens_per_second, plan.context)


def ranking_seconds(plan: Plan) -> float | None:
    """What candidates are compared by: a document read and its answers (cost.document_job_seconds);
    a DSI plan's decode counts DSI_MARGIN slower, the margin its cost model leaves for what its
    instances add (dsi.py)."""
    speed = plan.predicted_tokens_per_second
    if plan.mode == "dsi" and speed:
        speed /= DSI_MARGIN
    return document_job_seconds(plan.predicted_prefill_seconds, speed, plan.context)


def coarseness(plan: Plan) -> tuple[int, int, int]:
    """How far a plan's storage is from the model's own: (weights: unquantized 0, 8-bit 1, 4-bit 2;
    the output head quantized too; an 8-bit KV). One plan is coarser than another where it is in
    every part and differs; comparing the tuples (weights first) orders every level."""
    quantized = plan.weights in ("int8", "nf4")
    return ({"int8": 1, "nf4": 2}.get(plan.weights, 0), int(quantized and plan.head_weights == plan.weights),
            int(plan.kv_dtype == "int8"))


def fastest(found: tuple[Plan, ...]) -> tuple[Plan, Plan | None] | None:
    """(the plan, the fastest plan passed over for it or None). The plan: the fastest of the finest
    level that fits, replaced by a coarser level's fastest only where that answers PRECISION_MARGIN
    sooner (`ranking_seconds`), level by level from the finest; the first (most precise) among
    equals. None when there is none or one is not predicted (bandwidths not measured)."""
    times = {id(plan): ranking_seconds(plan) for plan in found}
    if not found or None in times.values():
        return None
    chosen = None
    for level in sorted({coarseness(plan) for plan in found}):
        best = min((plan for plan in found if coarseness(plan) == level), key=lambda plan: times[id(plan)])
        if chosen is None or times[id(best)] * PRECISION_MARGIN <= times[id(chosen)]:
            chosen = best
    faster = [plan for plan in found if times[id(plan)] < times[id(chosen)]]  # all coarser
    return chosen, min(faster, key=lambda plan: times[id(plan)], default=None)
