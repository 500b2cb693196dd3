"""The few-row CPU linear path chosen per machine (core/linear_choice.py, issue 42): the embedded
model's 1- and 4-token forwards at a 2K context through `F.linear` and weight-first, in rounds
that alternate which goes first (medians), then what the load-time measurement chooses here and
how long it takes. Run: SPECCHAT_CALIBRATE=0 .venv/bin/python benchmarks/scripts/2026-11-28-cpu-linear-choice.py
"""

import json
import os
import statistics
import time
from pathlib import Path

import torch

from specchat.benchmarks.report import device_label
from specchat.core import embedded
from specchat.core.cpu_linear import FEW_ROWS, cpu_linears, use_few_row_linear
from specchat.core.linear_choice import measure_choice
from specchat.core.model import TransformersLM

CONTEXT, SIZES, ROUNDS, CHOICES = 2048, (1, 4, 8), 15, 3
PATHS = {"F.linear": set(), "weight-first": set(range(1, FEW_ROWS + 1))}


def main() -> None:
    model = TransformersLM.from_pretrained(embedded.ensure_converted())
    ids = torch.randint(model.vocab_size, (CONTEXT + max(SIZES),), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    for start in range(0, CONTEXT, 1024):
        model.forward(ids[start:start + 1024], torch.arange(start, start + 1024), cache, last_only=True)
    seconds = {(path, n): [] for path in PATHS for n in SIZES}
    for round_ in range(ROUNDS):
        for path in (list(PATHS) if round_ % 2 else list(PATHS)[::-1]):
            use_few_row_linear(model.hf, PATHS[path])
            for n in SIZES:
                begin = time.perf_counter()
                model.forward(ids[CONTEXT:CONTEXT + n], torch.arange(CONTEXT, CONTEXT + n), cache)
                seconds[path, n].append(time.perf_counter() - begin)
                cache.trim(CONTEXT)
    use_few_row_linear(model.hf, set())
    median = {key: statistics.median(value) for key, value in seconds.items()}
    choices = []
    for _ in range(CHOICES):
        begin = time.perf_counter()
        choice = measure_choice(cpu_linears(model.hf), "embedded")
        choices.append({"seconds": round(time.perf_counter() - begin, 2),
                        "chosen": choice.describe() if choice else "not trusted (past its deadline)",
                        "ratios": choice.ratios if choice else None})
    report = {"date": "2026-11-28", "device": device_label(), "load_average": os.getloadavg(), "context": CONTEXT,
              "rounds": ROUNDS, "forward_ms": {f"{path} n={n}": round(median[path, n] * 1e3, 1) for path, n in median},
              "forward_ms_all": {f"{path} n={n}": [round(s * 1e3, 1) for s in v] for (path, n), v in seconds.items()},
              "weight_first_over_F_linear": {n: round(median["weight-first", n] / median["F.linear", n], 2) for n in SIZES},
              "load_time_measurement": choices}
    out = Path(__file__).parents[2] / "bench" / "2026-11-28-cpu-linear-choice.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "forward_ms_all"}, indent=1))


if __name__ == "__main__":
    main()
