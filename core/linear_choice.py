"""Which path each 1..FEW_ROWS-row CPU linear takes, measured on this machine for this model.

`F.linear` and the weight-first product (cpu_linear.py) compute the same thing through different
BLAS kernels, and which is faster was found to flip between two machines of the same kind (issue
42). So when a model is loaded for the CPU, both are timed in the model's own forwards of 1..FEW_ROWS
tokens and the faster is kept per token count: about five seconds for the embedded model, once,
then read from a file kept with the machine's other calibration (hardware.cache_dir / machine
key / cpu-linear), keyed by the set of shapes and the dtype (the kernels' speed depends on both).
Whole forwards, not the layers timed apart: F.linear's time per byte depends on the matrix's size
and on what ran before it, so samples of the layers chose F.linear for 6-8 rows on a machine where
those forwards ran 1.1-1.6x faster weight-first (bench/notes/cpu-linear-choice.md).

`SPECCHAT_CALIBRATE=0` measures nothing: a choice measured before is still used, else plain
`F.linear` everywhere, the path torch itself takes, that is never much slower than the other;
weight-first was up to 1.8x slower where it lost, and gained at most about 1.5x where it won.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from .cpu_linear import FEW_ROWS, cpu_linears, use_few_row_linear
from .files import write_atomically

# Of the choice files; bump when a field changes meaning or the measurement what it finds
# (2: whole forwards instead of samples of the layers, 2026-11-29).
VERSION = 2
PATHS = ("F.linear", "weight-first")
REPEATS = 3  # interleaved rounds; their median rides out a noisy spell on a shared machine
# Weight-first must be this much faster to be used: F.linear is torch's own path, and a smaller
# gain is within what a noisy median can show.
MARGIN = 0.95
# A measurement past this is not trusted (seen on a shared 2-core machine: times swinging tenfold,
# either path "winning"), nor begun for a model whose forwards would not fit in it (fp32 weights
# only come to the CPU for small models: larger ones load in bf16, which has kernels of its own).
# Then F.linear is used this time and nothing is kept, so the next load measures again.
MAX_SECONDS = 10.0
CHOSEN_ATTRIBUTE = "specchat_cpu_linear"  # on the model: its layers' choice, made once

# (path, rows) -> seconds of one forward of `rows` tokens through that path
TimePass = Callable[[str, int], float]


@dataclass(frozen=True)
class LinearChoice:
    """The rows that go weight-first, and what was measured (ratios: weight-first time over
    F.linear time for 1..FEW_ROWS rows; empty when nothing was measured)."""

    weight_first_rows: tuple[int, ...]
    ratios: tuple[float, ...]
    model: str
    measured_on: str = ""

    def describe(self) -> str:
        if not self.ratios:
            return f"F.linear for 1-{FEW_ROWS} rows (torch's own path: not measured on this machine)"
        linear_rows = [rows for rows in range(1, FEW_ROWS + 1) if rows not in self.weight_first_rows]
        parts = []
        if self.weight_first_rows:
            parts.append(f"weight-first for {_rows_text(self.weight_first_rows)} rows "
                         f"({_span(self.ratios, self.weight_first_rows)}x the time of F.linear)")
        if linear_rows:
            parts.append(f"F.linear for {_rows_text(linear_rows)} rows "
                         f"(weight-first {_span(self.ratios, linear_rows)}x its time here)")
        return "; ".join(parts)


def choose_cpu_linear(model: torch.nn.Module, time_pass: TimePass | None = None) -> LinearChoice | None:
    """Install this machine's faster path per row count in `model`'s fp32 CPU linears: from the
    cache, else measured now (with calibration on), else plain F.linear. None: no such layers.
    A model that shares its layers with one chosen before (a layer-skip draft is a shallow copy)
    keeps that choice: its layers must not switch under the model they belong to."""
    chosen = getattr(model, CHOSEN_ATTRIBUTE, None)
    if chosen is not None:
        return chosen
    layers = cpu_linears(model)
    if not layers:
        return None
    from .step_calibration import calibration_enabled  # the one switch for all measuring

    path = choice_path(layers)
    name = Path(str(getattr(getattr(model, "config", None), "name_or_path", "") or "model")).name
    choice = read_choice(path)
    if choice is None and calibration_enabled() and _all_on_cpu(model):
        choice = measure_choice(name, time_pass or forward_timer(model))
        if choice is not None:
            write_atomically(path, json.dumps({"version": VERSION, **choice.__dict__}))
    if choice is None:
        choice = LinearChoice((), (), name)
    use_few_row_linear(model, set(choice.weight_first_rows))
    setattr(model, CHOSEN_ATTRIBUTE, choice)
    return choice


def measure_choice(name: str, time_pass: TimePass, repeats: int = REPEATS) -> LinearChoice | None:
    """Time both paths for 1..FEW_ROWS rows in interleaved rounds (each round alternates which
    path goes first, so drift touches both alike) and keep weight-first where its median is
    under MARGIN of F.linear's. None: past MAX_SECONDS, or sure to be, not trusted."""
    start = time.perf_counter()
    deadline = start + MAX_SECONDS
    warm_ups = [(path, rows) for path in PATHS for rows in (1, 2)]
    for path, rows in warm_ups:  # untimed: pages the weights in, first-call setup of both kernels
        time_pass(path, rows)
    timed_calls = repeats * FEW_ROWS * len(PATHS)
    if (time.perf_counter() - start) / len(warm_ups) * timed_calls > MAX_SECONDS:
        return None
    seconds: dict[tuple[str, int], list[float]] = {(path, rows): [] for path in PATHS
                                                   for rows in range(1, FEW_ROWS + 1)}
    for round_ in range(repeats):
        for rows in range(1, FEW_ROWS + 1):
            for path in PATHS if (round_ + rows) % 2 else PATHS[::-1]:
                seconds[path, rows].append(time_pass(path, rows))
            if time.perf_counter() > deadline:
                return None

    def median(path: str, rows: int) -> float:
        return statistics.median(seconds[path, rows])

    ratios = tuple(median("weight-first", rows) / median("F.linear", rows) for rows in range(1, FEW_ROWS + 1))
    return LinearChoice(tuple(rows for rows, ratio in enumerate(ratios, 1) if ratio < MARGIN),
                        tuple(round(ratio, 3) for ratio in ratios), name, date.today().isoformat())


