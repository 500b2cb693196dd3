"""What one target forward costs on this machine, by tokens verified and context length: the
calibration's measured t(n) curves (hardware.ModelCurves) made into one function of both."""

from __future__ import annotations

from dataclasses import dataclass

from .forward_times import ForwardTimes

# Before calibration (or for a model without curves): a stated default, t(n) = 1 + n/10 - 1/10.
DEFAULT_SLOPE = 0.1


@dataclass(frozen=True)
class StepTimes:
    """Measured t(n) at several contexts; between two measured contexts both the one-token time
    and t(n) are interpolated linearly, beyond them the nearest is used."""
    curves: tuple[ForwardTimes, ...]  # sorted by context

    @classmethod
    def of(cls, curves) -> "StepTimes | None":
        times = tuple(sorted(curves.times, key=lambda t: t.context)) if curves is not None else ()
        return cls(times) if times else None

    def _around(self, context: int) -> tuple[ForwardTimes, ForwardTimes, float]:
        times = self.curves
        if context <= times[0].context:
            return times[0], times[0], 0.0
        for low, high in zip(times, times[1:]):
            if context <= high.context:
                return low, high, (context - low.context) / (high.context - low.context)
        return times[-1], times[-1], 0.0

    def relative(self, n: int, context: int) -> float:
        """t(n): a forward of n tokens in one-token forwards, at `context` cached tokens."""
        low, high, w = self._around(context)
        return (1 - w) * low.relative(n) + w * high.relative(n)

    def seconds(self, n: int, context: int) -> float:
        low, high, w = self._around(context)
        one = (1 - w) * low.one_token_seconds + w * high.one_token_seconds
        return one * self.relative(n, context)


def default_relative(n: int, context: int) -> float:
    """The stated default t(n) when nothing is measured."""
    return 1.0 + DEFAULT_SLOPE * (max(n, 1) - 1)
