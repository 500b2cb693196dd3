"""The peers benchmark (`specchat bench --suite peers`): what the same model gives a user outside
specchat on this machine, beside specchat. transformers' own greedy `generate` and its prompt
lookup (3 and 10 tokens, the documented default and a long one) against specchat plain and auto,
on several documents, in shuffled rounds, one process. Decode tok/s counts the new tokens over
the time from the first new token to the last, as specchat's Stats do; transformers' times come
from a streamer. Issue 42's bar: plain >= HF greedy, auto >= 1.3x the better HF prompt lookup."""

from __future__ import annotations

import random
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from ..core.engine import Engine
from .decode import timed_answer
from .report import device_label, write_report

HF_RUNS = {"HF greedy": None, "HF prompt lookup (3)": 3, "HF prompt lookup (10)": 10}
SPECCHAT_RUNS = {"specchat plain": ("plain", None), "specchat auto": ("auto", None)}
AUTO_OVER_LOOKUP_GOAL = 1.3


class _Clock:
    """A `generate` streamer that timestamps each put of new tokens (the first put is the prompt)."""

    def __init__(self):
        self.prompt_seen = False
        self.tokens: list[int] = []
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.extend(value.flatten().tolist())

    def end(self) -> None:
        pass


def hf_answer(hf_model, prompt_ids: list[int], max_new_tokens: int, lookup: int | None) -> tuple[list[int], float]:
    """transformers' greedy answer (with prompt lookup of `lookup` tokens, if given) and its decode tok/s."""
    clock = _Clock()
    ids = torch.tensor([prompt_ids])
    options = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    eos = hf_model.generation_config.eos_token_id
    with torch.no_grad():
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          streamer=clock, pad_token_id=eos[0] if isinstance(eos, list) else eos, **options)
    seconds = clock.times[-1] - clock.times[0] if len(clock.times) > 1 else 0.0
    return clock.tokens, len(clock.tokens) / seconds if seconds > 0 else 0.0


def run_peers_bench(engine: Engine, hf_model, documents: dict[str, list[int]], max_new_tokens: int,
                    repeats: int, out_dir: Path, seed: int = 0) -> list[Path]:
    """`hf_model`: the same weights loaded by transformers as it ships (its own attention and
    linears); `documents`: name -> prompt ids (the document and its question, chat-templated)."""
    labels = list(SPECCHAT_RUNS) + list(HF_RUNS)
    order = random.Random(seed)
    per_document = {}
    for name, prompt_ids in documents.items():
        speeds: dict[str, list[float]] = {label: [] for label in labels}
        tokens: dict[str, list[int]] = {}
        for round_index in range(repeats):
            for label in labels if round_index == 0 else order.sample(labels, len(labels)):
                if label in HF_RUNS:
                    answer, speed = hf_answer(hf_model, prompt_ids, max_new_tokens, HF_RUNS[label])
                else:
                    result = timed_answer(engine, prompt_ids, max_new_tokens, SPECCHAT_RUNS[label])
                    answer, speed = result.token_ids, result.stats.tokens_per_second
                tokens.setdefault(label, answer)
                speeds[label].append(speed)
        per_document[name] = _summary(speeds, tokens, len(prompt_ids))
    report = {
        "date": date.today().isoformat(), "device": device_label(), "model": engine.name,
        "auto_mode": engine.auto_mode, "max_new_tokens": max_new_tokens, "repeats": repeats,
        "documents": per_document,
        "plain_at_least_hf_greedy_everywhere": all(d["plain_over_hf_greedy"] >= 1.0 for d in per_document.values()),
        "auto_over_best_hf_lookup_min": min(d["auto_over_best_hf_lookup"] for d in per_document.values()),
        "auto_goal_met_everywhere": all(d["auto_over_best_hf_lookup"] >= AUTO_OVER_LOOKUP_GOAL
                                        for d in per_document.values()),
        "auto_identical_to_plain_everywhere": all(d["auto_identical_to_plain"] for d in per_document.values()),
    }
    return write_report(report, out_dir, ("gpu" if torch.cuda.is_available() else "cpu") + "-peers", _draw_peers)


def _summary(speeds: dict[str, list[float]], tokens: dict[str, list[int]], prompt_tokens: int) -> dict:
    median = {label: statistics.median(runs) for label, runs in speeds.items()}
    best_lookup = max(("HF prompt lookup (3)", "HF prompt lookup (10)"), key=median.get)
    return {
        "prompt_tokens": prompt_tokens,
        "tokens_per_second": median, "tokens_per_second_runs": speeds,
        "new_tokens": {label: len(answer) for label, answer in tokens.items()},
        "plain_over_hf_greedy": median["specchat plain"] / median["HF greedy"],
        "best_hf_lookup": best_lookup,
        "auto_over_best_hf_lookup": median["specchat auto"] / median[best_lookup],
        "auto_identical_to_plain": tokens["specchat auto"] == tokens["specchat plain"],
        # The same fp32 weights through different kernels: equal unless a near-tie flips.
        "hf_greedy_equals_specchat_plain": tokens["HF greedy"] == tokens["specchat plain"],
    }


def _draw_peers(report: dict, plt):
    documents = list(report["documents"])
    labels = list(SPECCHAT_RUNS) + list(HF_RUNS)
    figure, axes = plt.subplots(figsize=(max(8, 2.2 * len(documents)), 5))
    width = 0.8 / len(labels)
    for index, label in enumerate(labels):
        values = [report["documents"][name]["tokens_per_second"][label] for name in documents]
        axes.bar([d + index * width for d in range(len(documents))], values, width, label=label)
    axes.set_xticks([d + 0.4 - width / 2 for d in range(len(documents))], documents, fontsize=8)
    axes.set_ylabel("decode tokens per second (median)")
    axes.set_title(f"{report['model']} on {report['device']}, greedy, {report['max_new_tokens']} new tokens, "
                   f"{report['repeats']} shuffled rounds", fontsize=9)
    axes.legend(fontsize=8)
    return figure
