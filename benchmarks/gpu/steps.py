"""The `graphs` section: what a decode step and a verification cost with the target's KV on the
device, through the engine's own forward (`TransformersLM.forward`, logits to the host included),
eager and with the steps replayed as CUDA graphs (core/step_graphs.py), side by side.

One-token wall time over the GPU's busy time says how launch-bound a step is (the goal, with
graphs: <= 1.2); a 16-token verification over a one-token step at the longest context says how
cheap verification is (goal <= 1.5). On the dry run the graphs' static path runs eagerly. A
prefill's time and peak memory at each context are checked against the plan's budget on the way
(the `memory` section reads them).
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

        model.set_step_graphs(None)
        eager = time_steps(rig, model, cache, ids, context)
        model.set_step_graphs(not rig.dry_run)
        replayed = time_steps(rig, model, cache, ids, context)
        rows.append({"context": context, "prefill_s": prefill_s, "prefill_tokens_per_s": context / prefill_s,
                     **eager, "graphs": replayed,
                     "graphs_over_eager": {n: replayed["wall_s"][n] / eager["wall_s"][n] for n in eager["wall_s"]}})
        del cache
        free_memory(rig.device)
    last, where = rows[-1], f"at {longest:,} positions"
    path = "graphs" if rig.dry_run or last["graphs"]["graphs_off"] is None else "eager (graphs off)"
    timed = last["graphs"]
    goals = [goal("verify16_over_step", timed["t_over_t1"][str(max(rig.sizes))], f"<= {VERIFY16_GOAL}",
                  f"{max(rig.sizes)} tokens over 1 {where}, {path}")]
    if timed["gpu_busy_s"]["1"] is not None:
        goals.insert(0, goal("one_token_wall_over_gpu", timed["wall_s"]["1"] / timed["gpu_busy_s"]["1"],
                             f"<= {ONE_TOKEN_GOAL}", f"{where}, {path}"))
    return {"shape": rig.shape_name, "dtype": str(rig.dtype), "kv": "on the device (FullCache)",
            "path": "eager, then graphs (the dry run: their static path, run eagerly)", "steps": rows,
            "goals": goals, "memory": memory}


def time_steps(rig: Rig, model, cache, ids: torch.Tensor, context: int) -> dict:
    """The wall time of a forward of each size after `context` cached positions (rolled back after
    each), the GPU's busy time of the smallest and the largest, and whether graphs replayed them
    (`graph_replays`, None: eager) or were turned off (`graphs_off`, the reason)."""
    def step(n: int):
        def forward():
            model.forward(ids[context:context + n], torch.arange(context, context + n), cache)
            cache.trim(context)
        return forward

    for n in rig.sizes:  # a graph is captured at a size's second forward: both before the clock
        step(n)()
    walls = {n: wall_seconds(step(n), rig.device, rig.repeats) for n in rig.sizes}
    busy = {n: busy_seconds(step(n), rig.device) for n in (1, max(rig.sizes))}
    graphs = model.step_graphs
    return {"wall_s": {str(n): s for n, s in walls.items()}, "gpu_busy_s": {str(n): s for n, s in busy.items()},
            "t_over_t1": {str(n): s / walls[1] for n, s in walls.items()},
            "graph_replays": None if graphs is None else graphs.replays,
            "graphs_off": None if graphs is None else graphs.off}


def _prefill_memory(rig: Rig, spec, context: int, measured: int | None) -> dict:
    return {"placement": f"{rig.shape_name} {rig.dtype}, KV of {context:,} on the device, "
                         f"prefill in chunks of {rig.prefill_chunk}",
            "predicted_bytes": predicted_prefill_bytes(spec, context, rig.prefill_chunk, rig.dtype),
            "measured_peak_bytes": measured}
