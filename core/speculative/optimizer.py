"""Sequoia's hardware-aware tree optimizer (algorithms.md section 4; seed 000, section 3.3).

Speedup(n, d) = G(n, d) / (t(n) + d c)   (equation 1)

- G(n, d): expected tokens per verification of the best tree with n nodes (root included) and
  depth <= d, from the tree DP (tree_dp.best_scores).
- t(n): the target's time to verify n tokens in one forward, divided by its time for 1 token,
  measured on this machine at a given context length (measure_forward_times). t(1) = 1.
- c: the drafter's time for one draft step (one tree level), divided by the target's 1-token time.
  A tree of depth d costs d draft steps.

Both times are relative to one plain decoding step, so Speedup is tokens per unit of plain-step
time: plain decoding (n = 1, d = 0, G = 1) scores exactly 1.
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator

import torch

from .forward_times import ForwardTimes
from .tree_dp import best_scores

if TYPE_CHECKING:  # core.model imports transformers: seconds that `models list` and `plan` need not pay
    from ..model import CausalLM

# Tokens per forward while filling the context a measurement runs after: bounds the activations
# (a measurement detail; the engine's own prompt reads use its settings' prefill_chunk).
FILL_CHUNK = 1024


def speedup(expected_tokens: float, verify_time: float, draft_steps: int,
            draft_cost: float) -> float:
    """G / (t(n) + d c): expected_tokens G per verification, verify_time t(n) and draft_cost c in
    units of one target 1-token forward, draft_steps d. Plain decoding: speedup(1, 1, 0, c) = 1."""
    return expected_tokens / (verify_time + draft_steps * draft_cost)


def relative_times(times: ForwardTimes, n: torch.Tensor) -> torch.Tensor:
    """`times.relative` over a tensor of sizes, in float64: the same interpolation, vectorized."""
    sizes = torch.tensor(times.sizes, dtype=torch.float64)
    ratios = torch.tensor(times.ratios, dtype=torch.float64)
    x = n.to(torch.float64).clamp(min=1.0)
    if len(times.sizes) == 1:
        return torch.ones_like(x)
    i = torch.searchsorted(sizes, x, right=True).clamp(1, len(times.sizes) - 1)
    slope = (ratios[i] - ratios[i - 1]) / (sizes[i] - sizes[i - 1])
    slope = torch.where(x > sizes[-1], slope.clamp(min=0.0), slope)
    return ratios[i] + slope * (x - sizes[i])


def measure_forward_times(model: CausalLM, context: int, sizes: list[int],
                          repeats: int) -> ForwardTimes:
    """Measure t(n) for n in `sizes` (1 is always added) after a cache of `context` random tokens
    (`forward_time_steps` run to its end)."""
    steps = forward_time_steps(model, context, sizes, repeats)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def forward_time_steps(model: CausalLM, context: int, sizes: list[int],
                       repeats: int) -> Generator[None, None, ForwardTimes]:
    """Measure t(n) for n in `sizes` (1 is always added) after a cache of `context` random tokens,
    yielding after every forward (a caller may pause between them, or close the measurement and
    free its cache); returns the `ForwardTimes`.

    Each size gets one untimed warm-up forward (allocations, kernel selection), then `repeats`
    timed ones, in rounds over the sizes; t(n) = fastest time(n) / fastest time(1). The forwards
    attend causally: a tree mask changes which keys are visible, not how many are computed
    (though on a GPU an explicit mask can select another attention kernel). After every forward the cache is trimmed back to
    `context`, so each measurement sees the same context and nothing is left behind.
    """
    sizes = sorted({1, *sizes})
    if sizes[0] < 1 or repeats < 1 or context < 0:
        raise ValueError("sizes must be >= 1, repeats >= 1 and context >= 0")
    if context + sizes[-1] > model.context_length:
        raise ValueError(f"context {context} + {sizes[-1]} tokens exceeds the model's "
                         f"{model.context_length} positions")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(model.vocab_size, (context + sizes[-1],), generator=generator)
    cache = model.new_cache()
    for start in range(0, context, FILL_CHUNK):
        end = min(context, start + FILL_CHUNK)
        model.forward(ids[start:end], torch.arange(start, end), cache, last_only=True)
        yield

    def timed(n: int) -> tuple[float, torch.device]:
        begin = time.perf_counter()
        logits = model.forward(ids[context:context + n], torch.arange(context, context + n), cache)
        logits[-1, -1].item()  # reading a value waits for an asynchronous (GPU) forward to finish
        elapsed = time.perf_counter() - begin
        cache.trim(context)
        return elapsed, logits.device

    for n in sizes:
        device = timed(n)[1]  # the warm-ups
        yield
    # Rounds over the sizes rather than each size's repeats in a row: a slow spell of the machine
    # then touches every size alike instead of skewing the ratios (timed one size after another,
    # a 2,261-token context once gave t(2) = 0.87, t(1) caught in such a spell).
    samples = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            samples[n].append(timed(n)[0])
            yield  # a pause here falls between timed forwards, never inside one
    # The fastest of each size's forwards: a busy machine only ever adds time, and a median of three
    # still takes a busy spell that caught two of them.
    fastest = {n: min(samples[n]) for n in sizes}
    unit = fastest[1]
    return ForwardTimes(sizes=tuple(sizes), ratios=tuple(fastest[n] / unit for n in sizes),
                        one_token_seconds=unit, context=context,
                        device=_describe(torch.device(getattr(model, "device", device))))  # logits come back on the CPU


@dataclass(frozen=True)
class TreeChoice:
    """A point of the (n, d) grid, or plain decoding (n = 1, d = 0), and why it was chosen."""

    size: int  # n: tree nodes, root included (tokens per verification forward); 1 = no speculation
    depth: int  # d: draft steps per verification
    expected_tokens: float  # G(n, d)
    speedup: float  # G(n, d) / (t(n) + d c), over plain decoding
    reason: str  # one line with the numbers behind the choice


def choose_tree(acceptance: list[float] | torch.Tensor, times: ForwardTimes, draft_cost: float,
                max_size: int, max_depth: int) -> TreeChoice:
    """The (n, d) maximizing Speedup(n, d) over 2 <= n <= max_size, 1 <= d <= max_depth, or plain
    decoding (n = 1, d = 0, speedup 1) if no tree beats it. Ties go to the smaller depth, then size,
    so the best tree of the chosen (n, d) needs exactly d draft steps."""
    _check_grid(max_size, max_depth, draft_cost)
    verify = relative_times(times, torch.arange(max_size + 1))
    best = None  # (speedup, n, d, G)
    previous = None
    for depth in range(1, max_depth + 1):
        g = best_scores(acceptance, max_size, depth)
        if previous is not None and torch.equal(g, previous):
            break  # the depth bound binds no more: deeper trees score the same and draft longer
        previous = g
        candidate = _best_size(g, verify, depth, draft_cost)
        if best is None or candidate[0] > best[0]:
            best = candidate
    return _decide(best, f"tree n={best[1]}, d={best[2]}", times, draft_cost)


def chain_choice(acceptance: list[float] | torch.Tensor, times: ForwardTimes, draft_cost: float,
                 max_length: int) -> TreeChoice:
    """The best single chain of g <= max_length draft tokens (n = g + 1, d = g), for comparison:
    G = sum_{i=0..g} p_1^i (the root is p_1^0). Plain decoding if no chain beats it."""
    _check_grid(max_length + 1, max_length, draft_cost)
    p1 = torch.as_tensor(acceptance, dtype=torch.float64).flatten()[:1]
    # With one child allowed per node, the only tree of n nodes is the chain of n - 1 drafts.
    g = best_scores(p1, max_length + 1, max_length)
    sizes = torch.arange(max_length + 2, dtype=torch.float64)  # int64 * float would be float32
    rates = g[2:] / (relative_times(times, sizes[2:]) + (sizes[2:] - 1) * draft_cost)
    n = int(rates.argmax()) + 2
    best = (float(rates[n - 2]), n, n - 1, float(g[n]))
    return _decide(best, f"chain of {n - 1} drafts", times, draft_cost)


def _check_grid(max_size: int, max_depth: int, draft_cost: float) -> None:
    if max_size < 2 or max_depth < 1:
        raise ValueError("a search needs max_size >= 2 (root + 1 draft) and max_depth >= 1")
    if not 0 <= draft_cost < math.inf:
        raise ValueError(f"draft_cost must be finite and >= 0, got {draft_cost}")


def _best_size(g: torch.Tensor, verify: torch.Tensor, depth: int,
               draft_cost: float) -> tuple[float, int, int, float]:
    """(speedup, n, depth, G) of the best n >= 2 at one depth; g, verify [max_size + 1]."""
    rates = g[2:] / (verify[2:] + depth * draft_cost)  # infeasible sizes stay -inf
    n = int(rates.argmax()) + 2  # the first maximum: the smallest size among ties
    return float(rates[n - 2]), n, depth, float(g[n])


def _decide(best: tuple[float, int, int, float], label: str, times: ForwardTimes,
            draft_cost: float) -> TreeChoice:
    """The TreeChoice for the best candidate (speedup, n, d, G), or plain decoding unless the
    candidate beats speedup 1."""
    rate, n, d, g = best
    numbers = (f"{label}: G={g:.3f} tokens / (t({n})={times.relative(n):.3f} + {d} x "
               f"c={draft_cost:.3g}) = {rate:.3f}x (t measured at {times.context} context "
               f"on {times.device})")
    if rate > 1.0:
        return TreeChoice(n, d, g, rate, f"{numbers} over plain decoding")
    return TreeChoice(1, 0, 1.0, 1.0,
                      f"speculation does not pay here: the best, {numbers}, is no faster than "
                      f"plain decoding")


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.machine()}, {torch.get_num_threads()} threads)"
