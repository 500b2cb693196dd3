"""The plan: how a model pair runs on a machine, every choice with a one-line reason.

`make_plan(profile, pair, context)` is pure: the same HardwareProfile (measured or synthetic),
pair, context and overrides always give the same plan, so it is tested against synthetic cards.
Two precisions (Overrides.precision, precision.py):

- "exact" walks the placements in the order of what matters to a user, precision first, and takes
  the first that fits:
  1. The mode (algorithms.md sections 2, 5), with the placement: on a GPU, a context over twice the
     retrieval budget is planned both in TriForce's hierarchy and in chain or tree speculation, and
     the faster by predicted time is kept (candidates.finish_placement; unpredicted, TriForce);
     otherwise chain or tree, a tree only when the hardware-aware optimizer (measured t(n) and an
     acceptance vector) says it beats a chain. In each mode the first placement of the walk that
     fits, in the most precise weights any mode fits.
  2. Weights: as precise as fits. Unquantized (bf16 on GPUs), else bitsandbytes 8-bit, else 4-bit
     nf4, else nf4 with the output head quantized too; "fits" always allows the full KV to be
     offloaded and the embedding table to stay in RAM, so precision is never traded for speed.
  3. The full KV on the GPUs with its layers when it fits; else, on one GPU, the layers' KV that
     fits there and the rest in pinned CPU memory (a partial offload); else all in pinned CPU
     memory. Offloaded KV is streamed layer by layer (one full verification then costs its bytes
     over the measured host-to-device bandwidth). The embedding table on the GPU when it fits, else in RAM (host_embedding.py):
     given up first, as it costs a few KB over the link per token.
  4. The draft on the GPU when it fits, else on the CPU.
  5. Gammas, retrieval chunk size and prefill chunk from the measured bandwidths.
  6. DSI (algorithms.md section 6) instead, with two or more GPUs that each hold a whole target at
     those weights: one target instance per GPU, verifying while the drafter drafts. Chosen where
     its cost model (speculative/dsi/cost.py) predicts it beats 1-5's plan by DSI_MARGIN.
- "auto" (the default) takes, among the placements of candidates.py that fit (4-bit weights and an
  8-bit KV on the GPU included), the one with the least predicted time to an answer (cost.py),
  each with the mode and speculation of 1, 5 and 6; a coarser precision only where it answers
  PRECISION_MARGIN (1.15x) sooner (candidates.fastest).

Memory arithmetic: memory.py; predicted times: cost.py with efficiency.py; the speculation cost
model: speculation.py; DSI: dsi.py; a layout finished as a plan: assemble.py; the one-line
reasons: reasons.py and precision.py.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import InputError
from ..hardware import HardwareProfile
from ..modes import MODES
from ..registry import ModelPair, Registry
from .assemble import RETRIEVAL_BUDGET, candidate_modes
from .candidates import PRECISION_MARGIN, candidate_layouts, candidates, fastest, finish_placement
from .memory import QUANTIZATIONS, WEIGHT_TIERS, Layout, compute_dtype, prefill_chunks, uses_draft
from .precision import PRECISIONS, answers_sentence, auto_reason
from .reasons import weights_reason
from .types import Alternative, Overrides, Plan, PlanRefused


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
    if overrides.precision not in PRECISIONS:
        raise InputError(f"unknown precision {overrides.precision!r}: choose from {', '.join(PRECISIONS)}")
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
    exact = _exact_plan(profile, pair, context, overrides)
    if overrides.precision == "exact":
        return exact if isinstance(exact, str) else _explained(exact, exact, profile, pair, overrides, (
            "exact: the model's own weights and KV dtype, quantized only where nothing else fits"))
    found = candidates(profile, pair, context, overrides)
    choice = fastest(found)
    if choice is not None:
        chosen, passed_over = choice
        return _explained(chosen, exact, profile, pair, overrides, auto_reason(chosen, exact, passed_over, PRECISION_MARGIN))
    # Not predicted (no GPU, or its bandwidths not measured): the most precise placement that fits.
    chosen = exact if isinstance(exact, Plan) or not found else found[0]
    if isinstance(chosen, str):
        return chosen
    why = "no GPU" if not profile.gpus else \
        "the GPU's bandwidths are not measured (`specchat profile --refresh`), so placements cannot be compared"
    return _explained(chosen, exact, profile, pair, overrides, f"auto, precision first: {why}")


def _explained(chosen: Plan, exact: Plan | str, profile: HardwareProfile, pair: ModelPair, overrides: Overrides,
               why: str) -> Plan:
    """`chosen` with the precision's reason, the plain words on its answers and exact's speed."""
    answers = answers_sentence(chosen, exact, compute_dtype(profile, pair.target), overrides.quantization is not None)
    return replace(chosen, reasons={**chosen.reasons, "precision": why, "answers": answers},
                   exact_tokens_per_second=exact.predicted_tokens_per_second if isinstance(exact, Plan) else None)


def _exact_plan(profile: HardwareProfile, pair: ModelPair, context: int, overrides: Overrides) -> Plan | str:
    """Precision first (the module's steps 1-6): in each candidate mode the first placement of the
    walk that fits, in the most precise weights any mode fits; of those, the faster."""
    budget = overrides.retrieval_budget or RETRIEVAL_BUDGET
    tried: list[Layout] = []
    first: dict[str, Layout] = {}  # mode -> its first fitting layout, in the tier found
    last: dict[str, Layout] = {}  # mode -> its last layout of that tier (why it does not fit)
    tier = None
    for layouts in _exact_layouts(profile, pair, context, budget, overrides):
        if first and (layouts[0].quantization, layouts[0].head_quantized) != tier:
            break
        for layout in layouts:
            if layout.fits and not first:
                tier = (layout.quantization, layout.head_quantized)
            if layout.fits and first.get(layout.mode) is None and (not first or tier == (
                    layout.quantization, layout.head_quantized)):
                first[layout.mode] = layout
            last[layout.mode] = layout
        if len(first) == len(layouts):
            break
        if not first:
            tried += layouts
    if not first:
        return tried[-1].shortfall()
    chosen = tuple(first.get(mode, last[mode]) for mode in last)
    return finish_placement(chosen, weights_reason(next(iter(first.values())), tried))


def _exact_layouts(profile: HardwareProfile, pair: ModelPair, context: int, budget: int, overrides: Overrides):
    """The exact walk's placements in order, each in its candidate modes (TriForce first, the
    smallest last). Outer loops hold what matters most: precision, then the KV on the GPU, the draft
    on the GPU, a large prefill chunk; the embedding table on the GPU matters least (on the CPU a
    token's row is read there and a few KB go over the link)."""
    tiers = [tier for tier in WEIGHT_TIERS if overrides.quantization in (None, tier[0])]
    modes = candidate_modes(profile, context, budget, overrides)
    drafts = (True, False) if profile.gpus and any(uses_draft(pair, mode) for mode in modes) else (True,)
    for quantization, head_quantized in tiers:
        for kv_on_chip, kv_partial in ((True, False), (False, True), (False, False)) if profile.gpus else \
                ((False, False),):
            for with_draft in drafts:
                for prefill_chunk in prefill_chunks(profile, kv_on_chip):
                    for embedding_on_cpu in (False, True) if profile.gpus else (False,):
                        yield tuple(Layout(profile, pair, context, mode, budget, overrides, quantization, kv_on_chip,
                                           with_draft, prefill_chunk, head_quantized, embedding_on_cpu,
                                           kv_partial=kv_partial)
                                    for mode in modes)


def _plans(profile: HardwareProfile, pair: ModelPair, context: int, overrides: Overrides) -> bool:
    """Whether `try_plan` would plan (some placement fits), without finishing a plan."""
    if context > pair.context_length:
        return False
    budget = overrides.retrieval_budget or RETRIEVAL_BUDGET
    if any(layout.fits for layouts in _exact_layouts(profile, pair, context, budget, overrides) for layout in layouts):
        return True
    return overrides.precision == "auto" and profile.gpus != () and any(
        layout.fits for layouts in candidate_layouts(profile, pair, context, budget, overrides) for layout in layouts)


def _alternatives(profile: HardwareProfile, pair: ModelPair, context: int, overrides: Overrides,
                  registry: Registry | None) -> tuple[Alternative, ...]:
    """What does plan, nearest first: the automatic precision at this context (when the user asked
    for the exact one), 4-bit weights at this context (when the user fixed a finer quantization),
    the longest context this pair fits, a smaller pair of the registry."""
    found = []
    if overrides.precision == "exact" and _plans(profile, pair, context, replace(overrides, precision="auto")):
        found.append(Alternative(pair.id, context, overrides.quantization,
                                 f"{pair.id} at {context:,} tokens with --precision auto (quantized weights or KV: "
                                 "the answers of the quantized model)", precision="auto"))
    if overrides.quantization not in (None, "nf4") and _plans(profile, pair, context, replace(overrides, quantization="nf4")):
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
            if not _plans(profile, other, at, free):
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
    if high:  # the shortest first: where even it does not plan (the weights alone), no search
        if not _plans(profile, pair, 1024, overrides):
            return None
        low = 1
    while low < high:
        middle = (low + high + 1) // 2
        if _plans(profile, pair, middle * 1024, overrides):
            low = middle
        else:
            high = middle - 1
    return low * 1024 or None
