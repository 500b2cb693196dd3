"""Calibration that runs itself: the first time a model runs on a machine, its t(n) is measured
at the context lengths that matter and kept with the machine's profile (keyed by model,
revision, weights format and machine: `hardware.curve_key`), so the cost model that picks each
verification's length, and the answer's predicted tok/s, rest on this machine's figures.

On this project's 2-core CPU the embedded model takes about three minutes, once. The CLI
measures before its first answer; the app answers at once with the stated defaults and measures
while the engine is idle (`IdleCalibration`), so a first launch is not four minutes of waiting.
`SPECCHAT_CALIBRATE=0` measures nothing (the tests set it: they check decoding, not this
machine): a calibration made before is still used; without one the cost model takes its stated
default and answers carry no prediction.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from .env_settings import env_switch
from .files import write_atomically
from .hardware import FORMAT_VERSION, ModelCurves, cache_dir, curves_path, probe_key, read_curves
from .speculative.forward_times import ForwardTimes, disturbed
from .speculative.lookahead import MAX_DRAFT
from .speculative.step_times import StepTimes

# Verification sizes the cost model chooses among: up to MAX_DRAFT drafts and the root.
SIZES = (2, 3, 4, 5, 6, 8, 12, MAX_DRAFT + 1)
CURVE_REPEATS = 3
# Contexts measured again, in all, when a busy machine disturbed them (`forward_times.disturbed`);
# past that nothing is kept and the next start measures anew.
REMEASURES = 4


def contexts_for(context_length: int) -> list[int]:
    """A short prompt, a page, and half and all of the context (attention grows with it)."""
    longest = context_length - SIZES[-1]
    return sorted({min(256, longest), min(2048, longest), longest // 2, longest})


def calibration_enabled() -> bool:
    """$SPECCHAT_CALIBRATE, on unless switched off (0, off, no, false)."""
    return env_switch("SPECCHAT_CALIBRATE", True)


def calibrated_step_times(model, model_key: str, context_length: int,
                          progress: Callable[[str], None], refresh: bool = False) -> StepTimes | None:
    """The model's measured step times on this machine, measured now if they never were (or
    again, with `refresh`); None when calibration is off and never ran."""
    curves = measure_curves(model, model_key, contexts_for(min(context_length, model.context_length)),
                            list(SIZES), refresh=refresh, progress=progress,
                            measure=refresh or calibration_enabled())
    return StepTimes.of(curves)


def saved_step_times(model, model_key: str, context_length: int) -> tuple[StepTimes | None, list[int]]:
    """The step times measured before, else None and the contexts to measure when the engine is
    idle (none with calibration off)."""
    contexts = contexts_for(min(context_length, model.context_length))
    times = StepTimes.of(saved_curves(model, model_key, contexts, list(SIZES)))
    if times is not None or not calibration_enabled():
        return times, []
    return None, fitting_contexts(model, contexts, list(SIZES))


class CurveSeries:
    """A calibration's contexts still to measure (`pending`, shortest first) and its curves so far
    (`measured`): each new curve is checked with the others, and a context a busy machine disturbed
    is measured again, up to REMEASURES times in all."""

    def __init__(self, contexts: list[int]):
        self.pending = sorted(contexts)
        self.measured: list[ForwardTimes] = []
        self.remeasures_left = REMEASURES

    def record(self, times: ForwardTimes) -> str | None:
        """Take the curve of `pending[0]`; None, or why the series is given up (too many disturbed)."""
        found = disturbed([*self.measured, times])
        if not found:
            self.measured.append(times)
            self.pending.pop(0)
            return None
        if self.remeasures_left == 0:
            self.pending, self.measured = [], []
            return "; ".join(found.values())
        self.remeasures_left -= 1
        if times.context not in found:  # it shows shorter contexts were slowed: those are measured again
            self.measured.append(times)
            self.pending.pop(0)
        self.measured = [kept for kept in self.measured if kept.context not in found]
        self.pending = sorted({*self.pending, *found})
        return None

    def curves(self) -> list[ForwardTimes]:
        return sorted(self.measured, key=lambda times: times.context)


class IdleCalibration:
    """The first use's calibration as the app runs it: between answers, a forward at a time
    (`steps`), so a question waits for one forward of it at most. A question that comes in the
    middle of a context closes `steps`: that context's cache and samples are dropped and it is
    measured again at the next idle spell; finished contexts are kept. When the last one is
    measured the curves are saved and the engine answers by them (`Engine.use_step_times`); if the
    machine stayed too busy to measure (`gave_up`), nothing is saved and the next start tries again."""

    def __init__(self, engine, model_key: str, contexts: list[int], sizes: tuple[int, ...] = SIZES,
                 repeats: int = CURVE_REPEATS, root: Path | None = None):
        self.engine, self.model_key, self.sizes, self.repeats, self.root = engine, model_key, list(sizes), repeats, root
        self.series = CurveSeries(contexts)
        self._done = False
        self.gave_up: str | None = None

    @property
    def pending(self) -> list[int]:
        """The contexts still to measure, shortest first."""
        return self.series.pending

    @property
    def measured(self) -> list[ForwardTimes]:
        return self.series.measured

    @property
    def finished(self) -> bool:
        """Done for this launch: measured, saved and handed to the engine, or given up."""
        return self._done

    def steps(self) -> Iterator[None]:
        """Measure what is pending on the engine's model, yielding after every forward; at the
        end, hand the step times to the engine."""
        from .speculative.optimizer import forward_time_steps  # torch: only when measuring

        try:
            while self.pending:
                try:
                    times = yield from forward_time_steps(self.engine.model, self.pending[0], self.sizes, self.repeats)
                except Exception as error:
                    if not out_of_memory(error):
                        raise
                    break  # the longer contexts would not fit either
                self.gave_up = self.series.record(times)
            if self.measured:
                self.engine.use_step_times(StepTimes.of(save_curves(self.model_key, self.series.curves(), self.root)))
        except GeneratorExit:
            raise  # a job came: the unfinished context is measured again at the next idle spell
        except BaseException:
            self._done = True  # never retried: the next launch measures again
            raise
        self._done = True


def measure_curves(model, model_key: str, contexts: list[int], sizes: list[int], refresh: bool = False,
                   root: Path | None = None, repeats: int = CURVE_REPEATS,
                   progress: Callable[[str], None] | None = None, measure: bool = True) -> ModelCurves | None:
    """t(n) of `model` (a core.model.CausalLM) at each of `contexts`, from this machine's cache
    when measured before (unless `refresh`), else measured with optimizer.measure_forward_times
    and saved. Contexts are capped by what fits: those past the model's positions are skipped,
    and on a GPU the first that runs out of memory ends the series (the longer ones would too).
    Use `curve_key` for `model_key`, so the planner finds the curves again. With `measure` False,
    only the cache is read (None when it has nothing)."""
    cached = None if refresh else saved_curves(model, model_key, contexts, sizes, root)
    if cached is not None or not measure:
        return cached
    from .speculative.optimizer import measure_forward_times  # torch: only when measuring

    series = CurveSeries(fitting_contexts(model, contexts, sizes))
    total = len(series.pending)
    while series.pending:
        context = series.pending[0]
        if progress is not None:
            progress(f"Calibrating on this machine, once: forward times at {context:,} tokens of context "
                     f"({len(series.measured) + 1}/{total})...")
        try:
            times = measure_forward_times(model, context, sizes, repeats)
        except Exception as error:
            if not out_of_memory(error):
                raise
            break
        gave_up = series.record(times)
        if gave_up is not None:
            if progress is not None:
                progress(f"Calibration skipped: this machine was too busy to time it ({gave_up}); default step "
                         "costs are used until it is measured again, at the next start.")
            return None
    if not series.measured:
        raise ValueError(f"no context of {contexts} fits {model_key}")
    return save_curves(model_key, series.curves(), root)


def saved_curves(model, model_key: str, contexts: list[int], sizes: list[int],
                 root: Path | None = None) -> ModelCurves | None:
    """The curves measured before for `model_key` at these contexts (as far as they fit), or None."""
    path = curves_path((root or cache_dir()) / probe_key(), model_key)
    if not path.is_file():
        return None
    try:
        cached = read_curves(path)
    except ValueError:
        return None
    fits = cached.model_key == model_key and [t.context for t in cached.times] == fitting_contexts(model, contexts, sizes)
    return cached if fits else None


def save_curves(model_key: str, times: list, root: Path | None = None) -> ModelCurves:
    """Keep measured `ForwardTimes` with this machine's profile, where `saved_curves` and the
    planner find them."""
    curves = ModelCurves(model_key, tuple(times))
    path = curves_path((root or cache_dir()) / probe_key(), model_key)
    write_atomically(path, json.dumps({"version": FORMAT_VERSION, **dataclasses.asdict(curves)}))
    return curves


def fitting_contexts(model, contexts: list[int], sizes: list[int]) -> list[int]:
    """`contexts` that leave room for the largest of `sizes` in the model's positions, in order."""
    return sorted(context for context in set(contexts) if context + max(sizes, default=1) <= model.context_length)


def out_of_memory(error: BaseException) -> bool:
    """A measurement that ran out of memory (the longer contexts would too); GPU memory is
    released for what comes next."""
    if isinstance(error, MemoryError):
        return True
    if isinstance(error, RuntimeError) and "out of memory" in str(error):  # torch.cuda.OutOfMemoryError
        from .memory_release import release_gpu_memory  # torch: only once it ran out of memory

        release_gpu_memory()
        return True
    return False
