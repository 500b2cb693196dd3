"""Few-row linear layers on the CPU (core/cpu_linear.py): what a forward of n tokens costs with
`FewRowLinear` as it is now, as it was before 2026-11-23's change (weight-first for 2-4 rows
only, output left a transposed view), and with transformers' own `F.linear` everywhere; then
greedy plain decoding of a 2.3K-token document with each. Rounds alternate the variants, so
the machine's drift touches them alike. Run: .venv/bin/python benchmarks/scripts/2026-11-23-cpu-few-row-linear.py
"""

import json
import statistics
import time
from pathlib import Path

import torch

from specchat.app.documents import user_turn
from specchat.core import cpu_linear
from specchat.benchmarks.decode import timed_answer
from specchat.benchmarks.report import device_label
from specchat.core.loading import load_engine

SIZES = [1, 2, 3, 4, 5, 6, 8, 12, 17]
CONTEXTS = [2048, 7600]
ROUNDS = 10
DOCUMENT = Path(__file__).parent.parent / "tests" / "data" / "apache-2.0.txt"


def before(self, x):
    """FewRowLinear.forward as it was: 2-4 rows weight-first, the output a transposed view."""
    rows = x.numel() // x.shape[-1]
    if not 1 < rows <= 4:
        return torch.nn.Linear.forward(self, x)
    out = (self.weight @ x.reshape(rows, x.shape[-1]).T).T
    return out.reshape(*x.shape[:-1], self.out_features)


VARIANTS = {"now": cpu_linear.FewRowLinear.forward, "before": before, "F.linear": torch.nn.Linear.forward}


def forward_times(model, context: int) -> dict:
    ids = torch.randint(model.vocab_size, (context + max(SIZES),), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    for start in range(0, context, 1024):
        end = min(context, start + 1024)
        model.forward(ids[start:end], torch.arange(start, end), cache, last_only=True)
    seconds = {(v, n): [] for v in VARIANTS for n in SIZES}
    for _ in range(ROUNDS):
        for variant, n in seconds:
            cpu_linear.FewRowLinear.forward = VARIANTS[variant]
            begin = time.perf_counter()
            model.forward(ids[context:context + n], torch.arange(context, context + n), cache)
            seconds[(variant, n)].append(time.perf_counter() - begin)
            cache.trim(context)
    median = {key: statistics.median(value) for key, value in seconds.items()}
    return {variant: {"one_token_ms": round(median[(variant, 1)] * 1000, 1),
                      "t_ratios": {n: round(median[(variant, n)] / median[(variant, 1)], 2) for n in SIZES},
                      "ms_over_F_linear_one_token": {n: round(median[(variant, n)] / median[("F.linear", 1)], 2)
                                                     for n in SIZES}}
            for variant in VARIANTS}


def main() -> None:
    engine = load_engine("embedded")
    report = {"date": "2026-11-23", "device": device_label(), "model": engine.name, "rounds": ROUNDS,
              "forwards": {str(c): forward_times(engine.model, c) for c in CONTEXTS}}
    prompt = engine.chat_ids([{"role": "user", "content": user_turn("Summarize this document.", DOCUMENT.read_text())}])
    speeds, answers = {v: [] for v in VARIANTS}, {}
    for _ in range(3):
        for variant in VARIANTS:
            cpu_linear.FewRowLinear.forward = VARIANTS[variant]
            result = timed_answer(engine, prompt, 64, ("plain", None))
            speeds[variant].append(round(result.stats.tokens_per_second, 2))
            answers[variant] = result.token_ids
    report["plain_decoding"] = {"document": DOCUMENT.name, "prompt_tokens": len(prompt), "new_tokens": 64,
                                "tokens_per_second_runs": speeds,
                                "median_over_F_linear": {v: round(statistics.median(s) / statistics.median(speeds["F.linear"]), 2)
                                                         for v, s in speeds.items()},
                                "same_tokens": len({tuple(a) for a in answers.values()}) == 1}
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