def forward_timer(model: torch.nn.Module) -> TimePass:
    """A timer of `model`'s own forward of `rows` tokens with no past (its linears are most of
    it, the output head's rows included, as in a verification) through the given path."""
    ids = torch.randint(model.config.vocab_size, (1, FEW_ROWS), generator=torch.Generator().manual_seed(0))
    every_row = set(range(1, FEW_ROWS + 1))

    @torch.inference_mode()
    def time_pass(path: str, rows: int) -> float:
        use_few_row_linear(model, every_row if path == "weight-first" else set())
        start = time.perf_counter()
        model(input_ids=ids[:, :rows], use_cache=False)
        return time.perf_counter() - start

    return time_pass


def _all_on_cpu(model: torch.nn.Module) -> bool:
    """Whether a forward of `model` times only the CPU (a model split across devices keeps F.linear)."""
    return all(parameter.device.type == "cpu" for parameter in model.parameters())


def choice_path(layers: list[torch.nn.Linear]) -> Path:
    """Where the choice for these layers' shapes is kept on this machine. The set of shapes, not
    their counts: a layer-skip draft of a model finds the model's choice. Not torch's thread
    count either: DSI's instances (speculative/dsi/pool.py) run the same model in processes of
    fewer threads, and they read the choice the main process measured instead of measuring
    at once, side by side, and perhaps choosing another path than it for the same model."""
    from .hardware import cache_dir, probe_key

    shapes = sorted({(*layer.weight.shape, layer.bias is not None) for layer in layers})
    key = json.dumps([shapes, str(layers[0].weight.dtype)])
    return cache_dir() / probe_key() / "cpu-linear" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def read_choice(path: Path) -> LinearChoice | None:
    """The choice kept at `path`, or None (missing, old or damaged: measured again, never trusted)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.pop("version") != VERSION:
            return None
        choice = LinearChoice(tuple(data["weight_first_rows"]), tuple(data["ratios"]), data["model"], data["measured_on"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return choice if len(choice.ratios) == FEW_ROWS and set(choice.weight_first_rows) <= set(range(1, FEW_ROWS + 1)) else None


def saved_choices(machine_folder: Path) -> list[LinearChoice]:
    """The choices measured on the machine of `machine_folder` (for `specchat profile`)."""
    found = (read_choice(path) for path in sorted((machine_folder / "cpu-linear").glob("*.json")))
    return [choice for choice in found if choice is not None]


def _rows_text(rows) -> str:
    """1, 2, 3, 5 -> "1-3, 5"."""
    runs: list[list[int]] = []
    for row in sorted(rows):
        if runs and row == runs[-1][-1] + 1:
            runs[-1].append(row)
        else:
            runs.append([row])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _span(ratios: tuple[float, ...], rows) -> str:
    picked = [ratios[row - 1] for row in rows]
    low, high = min(picked), max(picked)
    return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}"
