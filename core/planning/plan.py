"""The plan: how a model pair runs on a machine, every choice with a one-line reason.

`make_plan(profile, pair, context)` is pure: the same HardwareProfile (measured or synthetic),
pair and context always give the same plan, so it is tested against synthetic cards. The order of
the decisions is the order of what matters to a user:

1. The mode (algorithms.md sections 2, 5): on a GPU, a context much longer than the retrieval
   budget runs TriForce's hierarchy (the retrieval cache makes drafting cheap however long the
   context); otherwise chain or tree speculation, a tree only when the hardware-aware optimizer
   (measured t(n) and an acceptance vector) says it beats a chain.
2. Weights: as precise as fits. Unquantized (bf16 on GPUs), else bitsandbytes 8-bit, else 4-bit
   nf4, else nf4 with the output head quantized too; "fits" always allows the full KV to be
   offloaded and the embedding table to stay in RAM, so precision is never traded for speed.
3. The full KV on the GPUs with its layers when it fits, else in pinned CPU memory, streamed layer
   by layer (one full verification then costs its bytes over the measured host-to-device bandwidth).
   The embedding table on the GPU when it fits, else in RAM (host_embedding.py): given up first,
   as it costs a few KB over the link per token.
4. The draft on the GPU when it fits, else on the CPU.
5. Gammas, retrieval chunk size and prefill chunk from the measured bandwidths.
6. DSI (algorithms.md section 6) instead, with two or more GPUs that each hold a whole target at
   those weights: one target instance per GPU, verifying while the drafter drafts. Chosen where
   its cost model (speculative/dsi/cost.py) predicts it beats 1-5's plan by DSI_MARGIN, with the plan's
   own step times: a verification reads the weights and the KV at the card's memory rate, or
   streams an offloaded KV over the card's own link, so W instances verify side by side without
   sharing bandwidth.

Memory arithmetic: memory.py; the speculation cost model: speculation.py; DSI: dsi.py; the
one-line reasons: reasons.py.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import InputError
from ..hardware import HardwareProfile
from ..modes import MODES
from ..registry import ModelPair, Registry
from .dsi import choose_dsi, dsi_plan
from .memory import DRAFT_SINKS, QUANTIZATIONS, WEIGHT_TIERS, Layout, prefill_chunks, uses_draft
from .reasons import draft_cache_reason, kv_attention_reason, kv_reason, placement_reason, prefill_reason, weights_reason
from .speculation import choose_speculation
from .types import Alternative, Overrides, Plan, PlanRefused


RETRIEVAL_BUDGET = 4096  # TriForce's budget for 128K contexts (algorithms.md section 5)
LONG_CONTEXT_FACTOR = 2  # TriForce pays once the context is this many retrieval budgets long


def make_plan(profile: HardwareProfile, pair: ModelPair, context: int, overrides: Overrides | None = None,
              registry: Registry | None = None) -> Plan:
    """The plan for `pair` at `context` tokens on `profile`'s machine, or PlanRefused naming the
    nearest request that plans (a shorter context, 4-bit weights, or a smaller pair of `registry`)."""
    overrides = overrides or Overrides()
    _check_request(context, overrides)
    plan = try_plan(profile, pair, context, overrides)
    if isinstance(plan, Plan):
        return plan
    alternatives = _alternatives(profile, pair, context, overrides, registry)
    nearest = ("; nearest that fits: " + "; or ".join(a.summary for a in alternatives)) if alternatives else \
        "; nothing smaller fits this machine either"
    raise PlanRefused(f"{pair.id} at {context:,} tokens does not fit: {plan}{nearest}", alternatives)


def _check_request(context: int, overrides: Overrides) -> None:
    if not isinstance(context, int) or context < 1:
        raise InputError(f"the context must be a positive number of tokens, got {context!r}")
    if overrides.quantization not in (None, *QUANTIZATIONS):
        raise InputError(f"unknown quantization {overrides.quantization!r}: choose from {', '.join(QUANTIZATIONS)}")
    if overrides.mode not in (None, *MODES):
        raise InputError(f"unknown mode {overrides.mode!r}: choose from {', '.join(MODES)}")
    for name in ("retrieval_budget", "draft_window"):
        value = getattr(overrides, name)
        if value is not None and value < 1:
            raise InputError(f"{name.replace('_', ' ')} must be at least 1 token, got {value}")
    if overrides.retrieval_acceptance is not None and not 0 < overrides.retrieval_acceptance < 1:
        raise InputError("the retrieval acceptance rate must be between 0 and 1")


def try_plan(profile: HardwareProfile, pair: ModelPair, context: int, overrides: Overrides) -> Plan | str:
    """The plan, or a one-line reason why nothing fits."""
    if context > pair.context_length:
        return f"the pair supports at most {pair.context_length:,} tokens"
    reasons: dict[str, str] = {}
    budget = overrides.retrieval_budget or RETRIEVAL_BUDGET
    mode = _mode(profile, context, budget, overrides, reasons)
    tried = []
    # Outer loops hold what matters most: precision, then the KV on the GPU, the draft on the GPU,
    # a large prefill chunk; the embedding table on the GPU matters least (on the CPU a token's
    # row is read there and a few KB go over the link).
    tiers = [tier for tier in WEIGHT_TIERS if overrides.quantization in (None, tier[0])]
    for quantization, head_quantized in tiers:
        for kv_on_chip in (True, False) if profile.gpus else (False,):
            for with_draft in (True, False) if uses_draft(pair, mode) and profile.gpus else (True,):
                for prefill_chunk in prefill_chunks(profile, kv_on_chip):
                    for embedding_on_cpu in (False, True) if profile.gpus else (False,):
                        layout = Layout(profile, pair, context, mode, budget, overrides, quantization,
                                         kv_on_chip, with_draft, prefill_chunk, head_quantized, embedding_on_cpu)
                        if layout.fits:
                            return finish(layout, tried, reasons)
                        tried.append(layout)
    return tried[-1].shortfall()


def _mode(profile: HardwareProfile, context: int, budget: int, overrides: Overrides,
          reasons: dict) -> str:
    """TriForce, plain or "speculate" (chain or tree, settled once the weights are known)."""
    if overrides.mode:
        reasons["mode"] = f"{overrides.mode}: as requested"
        return overrides.mode
    if profile.gpus and context > LONG_CONTEXT_FACTOR * budget:
        reasons["mode"] = (f"triforce: {context:,} tokens are over {LONG_CONTEXT_FACTOR}x the {budget:,}-token "
                           f"retrieval budget, so drafting against a retrieval cache reads a fraction of the full KV")
        return "triforce"
    return "speculate"


def finish(layout: Layout, tried: list[Layout], reasons: dict) -> Plan:
    pair, context = layout.pair, layout.context
    reasons["weights"] = weights_reason(layout, tried)
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
        embedding_device=layout.embedding_device())


def _alternatives(profile: HardwareProfile, pair: ModelPair, context: int, overrides: Overrides,
                  registry: Registry | None) -> tuple[Alternative, ...]:
    """What does plan, nearest first: 4-bit weights at this context (when the user fixed a finer
    quantization), the longest context this pair fits, a smaller pair of the registry."""
    found = []
    if overrides.quantization not in (None, "nf4") and \
            isinstance(try_plan(profile, pair, context, replace(overrides, quantization="nf4")), Plan):
        found.append(Alternative(pair.id, context, "nf4", f"{pair.id} at {context:,} tokens with 4-bit (nf4) weights"))
    shorter = _longest_context(profile, pair, min(context, pair.context_length + 1) - 1, overrides)
    if shorter:
        found.append(Alternative(pair.id, shorter, overrides.quantization, f"{pair.id} at {shorter:,} tokens"))
    if registry is not None:
        smaller = sorted((other for other in registry.pairs.values()
                          if other.id != pair.id and _weight_params(other) < _weight_params(pair)),
                         key=_weight_params, reverse=True)
        for other in smaller:  # the largest first: the nearest to what was asked for
            free = replace(overrides, quantization=None)
            at = min(context, other.context_length)
            if not isinstance(try_plan(profile, other, at, free), Plan):
                at = _longest_context(profile, other, at - 1, free)
            if at:
                found.append(Alternative(other.id, at, None, f"the smaller pair {other.id} at {at:,} tokens"))
                break
    return tuple(found)


def _weight_params(pair: ModelPair) -> float:
    return sum(model.params_b for model in pair.models)


def _longest_context(profile: HardwareProfile, pair: ModelPair, most: int, overrides: Overrides) -> int | None:
    """The longest whole number of 1,024-token blocks up to `most` that plans (binary search:
    memory only grows with the context), or None."""
    low, high = 0, most // 1024  # low plans (0 = none found), high + 1 does not
    while low < high:
        middle = (low + high + 1) // 2
        if isinstance(try_plan(profile, pair, middle * 1024, overrides), Plan):
            low = middle
        else:
            high = middle - 1
    return low * 1024 or None
