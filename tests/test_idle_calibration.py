"""The app's first calibration runs while the engine is idle: the first answer does not wait for
it, a question that comes in the middle gets the engine after one forward, the measurement picks
up again afterwards, and the finished curves are saved and answered by."""

from __future__ import annotations

import re
import threading
import time

from specchat.app.engine_handle import EngineHandle
from specchat.app.engine_queue import EngineLine
from specchat.core.engine import Finished
from specchat.core import step_calibration
from specchat.core.loading import load_engine
from specchat.core.request import Request
from specchat.core.sampling import SamplingParams
from specchat.core.step_calibration import SIZES, contexts_for, saved_curves

WAIT = 60  # seconds: every wait is bounded


class CountingWork:
    """Idle work of `total` steps that records which steps ran and how often it was restarted."""

    def __init__(self, total: int):
        self.total, self.done, self.starts, self.closed = total, 0, 0, 0
        self.finished = False

    def steps(self):
        self.starts += 1
        try:
            while self.done < self.total:
                time.sleep(0.005)
                self.done += 1
                yield
            self.finished = True
        except GeneratorExit:
            self.closed += 1
            raise


def wait_until(condition, seconds: float = WAIT) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_idle_work_steps_only_while_no_job_waits_and_gives_way_to_a_job():
    work = CountingWork(400)
    line = EngineLine(lambda: "engine", idle_work=lambda: None if work.finished else work)
    try:
        line.wake()
        assert wait_until(lambda: work.done > 5)
        gate = threading.Event()

        def job(engine, cancel):
            seen = work.done
            gate.wait(WAIT)
            yield work.done - seen  # steps run while this job held the engine

        ticket = line.submit(job)
        gate.set()
        assert list(ticket) == [0]
        assert work.closed >= 1  # the job closed the steps it interrupted...
        assert wait_until(lambda: work.finished)  # ...and they started again once it was done
        assert work.starts >= 2 and work.done == 400
    finally:
        line.close()


def test_other_idle_work_replaces_the_steps_of_the_one_before():
    first, second = CountingWork(10**6), CountingWork(50)
    current = {"work": first}
    line = EngineLine(lambda: "engine", idle_work=lambda: current["work"])
    try:
        line.wake()
        assert wait_until(lambda: first.done > 3)
        current["work"] = second  # another model was loaded
        line.wake()
        assert wait_until(lambda: second.finished)
        assert first.closed == 1 and not first.finished
    finally:
        current["work"] = None
        line.close()


def test_failing_idle_work_stops_and_the_line_serves_on(capsys):
    class Failing:
        finished = False

        def steps(self):
            yield
            self.finished = True
            raise RuntimeError("disk full")

    work = Failing()
    line = EngineLine(lambda: "engine", idle_work=lambda: None if work.finished else work)
    try:
        line.wake()
        assert wait_until(lambda: work.finished)
        assert list(line.submit(lambda engine, cancel: iter([engine]))) == ["engine"]
    finally:
        line.close()
    assert "idle work stopped: disk full" in capsys.readouterr().err


def test_the_app_answers_before_calibrating_and_calibrates_when_idle(tiny_model_dir, tmp_path, monkeypatch, undisturbed):
    monkeypatch.setenv("SPECCHAT_CALIBRATE", "1")
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    lines: list[str] = []

    def load(model, progress):
        def both(line):
            lines.append(line)
            progress(line)
        engine = load_engine(model, progress=both, calibrate_when_idle=True)
        return engine

    handle = EngineHandle(load, str(tiny_model_dir))
    try:
        engine = handle.get(WAIT)
        assert not any("Calibrating" in line for line in lines)
        calibration = engine.idle_calibration  # the load measured nothing: it left this
        assert calibration.pending + [t.context for t in calibration.measured] == contexts_for(engine.context_length)
        note = handle.calibration_note()  # the page's hint while it measures (racing it: it may be done)
        assert re.fullmatch(r"measuring this machine's speed between answers \([0-2] of 2\)", note) or (
            note == "" and calibration.finished), note

        ids = engine.chat_ids([{"role": "user", "content": "Say something, then say it again. " * 3}])

        def answer(engine, cancel):
            yield from engine.generate(ids, Request(8, SamplingParams(), "chain"))

        first = [e for e in handle.submit(answer) if isinstance(e, Finished)][0].result
        assert first.new_tokens > 0
        assert wait_until(lambda: calibration.finished)
        assert handle.calibration_note() == ""
        assert [t.context for t in calibration.measured] == contexts_for(engine.context_length) == [119, 239]
        assert all(t.sizes == (1, *SIZES) for t in calibration.measured)
        saved = saved_curves(engine.model, engine.calibration_key, contexts_for(engine.context_length), list(SIZES))
        assert saved is not None and list(saved.times) == calibration.measured
        assert engine.settings.step_times is not None and engine.settings.step_times.curves == saved.times
        later = [e for e in handle.submit(answer) if isinstance(e, Finished)][0].result
        assert later.stats.predicted_tokens_per_second > 0  # answers now go by the measured t(n)
    finally:
        handle.close()

    again = load_engine(str(tiny_model_dir), progress=lines.append, calibrate_when_idle=True)
    assert again.idle_calibration is None and again.settings.step_times == engine.settings.step_times


def test_a_question_mid_context_drops_that_context_and_it_is_measured_again(tiny_model_dir, tmp_path, monkeypatch, undisturbed):
    monkeypatch.setenv("SPECCHAT_CALIBRATE", "1")
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    engine = load_engine(str(tiny_model_dir), progress=lambda line: None, calibrate_when_idle=True)
    calibration = engine.idle_calibration
    steps = calibration.steps()
    for _ in range(5):  # into the first context's timed forwards
        next(steps)
    steps.close()  # a question came
    assert calibration.measured == [] and calibration.pending == contexts_for(engine.context_length)
    finished_when_saving = []
    save = step_calibration.save_curves

    def watched_save(*args, **kwargs):
        finished_when_saving.append(calibration.finished)
        return save(*args, **kwargs)

    monkeypatch.setattr(step_calibration, "save_curves", watched_save)
    for _ in calibration.steps():
        pass
    assert calibration.finished and len(calibration.measured) == 2
    assert finished_when_saving == [False]  # "finished" means saved and handed over (the app waits on it)
    assert engine.settings.step_times is not None
