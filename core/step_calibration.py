"""Calibration that runs itself: the first time a model runs on a machine, its t(n) is measured
at the context lengths that matter and kept with the machine's profile (hardware.measure_curves,
keyed by model, revision, weights format and machine), so the cost model that picks each
verification's length, and the answer's predicted tok/s, rest on this machine's figures.

On this project's 2-core CPU the embedded model takes about three minutes, once.
`SPECCHAT_CALIBRATE=0` measures nothing (the tests set it: they check decoding, not this
machine): a calibration made before is still used; without one the cost model takes its stated
default and answers carry no prediction.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .hardware import measure_curves
from .speculative.lookahead import MAX_DRAFT
from .speculative.step_times import StepTimes

# Verification sizes the cost model chooses among: up to MAX_DRAFT drafts and the root.
SIZES = (2, 3, 4, 5, 6, 8, 12, MAX_DRAFT + 1)


def contexts_for(context_length: int) -> list[int]:
    """A short prompt, a page, and half and all of the context (attention grows with it)."""
    longest = context_length - SIZES[-1]
    return sorted({min(256, longest), min(2048, longest), longest // 2, longest})


def calibration_enabled() -> bool:
    return os.environ.get("SPECCHAT_CALIBRATE", "1") != "0"


def calibrated_step_times(model, model_key: str, context_length: int,
                          progress: Callable[[str], None], refresh: bool = False) -> StepTimes | None:
    """The model's measured step times on this machine, measured now if they never were (or
    again, with `refresh`); None when calibration is off and never ran."""
    curves = measure_curves(model, model_key, contexts_for(min(context_length, model.context_length)),
                            list(SIZES), refresh=refresh, progress=progress,
                            measure=refresh or calibration_enabled())
    return StepTimes.of(curves)
