"""Side-by-side benchmarks: figures come from here, never from timed unit tests.

`tree_growth` is arithmetic on a measured acceptance vector (expected tokens per target forward
for Sequoia trees, k independent chains and one chain, by tree size); `decode_speeds` runs the
same prompt through several decoding modes in one process, one after the other, and checks that
greedy outputs are identical."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from datetime import date
from pathlib import Path

import torch

from ..core.calibration import layer_skip_draft, plan_tree_draft
from ..core.engine import Engine, Finished
from ..core.request import Request, TreeDraft
from ..core.sampling import SamplingParams
from ..core.speculative.tree import Tree
from ..core.speculative.tree_dp import best_scores, chain_trees
from .report import device_label, write_report


def tree_growth(acceptance: list[float], sizes: list[int], max_depth: int,
                chain_counts: tuple[int, ...] = (2, 4)) -> dict[str, list[float | None]]:
    """Expected tokens per verification F(T) against tree size (nodes, root included)."""
    sequoia = best_scores(acceptance, max(sizes), max_depth)
    curves: dict[str, list[float | None]] = {
        f"Sequoia (depth <= {max_depth})": [float(sequoia[n]) for n in sizes],
        "single chain": [Tree.chain(n - 1).score(acceptance) for n in sizes],
    }
    for k in chain_counts:
        if k <= len(acceptance):
            curves[f"{k} independent chains"] = [
                chain_trees(acceptance, n, k).score(acceptance) if n > k else None for n in sizes]
    return curves


def decode_speeds(engine: Engine, prompt_ids: list[int], max_new_tokens: int,
                  runs: dict[str, tuple], repeats: int = 1, seed: int = 0,
                  sampling: SamplingParams = SamplingParams()) -> dict[str, dict]:
    """Answers to one prompt per run {label: (mode, tree_draft[, triforce settings])}, greedy
    unless `sampling` says otherwise. Each row: tok/s, tokens per target forward, forwards,
    per-stage counts, and whether its tokens equal plain's (the first run: greedy speculation
    must not change a single token; sampled answers differ by their draws, so None).

    With `repeats` > 1, every run is measured that many times, in rounds whose order is shuffled
    (seeded), so that drift in the machine (heat, memory, background load) does not favour a
    fixed position; `tokens_per_second` is then the median and `tokens_per_second_runs` all."""
    import random

    labels = list(runs)
    order = random.Random(seed)
    speeds: dict[str, list[float]] = {label: [] for label in labels}
    rows: dict[str, dict] = {}
    baseline = None
    for round_index in range(repeats):  # the first round in the given order: plain first, as the baseline
        for label in (labels if round_index == 0 else order.sample(labels, len(labels))):
            result = timed_answer(engine, prompt_ids, max_new_tokens, runs[label], sampling)
            baseline = baseline or result.token_ids
            speeds[label].append(result.stats.tokens_per_second)
            stats = result.stats
            rows[label] = {
                "mode": result.mode, "new_tokens": result.new_tokens,
                "tokens_per_second": statistics.median(speeds[label]),
                "predicted_tokens_per_second": stats.predicted_tokens_per_second,
                "mean_accepted_per_forward": stats.mean_accepted_per_forward,
                "target_forwards": stats.target_forwards, "tree_size": stats.tree_size,
                "tree_depth": stats.tree_depth, "decode_seconds": stats.decode_seconds,
                "stages": stats.stages,
                "identical_to_plain": None if not sampling.greedy else
                result.token_ids == baseline and rows.get(label, {}).get("identical_to_plain", True),
            }
            if repeats > 1:
                rows[label]["tokens_per_second_runs"] = list(speeds[label])
    return {label: rows[label] for label in labels}


def timed_answer(engine: Engine, prompt_ids: list[int], max_new_tokens: int, run: tuple,
                 sampling: SamplingParams = SamplingParams()):
    mode, tree_draft, *triforce = run
    engine.answers.clear()  # the same prompt answered again: the history would hand back the last answer
    options = TreeDraft(*tree_draft) if tree_draft else triforce[0] if triforce else None
    events = engine.generate(prompt_ids, Request(max_new_tokens, sampling, mode, options))
    return next(e.result for e in events if isinstance(e, Finished))


def _draw_trees(report: dict, plt):
    figure, (growth, speed) = plt.subplots(1, 2, figsize=(13, 5.5))
    sizes = report["tree_growth"]["sizes"]
    for label, values in report["tree_growth"]["curves"].items():
        points = [(n, v) for n, v in zip(sizes, values) if v is not None]
        growth.plot(*zip(*points), marker="o", label=label)
    growth.set(xscale="log", xlabel="tree size (tokens per verification)",
               ylabel="expected tokens per target forward")
    growth.set_title(f"From the measured acceptance vector of\n{report['acceptance']['description']}",
                     fontsize=9)
    growth.legend()
    labels = list(report["decode"])
    speed.bar(labels, [report["decode"][label]["tokens_per_second"] for label in labels])
    speed.set_ylabel("tokens per second")
    identical = all(row["identical_to_plain"] for row in report["decode"].values())
    speed.set_title(f"Greedy decoding, {report['prompt_tokens']}-token prompt, {report['device']}\n"
                    + ("all outputs identical to plain" if identical else "OUTPUTS DIFFER FROM PLAIN"),
                    fontsize=9)
    speed.set_xticks(range(len(labels)), [label.replace(" (", "\n(") for label in labels], fontsize=8)
    return figure


def run_bench(engine: Engine, prompt_ids: list[int], max_new_tokens: int, draft_layers: int,
              out_dir: Path) -> list[Path]:
    """The tree benchmark on the loaded model: a measured acceptance vector and the DP curves
    from it; measured t(n) and draft cost, the optimizer's choice and its reason; greedy decoding
    speed of plain, chain, prompt-lookup tree and layer-skip-draft tree side by side."""
    context = len(prompt_ids)
    plan = plan_tree_draft(engine, layer_skip_draft(engine, draft_layers), SamplingParams(), context)
    vector, acceptance = plan.acceptance, list(plan.acceptance.p)
    # Run a draft tree even when the optimizer says it does not pay, to check that prediction.
    draft, template = plan.tree_draft or (engine.model.truncated(draft_layers), plan.template)
    size, depth = template.size, template.depth
    runs = {
        "plain": ("plain", None),
        "chain (prompt lookup)": ("chain", None),
        "tree (suffix tree)": ("tree", None),
        f"tree ({draft_layers}-layer draft, n={size}, d={depth})": ("tree", (draft, template)),
    }
    sizes = [2, 4, 8, 16, 32, 64, 128, 256, 512]
    report = {
        "date": date.today().isoformat(), "device": device_label(), "model": engine.name,
        "prompt_tokens": context, "max_new_tokens": max_new_tokens,
        "acceptance": {"description": f"{vector.models}, T=0, width 8 ({vector.positions} positions)",
                       "p": acceptance},
        "forward_times": asdict(plan.times), "draft_cost": plan.draft_cost,
        "optimizer_choice": asdict(plan.choice),
        "tree_growth": {"sizes": sizes, "curves": tree_growth(acceptance, sizes, max_depth=16)},
        "decode": decode_speeds(engine, prompt_ids, max_new_tokens, runs),
    }
    return write_report(report, out_dir, "cpu-trees" if not torch.cuda.is_available() else "gpu-trees",
                        _draw_trees)
