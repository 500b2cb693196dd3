"""Calibration that runs itself: the first load of a model on a machine measures its t(n) at
the contexts that matter, later loads read it back, and answers carry the cost model's
prediction next to the measured speed."""

from specchat.core.engine import Finished
from specchat.core.loading import load_engine
from specchat.core.sampling import SamplingParams
from specchat.core.step_calibration import contexts_for
from specchat.core.request import Request


def test_first_use_calibrates_once_and_answers_carry_a_prediction(tiny_model_dir, tmp_path, monkeypatch,
                                                                  undisturbed):
    monkeypatch.setenv("SPECCHAT_CALIBRATE", "1")
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    lines = []
    engine = load_engine(str(tiny_model_dir), progress=lines.append)
    assert sum("Calibrating on this machine" in line for line in lines) == 2  # one line per context
    times = engine.settings.step_times
    assert [t.context for t in times.curves] == contexts_for(engine.context_length) == [119, 239]
    ids = engine.chat_ids([{"role": "user", "content": "Say something, then say it again. " * 3}])
    for mode in ("plain", "chain"):
        result = [e for e in engine.generate(ids, Request(12, SamplingParams(), mode)) if isinstance(e, Finished)][0].result
        assert result.stats.predicted_tokens_per_second > 0
        assert "predicted_tokens_per_second" in result.to_json()["stats"]

    lines.clear()
    again = load_engine(str(tiny_model_dir), progress=lines.append)
    assert not any("Calibrating" in line for line in lines)  # measured once per machine
    assert again.settings.step_times == times


def test_calibration_off_leaves_the_stated_default_and_no_prediction(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CALIBRATE", "0")
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    engine = load_engine(str(tiny_model_dir), progress=lambda line: None)
    assert engine.settings.step_times is None
    ids = engine.chat_ids([{"role": "user", "content": "Hello"}])
    result = [e for e in engine.generate(ids, Request(5, SamplingParams(), "chain")) if isinstance(e, Finished)][0].result
    assert result.stats.predicted_tokens_per_second is None
