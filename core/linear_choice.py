"""Which path each 1..FEW_ROWS-row CPU linear takes, measured on this machine for this model.

`F.linear` and the weight-first product (cpu_linear.py) compute the same thing through different
BLAS kernels, and which is faster was found to flip between two machines of the same kind (issue
42). So when a model is loaded for the CPU, both are timed at its own linear shapes for every row
count and the faster is kept: about a second for the embedded model, once, then read from a file
kept with the machine's other calibration (hardware.cache_dir / machine key / cpu-linear), keyed
by the set of shapes and the dtype (the kernels' speed depends on both).

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
import torch.nn.functional as F

from .cpu_linear import FEW_ROWS, cpu_linears, use_few_row_linear, weight_first
from .files import write_atomically

VERSION = 1  # of the choice files; bump when a field changes meaning
PATHS = ("F.linear", "weight-first")
PRODUCTS = {"F.linear": F.linear, "weight-first": weight_first}
# Weights timed per shape: whole layers of that shape up to this many bytes (a larger layer, an
# output head, a slice of its rows, scaled up). Five shapes of it are more than the 32 MB L3 of
# this project's machines, so each pass reads its weights from memory, as a forward does.
SAMPLE_BYTES = 12 * 2**20
REPEATS = 5  # interleaved rounds; their median rides out a noisy spell on a shared machine
# Weight-first must be this much faster to be used: F.linear is torch's own path, and a smaller
# gain is within what a noisy median can show.
MARGIN = 0.95
# A measurement past this is not trusted: the sample bounds a pass's bytes whatever the model, so
# it takes a second or two on a quiet machine, and ten times that only when other work holds the
# cores (seen on a shared 2-core machine: per-unit times swinging tenfold, either path "winning").
# Then F.linear is used this time and nothing is kept, so the next load measures again.
MAX_SECONDS = 5.0
CHOSEN_ATTRIBUTE = "specchat_cpu_linear"  # on the model: its layers' choice, made once

# (path, rows) -> seconds of one pass over the model's linears, a figure per shape
TimePass = Callable[[str, int], list[float]]


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
    if choice is None and calibration_enabled():
        choice = measure_choice(layers, name, time_pass)
        if choice is not None:
            write_atomically(path, json.dumps({"version": VERSION, **choice.__dict__}))
    if choice is None:
        choice = LinearChoice((), (), name)
    use_few_row_linear(model, set(choice.weight_first_rows))
    setattr(model, CHOSEN_ATTRIBUTE, choice)
    return choice


def measure_choice(layers: list[torch.nn.Linear], name: str, time_pass: TimePass | None = None,
                   repeats: int = REPEATS) -> LinearChoice | None:
    """Time both paths for 1..FEW_ROWS rows in interleaved rounds (each round alternates which
    path goes first, so drift touches both alike) and keep weight-first where its median is
    under MARGIN of F.linear's. Each shape is timed apart and its median taken apart: a unit of
    a few ms that the scheduler interrupts is one outlier among its repeats, where a whole
    pass would carry every interruption of its shapes. None: past MAX_SECONDS, not trusted."""
    time_pass = time_pass or pass_timer(layers)
    deadline = time.perf_counter() + MAX_SECONDS
    for path in PATHS:  # untimed: pages the sampled weights in, first-call setup of both kernels
        for rows in (1, 2):
            time_pass(path, rows)
    seconds: dict[tuple[str, int], list[list[float]]] = {(path, rows): [] for path in PATHS
                                                         for rows in range(1, FEW_ROWS + 1)}
    for round_ in range(repeats):
        for rows in range(1, FEW_ROWS + 1):
            for path in PATHS if (round_ + rows) % 2 else PATHS[::-1]:
                seconds[path, rows].append(time_pass(path, rows))
            if time.perf_counter() > deadline:
                return None

    def pass_seconds(path: str, rows: int) -> float:
        return sum(statistics.median(shape) for shape in zip(*seconds[path, rows]))

    ratios = tuple(pass_seconds("weight-first", rows) / pass_seconds("F.linear", rows) for rows in range(1, FEW_ROWS + 1))
    return LinearChoice(tuple(rows for rows, ratio in enumerate(ratios, 1) if ratio < MARGIN),
                        tuple(round(ratio, 3) for ratio in ratios), name, date.today().isoformat())


def pass_timer(layers: list[torch.nn.Linear]) -> TimePass:
    """A timer of one pass over `layers` as a forward runs them: for each shape, a sample of its
    layers (SAMPLE_BYTES) timed and scaled to all of that shape, so the pass costs a fraction
    of a forward while its weights still come from memory. Returns the seconds per shape."""
    samples = []  # (in_features, [(weight, bias)], scale)
    for members in _by_shape(layers).values():
        out_features, in_features = members[0].weight.shape
        layer_bytes = members[0].weight.numel() * members[0].weight.element_size()
        if layer_bytes > SAMPLE_BYTES:  # a slice of the rows: the same kernel, the same input
            kept = max(1, SAMPLE_BYTES * out_features // layer_bytes)
            bias = members[0].bias
            pairs = [(members[0].weight[:kept], None if bias is None else bias[:kept])]
            scale = len(members) * out_features / kept
        else:
            pairs = [(layer.weight, layer.bias) for layer in members[:max(1, SAMPLE_BYTES // layer_bytes)]]
            scale = len(members) / len(pairs)
        samples.append((in_features, pairs, scale))
    inputs = {(rows, width): torch.randn(1, rows, width) for rows in range(1, FEW_ROWS + 1)
              for width in {width for width, _, _ in samples}}

    @torch.inference_mode()
    def time_pass(path: str, rows: int) -> list[float]:
        product, times = PRODUCTS[path], []
        for width, pairs, scale in samples:
            x = inputs[rows, width]
            start = time.perf_counter()
            for weight, bias in pairs:
                product(x, weight, bias)
            times.append((time.perf_counter() - start) * scale)
        return times

    return time_pass


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


def _by_shape(layers: list[torch.nn.Linear]) -> dict[tuple, list[torch.nn.Linear]]:
    groups: dict[tuple, list[torch.nn.Linear]] = {}
    for layer in layers:
        groups.setdefault((*layer.weight.shape, layer.bias is not None), []).append(layer)
    return groups


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
