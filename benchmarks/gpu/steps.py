"""The `graphs` section: what a decode step and a verification cost with the target's KV on the
device, through the engine's own forward (`TransformersLM.forward`, logits to the host included).

One-token wall time over the GPU's busy time says how launch-bound a step is (the goal, with CUDA
graphs: <= 1.2); a 16-token verification over a one-token step at the longest context says how
cheap verification is (goal <= 1.5). The engine has no graph path yet, so what this section
measures is the eager baseline those goals are set against. A prefill's time and peak memory at
each context are checked against the plan's budget on the way (the `memory` section reads them).
"""

from __future__ import annotations

import torch

from .clock import busy_seconds, free_memory, peak_bytes, reset_peak, wall_seconds
from .rig import Rig, goal
from .shapes import model_spec, predicted_prefill_bytes, prefill, random_ids, random_model

ONE_TOKEN_GOAL = 1.2  # wall / GPU busy time of a one-token step
VERIFY16_GOAL = 1.5  # a 16-token verification / a one-token step, at the longest context


def run(rig: Rig, report: dict) -> dict:
    if not rig.contexts:
        return {"status": "skipped: no context fits this machine (" + "; ".join(rig.left_out) + ")"}
    longest = max(rig.contexts)
    model = random_model(rig.shape, longest + max(rig.sizes), rig.device, rig.dtype)
    spec = model_spec(model, rig.dtype)
    ids = random_ids(model.vocab_size, longest + max(rig.sizes))
    rows, memory = [], []
    for context in rig.contexts:
        cache = model.new_cache()
        reset_peak(rig.device)
        prefill_s = prefill(model, cache, ids, context, rig.prefill_chunk)
        memory.append(_prefill_memory(rig, spec, context, peak_bytes(rig.device)))

        rows.append({"context": context, "prefill_s": prefill_s, "prefill_tokens_per_s": context / prefill_s,
                     **time_steps(rig, model, cache, ids, context)})
        del cache
        free_memory(rig.device)
    last = rows[-1]
    goals = [goal("verify16_over_step", last["t_over_t1"][str(max(rig.sizes))], f"<= {VERIFY16_GOAL}",
                  f"{max(rig.sizes)} tokens over 1 at {longest:,} positions, eager")]
    if last["gpu_busy_s"]["1"] is not None:
        goals.insert(0, goal("one_token_wall_over_gpu", last["wall_s"]["1"] / last["gpu_busy_s"]["1"],
                             f"<= {ONE_TOKEN_GOAL}", f"at {longest:,} positions, eager"))
    return {"shape": rig.shape_name, "dtype": str(rig.dtype), "kv": "on the device (FullCache)",
            "path": "eager: the engine has no CUDA graph path yet", "steps": rows, "goals": goals,
            "memory": memory}


def time_steps(rig: Rig, model, cache, ids: torch.Tensor, context: int) -> dict:
    """The wall time of a forward of each size after `context` cached positions (rolled back after
    each), and the GPU's busy time of the smallest and the largest: what a step would cost once
    CUDA graphs take the launches away."""
    def step(n: int):
        def forward():
            model.forward(ids[context:context + n], torch.arange(context, context + n), cache)
            cache.trim(context)
        return forward

    walls = {n: wall_seconds(step(n), rig.device, rig.repeats) for n in rig.sizes}
    busy = {n: busy_seconds(step(n), rig.device) for n in (1, max(rig.sizes))}
    return {"wall_s": {str(n): s for n, s in walls.items()}, "gpu_busy_s": {str(n): s for n, s in busy.items()},
            "t_over_t1": {str(n): s / walls[1] for n, s in walls.items()}}


def _prefill_memory(rig: Rig, spec, context: int, measured: int | None) -> dict:
    return {"placement": f"{rig.shape_name} {rig.dtype}, KV of {context:,} on the device, "
                         f"prefill in chunks of {rig.prefill_chunk}",
            "predicted_bytes": predicted_prefill_bytes(spec, context, rig.prefill_chunk, rig.dtype),
            "measured_peak_bytes": measured}
