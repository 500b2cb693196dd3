"""The engine's configuration: what a plan decides, frozen, made by one pure function.

The engine is built from an `EngineSettings` and never changed afterwards; what varies per
answer (mode, sampling, a TriForce variant, a draft tree) is an argument of `Engine.generate`.
Where the KV and the embedding live (plan.kv_device, plan.embedding_device) and how the weights
load reach the model through placement.py's load options instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .decoding import TriforceSettings
from .planning import PREFILL_CHUNK_CPU, RETRIEVAL_SIBLING_ACCEPTANCE, Plan
from .speculative.lookahead import MAX_DRAFT
from .speculative.step_times import StepTimes
from .speculative.tree_dp import cached_best_tree

DEFAULT_TREE_DEPTH = 8


@dataclass(frozen=True)
class EngineSettings:
    auto_mode: str = "chain"  # what `auto` runs here
    # Prompt tokens per forward, for the target and every model that reads the prompt beside it
    # (a pair's draft, DSI's instances); without a plan (a local model directory), the plan's CPU chunk.
    prefill_chunk: int = PREFILL_CHUNK_CPU
    chain_drafts: int = MAX_DRAFT  # most draft tokens per chain verification (the cost model picks fewer)
    tree_size: int = 16  # a tree's nodes, root included: a draft model's, at most the suffix tree's
    tree_depth: int = DEFAULT_TREE_DEPTH  # ... and a draft model's levels
    triforce: TriforceSettings = field(default_factory=TriforceSettings)
    # Keep recent answers' KV in memory; off (an offloaded KV, too large to copy): only the
    # conversation answered last keeps its KV, moved into the next answer (kv/conversation_slot.py).
    keep_prefixes: bool = True
    step_times: StepTimes | None = None  # measured t(n) by context (calibration); None: stated defaults
    # DSI (speculative/dsi/): one target instance per device named here ("cuda:0", "cuda:1", ...);
    # empty: instances are CPU worker processes, as many as the request asks for.
    dsi_devices: tuple[str, ...] = ()
    # DSI's lookahead until the instances' measured latencies choose it: the plan's prediction
    # for these devices; None: the decoder's own first guess.
    dsi_lookahead: int | None = None


def settings_from_plan(plan: Plan, step_times: StepTimes | None = None, has_draft: bool = False) -> EngineSettings:
    """Everything of `plan` the engine runs by. `has_draft`: the pair's draft model is loaded."""
    offloaded = plan.kv_device == "cpu-pinned"
    defaults = TriforceSettings()
    gamma2 = plan.gamma2 or defaults.gamma2
    triforce = TriforceSettings(
        draft="pair" if has_draft else "lookup",
        gamma1=plan.gamma1 or defaults.gamma1, gamma2=gamma2,
        budget=plan.retrieval_budget or defaults.budget, chunk_size=plan.retrieval_chunk or defaults.chunk_size,
        # With the KV offloaded a rebuild streams every layer once more (scoring reads all
        # keys), so it waits for a few verifications' worth of tokens instead of one.
        stride=4 * gamma2 if offloaded else defaults.stride,
        sinks=plan.draft_sinks or defaults.sinks, window=plan.draft_window or defaults.window,
        tree=cached_best_tree(RETRIEVAL_SIBLING_ACCEPTANCE, plan.tree_size, plan.tree_depth)
        if plan.triforce_verify == "tree" else None)
    return EngineSettings(
        auto_mode=plan.mode, prefill_chunk=plan.prefill_chunk,
        chain_drafts=plan.gamma1 if plan.mode == "chain" and plan.gamma1 else MAX_DRAFT,
        tree_size=plan.tree_size, tree_depth=plan.tree_depth, triforce=triforce,
        # An offloaded cache is pinned memory the size of the whole context: one conversation at a
        # time (the engine's ConversationSlot), never copied; saved documents are read into it.
        keep_prefixes=not offloaded, step_times=step_times,
        dsi_devices=plan.dsi_devices, dsi_lookahead=plan.dsi_lookahead)
