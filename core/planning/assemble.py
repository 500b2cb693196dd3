"""From a fitting layout to a Plan: the mode, the speculation that pays on it (speculation.py, or
DSI over several GPUs, dsi.py), its predicted figures (cost.py) and a reason for each choice."""

from __future__ import annotations

from ..hardware import HardwareProfile
from .cost import predictions
from .dsi import choose_dsi, dsi_plan
from .memory import DRAFT_SINKS, Layout
from .reasons import draft_cache_reason, kv_attention_reason, kv_reason, placement_reason, prefill_reason
from .speculation import choose_speculation
from .types import Overrides, Plan

RETRIEVAL_BUDGET = 4096  # TriForce's budget for 128K contexts (algorithms.md section 5)
LONG_CONTEXT_FACTOR = 2  # TriForce pays once the context is this many retrieval budgets long


def candidate_modes(profile: HardwareProfile, context: int, budget: int, overrides: Overrides) -> tuple[str, ...]:
    """The modes a placement is finished in, TriForce first: the one asked for; else, on a GPU with
    a context over LONG_CONTEXT_FACTOR retrieval budgets, TriForce and "speculate" (chain or tree,
    settled once the weights are known), the faster to be kept (candidates.finish_placement);
    else "speculate"."""
    if overrides.mode:
        return (overrides.mode,)
    if profile.gpus and context > LONG_CONTEXT_FACTOR * budget:
        return ("triforce", "speculate")
    return ("speculate",)


def mode_reasons(mode: str, context: int, budget: int, overrides: Overrides) -> dict:
    """The mode's reason where it is known before speculation is chosen (speculation.py writes a
    chain's or a tree's)."""
    if overrides.mode:
        return {"mode": f"{overrides.mode}: as requested"}
    if mode == "triforce":
        return {"mode": f"triforce: {context:,} tokens are over {LONG_CONTEXT_FACTOR}x the {budget:,}-token retrieval "
                        f"budget, so drafting against a retrieval cache reads a fraction of the full KV"}
    return {}


def finish(layout: Layout, reasons: dict, weights_why: str) -> Plan:
    """The plan on `layout`; `reasons` holds the mode's, `weights_why` says why these weights."""
    pair, context = layout.pair, layout.context
    reasons["weights"] = weights_why
    reasons["placement"] = placement_reason(layout)
    reasons["kv"] = kv_reason(layout)
    mode, gamma1, gamma2, tree, verify, seconds = choose_speculation(layout, reasons)
    dsi = choose_dsi(layout, mode, seconds, reasons)
    if dsi is not None:
        return dsi_plan(layout, dsi, tree, reasons)
    if layout.retrieval is not None:
        budget, chunk = layout.retrieval
        reasons["retrieval"] = (f"{budget:,}-token retrieval cache in {chunk}-token chunks: TriForce's budget; "
                                + ("8-token chunks retrieve more precisely and their keys are cheap next to the "
                                   "on-chip KV" if layout.kv_on_chip else "16-token chunks halve the mean keys "
                                   "kept on the GPU, its only copy of K"))
    if layout.draft is not None:
        reasons["draft_cache"] = draft_cache_reason(layout)
    reasons["prefill_chunk"] = prefill_reason(layout)
    kv_attention_reason(layout, reasons)
    return Plan(
        pair_id=pair.id, context=context, mode=mode, weights=layout.weights_label(),
        target_devices=layout.target_devices, target_layers=layout.target_layers,
        draft_device=layout.draft_device(), draft_weights=layout.draft_dtype(),
        kv_device=layout.kv_device(),
        retrieval_budget=layout.retrieval[0] if layout.retrieval else None,
        retrieval_chunk=layout.retrieval[1] if layout.retrieval else None,
        draft_sinks=DRAFT_SINKS if layout.draft is not None else None,
        draft_window=layout.draft_window if layout.draft is not None else None,
        gamma1=gamma1, gamma2=gamma2, tree_size=tree[0], tree_depth=tree[1],
        prefill_chunk=layout.prefill_chunk, memory=tuple(layout.items), devices=layout.devices, reasons=reasons,
        triforce_verify=verify, head_weights=layout.head_label(),
        embedding_device=layout.embedding_device(), kv_dtype=layout.kv_dtype,
        kv_resident_layers=layout.kv_resident_layers, precision=layout.overrides.precision, **predictions(layout, seconds))
