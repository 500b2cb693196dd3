"""Calibration on a busy machine: timings that a second program disturbed are recognized, measured
again, and never kept; curves saved before the check are dropped when read. The curve below is
the one this project's machine saved for the embedded model while a test suite ran beside it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from specchat.core import hardware, step_calibration
from specchat.core.speculative import optimizer
from specchat.core.speculative.forward_times import ForwardTimes, disturbed
from specchat.core.step_calibration import CurveSeries, IdleCalibration

SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 17)


def curve(context: int, one_token_ms: float, ratios) -> ForwardTimes:
    return ForwardTimes(SIZES, tuple(ratios), one_token_ms / 1e3, context, "cpu")


BUSY = (  # saved on 2026-11-28 at 00:41, under a test suite: it made auto draft 7 tokens where 1.5 are kept
    curve(256, 259.5, (1.0, 3.46, 2.62, 7.44, 0.37, 0.47, 0.49, 0.58, 0.73)),
    curve(2048, 302.5, (1.0, 2.64, 2.89, 1.64, 3.66, 5.50, 7.07, 3.58, 5.35)),
    curve(4087, 649.8, (1.0, 6.80, 2.47, 2.05, 3.47, 3.87, 0.82, 1.17, 1.13)),
    curve(8175, 130.3, (1.0, 1.11, 1.22, 1.24, 1.45, 1.66, 1.73, 2.41, 2.61)),
)
QUIET = (  # the same model measured on the quiet machine (t(2) < 1 there is its noise, and allowed)
    curve(256, 70.3, (1.0, 0.77, 0.84, 0.85, 1.02, 1.23, 1.17, 1.86, 2.13)),
    curve(2048, 69.0, (1.0, 0.91, 1.03, 1.05, 1.20, 1.31, 1.57, 2.31, 2.64)),
    curve(4087, 77.2, (1.0, 1.11, 1.26, 1.26, 1.37, 1.64, 1.75, 2.48, 2.83)),
    curve(8175, 91.9, (1.0, 1.08, 1.18, 1.22, 1.52, 1.85, 1.60, 2.28, 2.79)),
)


def test_a_busy_machine_s_curves_are_told_from_a_quiet_one_s():
    assert disturbed(QUIET) == {}
    found = disturbed(BUSY)
    assert set(found) == {256, 2048, 4087}  # 8175 was measured after the other program ended
    assert "t(5) = 0.37" in found[256] and "t(4) = 1.64" in found[2048] and "t(3) = 2.47" in found[4087]
    # A token slower at a short context than at a longer one: the shorter was disturbed.
    slow_short = (curve(256, 150.0, QUIET[0].ratios), QUIET[1])
    assert set(disturbed(slow_short)) == {256} and "over 1.7x" in disturbed(slow_short)[256]


def test_the_series_measures_a_disturbed_context_again_and_the_shorter_one_a_longer_shows_slowed():
    series = CurveSeries([256, 2048, 4087])
    assert series.record(BUSY[0]) is None and series.pending == [256, 2048, 4087] and series.measured == []
    assert series.record(QUIET[0]) is None and series.pending == [2048, 4087]
    assert series.record(curve(2048, 69.0 * 2, QUIET[1].ratios)) is None  # slower than its neighbours, but
    assert series.pending == [4087]  # only a longer context can show that
    assert series.record(QUIET[2]) is None  # 4087 at 77 ms: 2048's 138 ms was disturbed
    assert series.pending == [2048] and [t.context for t in series.curves()] == [256, 4087]
    assert series.record(QUIET[1]) is None and series.pending == []
    assert series.curves() == list(QUIET[:3])


def test_the_series_gives_up_after_its_remeasures():
    series = CurveSeries([256])
    for _ in range(step_calibration.REMEASURES):
        assert series.record(BUSY[0]) is None and series.pending == [256]
    reason = series.record(BUSY[0])
    assert "t(5) = 0.37" in reason and series.pending == [] and series.measured == []


def test_measure_curves_keeps_nothing_from_a_machine_that_stays_busy(tmp_path, monkeypatch):
    model = SimpleNamespace(context_length=1 << 20)
    answers = iter([BUSY[0], QUIET[0], QUIET[1]])
    monkeypatch.setattr(optimizer, "measure_forward_times", lambda model, context, sizes, repeats: next(answers))
    curves = step_calibration.measure_curves(model, "m#k4", [256, 2048], list(SIZES[1:]), root=tmp_path)
    assert curves.times == QUIET[:2]  # 256 measured twice
    assert step_calibration.saved_curves(model, "m#k4", [256, 2048], list(SIZES[1:]), root=tmp_path) == curves

    monkeypatch.setattr(optimizer, "measure_forward_times", lambda model, context, sizes, repeats: BUSY[0])
    lines = []
    assert step_calibration.measure_curves(model, "busy#k4", [256], list(SIZES[1:]), root=tmp_path,
                                           progress=lines.append) is None
    assert "too busy" in lines[-1] and "next start" in lines[-1]
    assert step_calibration.saved_curves(model, "busy#k4", [256], list(SIZES[1:]), root=tmp_path) is None


def test_the_idle_calibration_gives_up_without_saving_and_says_so(tmp_path, monkeypatch):
    def busy_steps(model, context, sizes, repeats):
        yield
        return curve(context, 259.5, BUSY[0].ratios)

    monkeypatch.setattr(optimizer, "forward_time_steps", busy_steps)
    handed = []
    calibration = IdleCalibration(SimpleNamespace(model=None, use_step_times=handed.append), "m#k4", [256, 2048],
                                  root=tmp_path)
    steps = list(calibration.steps())
    assert len(steps) == step_calibration.REMEASURES + 1
    assert calibration.finished and "t(5) = 0.37" in calibration.gave_up and handed == []
    assert not list(tmp_path.rglob("*.json"))


def test_curves_saved_before_the_check_are_dropped_when_read(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    profile = hardware.load_or_probe(root=tmp_path)
    folder = tmp_path / profile.machine_key() / "curves"
    folder.mkdir(parents=True, exist_ok=True)
    for name, times in (("busy", BUSY), ("quiet", QUIET)):
        step_calibration.save_curves(f"{name}#k4", list(times), root=tmp_path)
    assert len(list(folder.glob("*.json"))) == 2
    again = hardware.load_or_probe(root=tmp_path)
    assert again.curves_for("quiet#k4").times == QUIET and again.curves_for("busy#k4") is None
    assert len(list(folder.glob("*.json"))) == 1  # the busy machine's file is gone: measured anew


class SlowFirstTokens:
    """A model whose one-token forwards were caught by a busy spell twice in three rounds."""

    context_length, vocab_size = 4096, 100

    def __init__(self):
        self.one_token_calls = 0

    def new_cache(self):
        return SimpleNamespace(trim=lambda length: None)

    def forward(self, ids, positions, cache, last_only=False):
        n = ids.shape[0]
        if n == 1 and not last_only:
            self.one_token_calls += 1
            if self.one_token_calls in (2, 3):  # the first is the warm-up
                time.sleep(0.2)
        time.sleep(0.02 + 0.002 * n)
        return torch.zeros(n, 4)


def test_a_curve_takes_the_fastest_of_its_rounds():
    measured = optimizer.measure_forward_times(SlowFirstTokens(), 8, [2, 4], repeats=3)
    assert 0.9 < measured.relative(2) < 1.5  # a median would give about 0.1
    assert measured.one_token_seconds < 0.1 and disturbed([measured]) == {}
