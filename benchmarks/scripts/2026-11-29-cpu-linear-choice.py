"""Whether the load-time choice of the few-row CPU linear path (core/linear_choice.py) finds what
forwards in an answer show: the embedded model's 1-8-token forwards after a 2K context through
`F.linear` and weight-first (interleaved rounds, medians), against the ratios the choice measures
now (whole forwards with no past) and as it measured them before 2026-11-29 (each layer shape
timed apart on 12 MB samples, the output head sliced to 12 MB: `_sampled_timer` below, as it
was). Successor of 2026-11-28-cpu-linear-choice.py (its result stays in bench/).
Run: SPECCHAT_CALIBRATE=0 .venv/bin/python benchmarks/scripts/2026-11-29-cpu-linear-choice.py
"""

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specchat.benchmarks.report import device_label
from specchat.core import embedded
from specchat.core.cpu_linear import FEW_ROWS, cpu_linears, use_few_row_linear, weight_first
from specchat.core.linear_choice import forward_timer, measure_choice
from specchat.core.model import TransformersLM

CONTEXT, ROUNDS, CHOICES, SAMPLE_BYTES = 2048, 7, 3, 12 * 2**20
SIZES = tuple(range(1, FEW_ROWS + 1))
PATHS = {"F.linear": set(), "weight-first": set(SIZES)}


def _sampled_timer(layers):
    """The choice's timer before 2026-11-29: per shape, whole layers up to 12 MB or a 12 MB slice
    of a larger one's rows, timed apart and scaled to the shape's layers (summed here)."""
    shapes = {}
    for layer in layers:
        shapes.setdefault((*layer.weight.shape, layer.bias is not None), []).append(layer)
    samples = []
    for members in shapes.values():
        out_features, in_features = members[0].weight.shape
        layer_bytes = members[0].weight.numel() * 4
        if layer_bytes > SAMPLE_BYTES:
            kept = max(1, SAMPLE_BYTES * out_features // layer_bytes)
            samples.append((in_features, [(members[0].weight[:kept], None if members[0].bias is None
                                           else members[0].bias[:kept])], len(members) * out_features / kept))
        else:
            pairs = [(layer.weight, layer.bias) for layer in members[:max(1, SAMPLE_BYTES // layer_bytes)]]
            samples.append((in_features, pairs, len(members) / len(pairs)))
    products = {"F.linear": F.linear, "weight-first": weight_first}

    @torch.inference_mode()
    def time_pass(path, rows):
        total = 0.0
        for width, pairs, scale in samples:
            x = torch.randn(1, rows, width)
            start = time.perf_counter()
            for weight, bias in pairs:
                products[path](x, weight, bias)
            total += (time.perf_counter() - start) * scale
        return total

    return time_pass


def main() -> None:
    model = TransformersLM.from_pretrained(embedded.ensure_converted())
    ids = torch.randint(model.vocab_size, (CONTEXT + FEW_ROWS,), generator=torch.Generator().manual_seed(0))
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
    median = {key: statistics.median(value) for key, value in seconds.items()}
    timers = {"whole forwards, no past (now)": forward_timer(model.hf),
              "layer shapes apart, 12 MB samples (before)": _sampled_timer(cpu_linears(model.hf))}
    measured = {label: [] for label in timers}
    for _ in range(CHOICES):
        for label, timer in timers.items():
            begin = time.perf_counter()
            choice = measure_choice("embedded", timer)
            measured[label].append({"seconds": round(time.perf_counter() - begin, 2),
                                    "weight_first_rows": choice.weight_first_rows if choice else None,
                                    "ratios": choice.ratios if choice else None})
    use_few_row_linear(model.hf, set())
    report = {"date": "2026-11-29", "device": device_label(), "load_average": os.getloadavg(), "context": CONTEXT,
              "rounds": ROUNDS, "forward_ms": {f"{path} n={n}": round(median[path, n] * 1e3, 1) for path, n in median},
              "forward_ms_all": {f"{path} n={n}": [round(s * 1e3, 1) for s in v] for (path, n), v in seconds.items()},
              "in_an_answer_weight_first_over_F_linear": {n: round(median["weight-first", n] / median["F.linear", n], 2)
                                                          for n in SIZES},
              "load_time_measurement": measured}
    out = Path(__file__).parents[2] / "bench" / "2026-11-29-cpu-linear-choice.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "forward_ms_all"}, indent=1))


if __name__ == "__main__":
    main()
