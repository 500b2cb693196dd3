"""The document presets' sampling (temperature 0.7, top-p 0.9, repetition penalty 1.1) before and
after `warp` stopped sorting the whole vocabulary for top-p, computing the penalties over every
column and dividing in float64: plain, chain and tree answers to two documents on the embedded
model, both versions in one process, rounds alternating which goes first.

The old `warp` is swapped in by its code (every module imported the same function object) with
the old penalty and top-p helpers beside it. Sampled answers differ between the versions (the
arithmetic rounds differently), so the comparison is tok/s per mode and speculation's tokens per
forward, not tokens.
Run: SPECCHAT_CALIBRATE=0 .venv/bin/python benchmarks/scripts/2026-11-28-cpu-sampled-warp.py \\
     > bench/2026-11-28-cpu-sampled-warp.json"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

import torch

from specchat.app.documents import user_turn
from specchat.app.presets import DOCUMENT_SAMPLING
from specchat.core import sampling
from specchat.core.engine import Finished
from specchat.core.loading import load_engine
from specchat.core.request import Request
from specchat.core.sampling import SamplingParams

DOCUMENTS = ("tests/data/documents/lgpl-2.1.txt", "tests/data/documents/numpy-ma-readme.rst")
MODES = ("plain", "chain", "tree")
ROUNDS, NEW_TOKENS = 2, 128


def old_top_p_filter(probs, top_p):
    sorted_probs, order = probs.sort(-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


def old_warp(logits, params, counts=None):
    logits = logits.float()
    if params.penalized:
        if counts is None:
            raise ValueError("repetition penalties need each row's counts of the tokens seen before it")
        logits = apply_penalties(logits, counts, params)  # noqa: F821 - resolved in core.sampling's globals
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = ((logits - logits.amax(-1, keepdim=True)).double() / params.temperature).float()
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)  # noqa: F821
    return probs


NEW = (sampling.warp.__code__, sampling.apply_penalties, sampling._top_p_filter)
# The old penalties: today's arithmetic (`_penalties`) over every column of the vocabulary.
OLD = (old_warp.__code__, sampling._penalties, old_top_p_filter)


def use(version) -> None:
    sampling.warp.__code__, sampling.apply_penalties, sampling._top_p_filter = version


def main() -> None:
    engine = load_engine("embedded", progress=lambda line: None)
    params = SamplingParams(seed=0, **DOCUMENT_SAMPLING)
    speeds = {(doc, version, mode): [] for doc in DOCUMENTS for version in ("old", "new") for mode in MODES}
    per_forward = {key: [] for key in speeds}
    for round_index in range(ROUNDS):
        for doc in DOCUMENTS:
            text = Path(doc).read_text(encoding="utf-8")
            prompt = engine.chat_ids([{"role": "user", "content": user_turn("Summarize this document.", text)}])
            for version in (("old", "new") if round_index % 2 == 0 else ("new", "old")):
                use(OLD if version == "old" else NEW)
                for mode in MODES:
                    engine.answers.clear()
                    events = engine.generate(prompt, Request(NEW_TOKENS, params, mode, None))
                    result = next(event.result for event in events if isinstance(event, Finished))
                    speeds[doc, version, mode].append(result.stats.tokens_per_second)
                    per_forward[doc, version, mode].append(result.stats.mean_accepted_per_forward)
                    print(round_index, doc, version, mode, f"{result.stats.tokens_per_second:.2f}", file=sys.stderr)
    use(NEW)
    summary = {}
    for doc in DOCUMENTS:
        rows = {}
        for mode in MODES:
            old, new = (statistics.median(speeds[doc, version, mode]) for version in ("old", "new"))
            rows[mode] = {"old_tokens_per_s": round(old, 2), "new_tokens_per_s": round(new, 2),
                          "new_over_old": round(new / old, 3),
                          "tokens_per_forward_old": round(statistics.median(per_forward[doc, "old", mode]), 2),
                          "tokens_per_forward_new": round(statistics.median(per_forward[doc, "new", mode]), 2)}
        summary[Path(doc).name] = rows
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    json.dump({"what": __doc__.split("\nRun:")[0], "date": date.today().isoformat(), "commit": commit,
               "device": f"CPU, {torch.get_num_threads()} threads", "model": engine.name,
               "sampling": DOCUMENT_SAMPLING, "seed": 0, "max_new_tokens": NEW_TOKENS, "rounds": ROUNDS,
               "summary": summary,
               "runs": {" / ".join(key): value for key, value in speeds.items()}}, sys.stdout, indent=1)
    print(file=sys.stdout)


if __name__ == "__main__":
    main()
