"""A measured t(n) curve: the target's time to verify n tokens in one forward, relative to one
token, at one context length. Plain data without torch, so the plan can read it."""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..files import write_atomically

FORMAT_VERSION = 1  # of the ForwardTimes JSON file

# How far one timing may stray from the others before a curve is taken for a busy machine's: a
# quiet one keeps t(n) within about 15% of smooth, a second program running drives single
# timings 2-7x off (a saved curve had t(2) = 3.5, t(5) = 0.37 and a 4K token slower than an 8K one).
SLACK = 0.6


@dataclass(frozen=True)
class ForwardTimes:
    """Measured t(n): ratios[i] = target time for sizes[i] tokens / time for 1 token."""

    sizes: tuple[int, ...]  # strictly increasing, sizes[0] == 1
    ratios: tuple[float, ...]  # ratios[0] == 1 by construction
    one_token_seconds: float  # the absolute time of a 1-token forward, the unit of the ratios
    context: int  # tokens in the cache when measured (attention cost grows with it)
    device: str  # what it was measured on, for the record

    def __post_init__(self):
        if not self.sizes or self.sizes[0] != 1 or len(self.ratios) != len(self.sizes):
            raise ValueError("forward times need one ratio per size, starting at size 1")
        if any(not isinstance(n, int) for n in self.sizes) or any(
                a >= b for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError(f"sizes must be strictly increasing integers, got {self.sizes}")
        if self.ratios[0] != 1.0 or not all(0 < r < math.inf for r in self.ratios):
            raise ValueError(f"ratios must be positive and finite with t(1) = 1, got {self.ratios}")
        if not 0 < self.one_token_seconds < math.inf or self.context < 0:
            raise ValueError("one_token_seconds must be positive and context non-negative")

    def relative(self, n: float) -> float:
        """t(n): linear between measured sizes, linear beyond the last along the last segment, 1 at
        n <= 1. The extrapolated slope is kept >= 0: a noisy last segment must not make huge trees
        look cheaper than measured ones. (`optimizer.relative_times` is the same over a tensor.)"""
        x = max(float(n), 1.0)
        if len(self.sizes) == 1:
            return 1.0
        # Segment i spans sizes[i-1]..sizes[i]; beyond the last size, the last segment.
        i = min(max(bisect.bisect_right(self.sizes, x), 1), len(self.sizes) - 1)
        slope = (self.ratios[i] - self.ratios[i - 1]) / (self.sizes[i] - self.sizes[i - 1])
        if x > self.sizes[-1]:
            slope = max(slope, 0.0)
        return self.ratios[i] + slope * (x - self.sizes[i])  # from the right end: flat beyond if clamped

    def save(self, path: Path) -> None:
        """Write as JSON, atomically (a concurrent reader never sees half a file)."""
        write_atomically(Path(path), json.dumps({"version": FORMAT_VERSION, **asdict(self)}))

    @classmethod
    def load(cls, path: Path) -> "ForwardTimes":
        """Read a file written by `save`; ValueError naming the file if it is not one."""
        try:
            data = json.loads(Path(path).read_text())
            if data.pop("version") != FORMAT_VERSION:
                raise ValueError(f"format version is not {FORMAT_VERSION}")
            return cls(sizes=tuple(data.pop("sizes")), ratios=tuple(map(float, data.pop("ratios"))),
                       **data)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{path} is not a valid forward-times file: {error!r}") from error



def disturbed(curves: Sequence[ForwardTimes]) -> dict[int, str]:
    """The contexts of `curves` (one model's, any order) whose timings a busy machine disturbed,
    each with why. Verifying more tokens at once costs no less than fewer, and a token costs no
    less at a longer context: each t(n) must reach SLACK of the largest t of fewer tokens (t(1) = 1
    included), and each one-token time SLACK of any shorter context's. A busy spell only ever adds
    time, so of two contexts out of order the shorter, slower one is the disturbed one."""
    found = {}
    for times in curves:
        largest = 0.0
        for n, ratio in zip(times.sizes, times.ratios):
            if ratio < SLACK * largest:
                found[times.context] = (f"t({n}) = {ratio:.2f} at {times.context:,} tokens of context, under "
                                        f"{SLACK:.0%} of a smaller verification's {largest:.2f}")
                break
            largest = max(largest, ratio)
    for shorter in curves:
        for longer in curves:
            if (longer.context > shorter.context and shorter.context not in found
                    and longer.one_token_seconds < SLACK * shorter.one_token_seconds):
                found[shorter.context] = (
                    f"a token at {shorter.context:,} tokens of context took {shorter.one_token_seconds * 1e3:.1f} "
                    f"ms, over {1 / SLACK:.2g}x the {longer.one_token_seconds * 1e3:.1f} ms at {longer.context:,}")
    return found
