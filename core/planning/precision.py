"""The precision setting and its words: "auto" (the default) plans the fastest placement, quantized
weights and an 8-bit KV included; "exact" keeps the model's own weights and KV dtype, quantizing
only where nothing else fits. Speculation is lossless against the model as loaded either way, so
the plan says in plain words which model that is."""

from __future__ import annotations

from ..env_settings import env_choice
from ..errors import InputError
from .cost import ANSWERS_PER_DOCUMENT, document_job_seconds
from .types import Plan

PRECISIONS = ("auto", "exact")
PRECISION_ENV = "SPECCHAT_PRECISION"  # `--precision` where given, else this, else "auto"


def precision_setting(given: str | None = None) -> str:
    """`given` (a --precision option), else $SPECCHAT_PRECISION, else "auto"; InputError otherwise."""
    if given is None:
        return env_choice(PRECISION_ENV, PRECISIONS, "auto")
    if given not in PRECISIONS:
        raise InputError(f"--precision {given!r}: choose from {', '.join(PRECISIONS)}")
    return given


def speed(tokens_per_second: float) -> str:
    return f"about {tokens_per_second:.0f} tok/s" if tokens_per_second >= 10 else \
        f"about {tokens_per_second:.1f} tok/s"


def placement_words(plan: Plan) -> str:
    """"nf4 weights and an 8-bit KV on the GPU", "bfloat16 weights with the KV streamed from RAM",
    "nf4 weights with 14 of 32 layers' KV on the GPU, the rest streamed from RAM"."""
    weights = f"{plan.weights} weights" + (" (the output head too)" if plan.head_weights == plan.weights
                                           and plan.weights in ("nf4", "int8") else "")
    bits = " 8-bit" if plan.kv_dtype == "int8" else ""
    if plan.kv_device == "cpu-pinned" and plan.kv_resident_layers:
        return (f"{weights} with {plan.kv_resident_layers} of {sum(plan.target_layers)} layers'{bits} KV on the GPU, "
                f"the rest streamed from RAM")
    if plan.kv_device == "cpu-pinned":
        return f"{weights} with the{bits} KV streamed from RAM"
    if plan.kv_dtype == "int8":
        return f"{weights} and an 8-bit KV on the GPU"
    return f"{weights} with the KV on the {'CPU' if plan.kv_device == 'cpu' else 'GPU'}"


def auto_reason(chosen: Plan, exact: Plan | str, passed_over: Plan | None, margin: float) -> str:
    """Why auto chose `chosen`, against the exact placement (a Plan, or why none fits) and the
    faster, coarser plan `passed_over` for it (it answers less than `margin` sooner)."""
    said = f"auto: {placement_words(chosen)}, {speed(chosen.predicted_tokens_per_second)}"
    kept = "" if passed_over is None else "; " + kept_words(chosen, passed_over, margin)
    if isinstance(exact, str):
        return f"{said}{kept}; the model's own precision does not fit (--precision exact: {exact})"
    if _same_placement(chosen, exact):
        return f"{said}: the exact placement (--precision exact)" + (kept or " is also the fastest that fits")
    versus = speed(exact.predicted_tokens_per_second) if exact.predicted_tokens_per_second else "no prediction"
    fastest = "" if passed_over is not None else ", the fastest that fits"
    return f"{said}{fastest}, against {versus} for {placement_words(exact)} (--precision exact){kept}"


def kept_words(chosen: Plan, passed_over: Plan, margin: float) -> str:
    """"bfloat16 weights kept: nf4 weights with the KV on the GPU would answer only 2% sooner ..."."""
    if passed_over.weights != chosen.weights:
        kept = f"{chosen.weights} weights kept"
    elif passed_over.head_weights != chosen.head_weights:
        kept = f"the {chosen.head_weights} output head kept"
    else:
        kept = f"the {chosen.kv_dtype} KV kept"
    seconds = [document_job_seconds(plan.predicted_prefill_seconds, plan.predicted_tokens_per_second, plan.context)
               for plan in (chosen, passed_over)]
    gain = seconds[0] / seconds[1] - 1
    share = f"{gain:.0%}" if gain >= 0.005 else "under 1%"
    return (f"{kept}: {placement_words(passed_over)} ({passed_over.mode}, {speed(passed_over.predicted_tokens_per_second)}) "
            f"would read the document and write {ANSWERS_PER_DOCUMENT} answers only {share} sooner, under the "
            f"{margin:.2f}x a coarser precision must gain")


def answers_sentence(plan: Plan, exact: Plan | str, dtype: str, requested: bool) -> str:
    """What the answers are, in plain words: "4-bit weights, 8-bit KV: answers are exactly what this
    quantized model would write; --precision exact for the bfloat16 model, about 10 tok/s".
    `dtype`: the compute dtype, the unquantized model's; `requested`: the weights were fixed by
    the user (no comparison is then offered)."""
    quantized = [{"nf4": "4-bit weights", "int8": "8-bit weights"}.get(plan.weights), "8-bit KV" if
                 plan.kv_dtype == "int8" else None]
    quantized = [words for words in quantized if words]
    if not quantized:
        return f"{plan.weights} weights and KV: answers are exactly what the {plan.weights} model would write"
    said = f"{', '.join(quantized)}: answers are exactly what this quantized model would write"
    if requested:
        return said
    if isinstance(exact, str) or _quantized(exact):
        said += f"; the {dtype} model does not fit this machine at {plan.context:,} tokens"
    if isinstance(exact, Plan) and not _same_placement(plan, exact):
        model = f"the {dtype} model" if not _quantized(exact) else placement_words(exact)
        versus = f", {speed(exact.predicted_tokens_per_second)}" if exact.predicted_tokens_per_second else ""
        said += f"; --precision exact for {model}{versus}"
    return said


def _quantized(plan: Plan) -> bool:
    return plan.weights in ("nf4", "int8") or plan.kv_dtype == "int8"


def _same_placement(one: Plan, other: Plan) -> bool:
    return (one.weights, one.head_weights, one.kv_dtype, one.kv_device, one.kv_resident_layers) == \
        (other.weights, other.head_weights, other.kv_dtype, other.kv_device, other.kv_resident_layers)
