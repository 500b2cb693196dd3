"""The long-context benchmark (`specchat bench --suite longctx`): one 6-8K-token document
prompt, greedy answers from every decoding mode side by side in one process (the prompt's KV is
reused after the first, so all see the same context), outputs checked identical to plain."""

from __future__ import annotations

from datetime import date
from pathlib import Path

import torch

from ..core.calibration import layer_skip_draft, plan_tree_draft
from ..core.decoding import TriforceSettings
from ..core.engine import Engine
from ..core.sampling import SamplingParams
from ..core.tree_choice import triforce_tree
from .decode import decode_speeds
from .report import device_label, write_report


def run_longctx_bench(engine: Engine, prompt_ids: list[int], max_new_tokens: int, draft_layers: int,
                      out_dir: Path, repeats: int = 1) -> list[Path]:
    context = len(prompt_ids)
    plan = plan_tree_draft(engine, layer_skip_draft(engine, draft_layers), SamplingParams(), context)
    draft, template = plan.tree_draft or (engine.model.truncated(draft_layers), plan.template)
    tree = triforce_tree(engine.settings, context)
    runs = {
        "plain": ("plain", None),
        "chain (prompt lookup)": ("chain", None),
        "tree (suffix tree)": ("tree", None),
        f"tree ({draft_layers}-layer draft, n={template.size}, d={template.depth})": ("tree", (draft, template)),
        "triforce (lookup -> retrieval 1K -> full)": ("triforce", None, TriforceSettings(draft="lookup")),
        "triforce (retrieval 1K -> full)": ("triforce", None, TriforceSettings(draft="")),
        f"triforce ({draft_layers}-layer draft -> retrieval 1K -> full)":
            ("triforce", None, TriforceSettings(draft=f"skip{draft_layers}")),
        "triforce (lookup -> retrieval 2K -> full, gamma2 12)":
            ("triforce", None, TriforceSettings(draft="lookup", budget=2048, gamma2=12)),
        f"triforce (retrieval 1K -> full verifies a tree, n={tree.size}, d={tree.depth})":
            ("triforce", None, TriforceSettings(draft="", tree=tree)),
        "auto": ("auto", None),
    }
    rows = decode_speeds(engine, prompt_ids, max_new_tokens, runs, repeats)
    fixed = {label: row for label, row in rows.items() if label != "auto"}
    best = max(fixed, key=lambda label: fixed[label]["tokens_per_second"])
    plain = rows["plain"]["tokens_per_second"]
    auto_runs = rows["auto"].get("tokens_per_second_runs", [rows["auto"]["tokens_per_second"]])
    best_runs = rows[best].get("tokens_per_second_runs", [rows[best]["tokens_per_second"]])
    report = {
        "date": date.today().isoformat(), "device": device_label(), "model": engine.name,
        "prompt_tokens": context, "max_new_tokens": max_new_tokens,
        "decode": rows,
        "speedup_over_plain": {label: row["tokens_per_second"] / plain for label, row in rows.items()},
        "best_fixed_mode": best, "repeats": repeats,
        # Auto against the best fixed mode: medians, and whether the two runs' ranges overlap
        # (the noise between repeats of one mode bounds what a difference can mean).
        "auto_over_best_fixed": rows["auto"]["tokens_per_second"] / rows[best]["tokens_per_second"],
        "auto_within_noise_of_best": max(auto_runs) >= min(best_runs),
        "all_identical_to_plain": all(row["identical_to_plain"] for row in rows.values()),
    }
    return write_report(report, out_dir, ("gpu" if torch.cuda.is_available() else "cpu") + "-longctx",
                        _draw_longctx)


def _draw_longctx(report: dict, plt):
    figure, axis = plt.subplots(figsize=(10, 5.5))
    labels = list(report["decode"])
    speeds = [report["decode"][label]["tokens_per_second"] for label in labels]
    colors = ["tab:gray" if label == "plain" else "tab:green" if label == report["best_fixed_mode"]
              else "tab:blue" for label in labels]
    axis.barh(labels, speeds, color=colors)
    for y, label in enumerate(labels):
        row = report["decode"][label]
        axis.text(speeds[y], y, f" {speeds[y]:.1f} tok/s, {row['mean_accepted_per_forward']:.2f} tok/fwd",
                  va="center", fontsize=8)
    axis.set_xlim(0, max(speeds) * 1.45)  # room for the labels
    axis.invert_yaxis()
    axis.set_xlabel("tokens per second (greedy, identical outputs)")
    axis.set_title(f"{report['model']} on {report['device']}: {report['prompt_tokens']:,}-token prompt")
    return figure
