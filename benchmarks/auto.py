"""The auto benchmark (`specchat bench --suite auto`): several real documents, every mode a user
can pick and auto side by side, greedy, in shuffled repeated rounds, outputs checked identical to
plain; and, for each answer, the cost model's predicted tok/s next to the measured one."""

from __future__ import annotations

import statistics
from datetime import date
from pathlib import Path

import torch

from ..core.decoding import TriforceSettings
from ..core.engine import Engine
from .decode import decode_speeds
from .report import device_label, write_report

FIXED_MODES = {
    "plain": ("plain",),
    "chain (prompt lookup)": ("chain",),
    "tree (suffix tree)": ("tree",),
    "triforce (lookup -> retrieval 1K -> full)": ("triforce", TriforceSettings(draft="lookup")),
}
AGREEMENT = 0.25  # predicted and measured tok/s within 25% of each other


def run_auto_bench(engine: Engine, documents: dict[str, list[int]], max_new_tokens: int, repeats: int,
                   out_dir: Path) -> list[Path]:
    """`documents`: name -> prompt ids (the document and its question, chat-templated)."""
    runs = {label: (mode, None, *rest) for label, (mode, *rest) in FIXED_MODES.items()}
    runs["auto"] = ("auto", None)
    per_document = {}
    for name, prompt_ids in documents.items():
        rows = decode_speeds(engine, prompt_ids, max_new_tokens, runs, repeats)
        per_document[name] = _summary(rows, len(prompt_ids), repeats)
    auto_over_plain = [doc["auto_over_plain"] for doc in per_document.values()]
    report = {
        "date": date.today().isoformat(), "device": device_label(), "model": engine.name,
        "auto_mode": engine.auto_mode, "calibrated": engine.settings.step_times is not None,
        "max_new_tokens": max_new_tokens, "repeats": repeats, "documents": per_document,
        "auto_over_plain_min": min(auto_over_plain), "auto_over_plain_median": statistics.median(auto_over_plain),
        "auto_within_noise_of_best_everywhere": all(doc["auto_within_noise_of_best"] for doc in per_document.values()),
        "prediction_within_25_percent_everywhere": all(doc["auto_prediction_error"] is not None and
                                                       abs(doc["auto_prediction_error"]) <= AGREEMENT
                                                       for doc in per_document.values()),
        "all_identical_to_plain": all(doc["all_identical_to_plain"] for doc in per_document.values()),
    }
    return write_report(report, out_dir, ("gpu" if torch.cuda.is_available() else "cpu") + "-auto", _draw_auto)


def _summary(rows: dict[str, dict], prompt_tokens: int, repeats: int) -> dict:
    fixed = {label: row for label, row in rows.items() if label != "auto"}
    best = max(fixed, key=lambda label: fixed[label]["tokens_per_second"])
    plain, auto = rows["plain"], rows["auto"]

    def runs(row):
        return row.get("tokens_per_second_runs", [row["tokens_per_second"]])

    predicted = auto["predicted_tokens_per_second"]
    return {
        "prompt_tokens": prompt_tokens, "decode": rows,
        "speedup_over_plain": {label: row["tokens_per_second"] / plain["tokens_per_second"] for label, row in rows.items()},
        "auto_over_plain": auto["tokens_per_second"] / plain["tokens_per_second"],
        "best_fixed_mode": best,
        "auto_over_best_fixed": auto["tokens_per_second"] / fixed[best]["tokens_per_second"],
        # The noise between repeats of one mode bounds what a difference can mean: auto is within
        # it when its fastest run reaches the best fixed mode's slowest, or when it ran that mode
        # through the same forwards (the same work: only the machine's timing differed).
        "auto_within_noise_of_best": max(runs(auto)) >= min(runs(fixed[best])) or _same_work(auto, fixed[best]),
        "auto_prediction_error": predicted / auto["tokens_per_second"] - 1 if predicted else None,
        "all_identical_to_plain": all(row["identical_to_plain"] for row in rows.values()),
    }


def _same_work(auto: dict, fixed: dict) -> bool:
    return auto["mode"] == fixed["mode"] and auto["target_forwards"] == fixed["target_forwards"] \
        and auto["tree_size"] == fixed["tree_size"] and auto["identical_to_plain"] and fixed["identical_to_plain"]


def _draw_auto(report: dict, plt):
    names = list(report["documents"])
    labels = list(next(iter(report["documents"].values()))["speedup_over_plain"])
    figure, axis = plt.subplots(figsize=(11, 5.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = [report["documents"][name]["speedup_over_plain"][label] for name in names]
        axis.bar([x + i * width for x in range(len(names))], values, width, label=label)
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xticks([x + 0.4 - width / 2 for x in range(len(names))],
                    [f"{name}\n{report['documents'][name]['prompt_tokens']:,} tokens" for name in names], fontsize=8)
    axis.set_ylabel("decode speed over plain (greedy, identical outputs)")
    axis.set_title(f"{report['model']} on {report['device']}: auto = {report['auto_mode']}, "
                   f"median {report['auto_over_plain_median']:.2f}x plain")
    axis.legend(fontsize=8)
    return figure
