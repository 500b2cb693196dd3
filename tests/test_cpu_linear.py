"""The few-row CPU linear path: both products agree, the path each row count takes follows this
machine's measurement (linear_choice.py), is kept and read back, is never measured with
calibration off, and lossless speculation holds under either choice."""

import pytest
import torch

from conftest import DATA
from specchat.core import cpu_linear, linear_choice
from specchat.core.cpu_linear import FEW_ROWS, FewRowLinear, use_few_row_linear, weight_first
from specchat.core.engine import Finished
from specchat.core.hardware import probe
from specchat.core.linear_choice import choose_cpu_linear, measure_choice
from specchat.core.model import TransformersLM
from specchat.core.request import Request
from specchat.core.sampling import SamplingParams


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Choices are kept under a fresh cache (never this machine's real one), calibration on."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECCHAT_CALIBRATE", "1")


def fake_timer(faster_rows, calls=None):
    """A measurement where weight-first takes half F.linear's time for `faster_rows`, twice it
    for the others."""
    def time_pass(path, rows):
        if calls is not None:
            calls.append((path, rows))
        return 0.001 * (1.0 if path == "F.linear" else 0.5 if rows in faster_rows else 2.0)
    return time_pass


def refused(path, rows):
    raise AssertionError("measured although it should not have been")


def tiny_fp32_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config)


def weight_first_rows(model):
    rows = {getattr(layer, "weight_first_rows", frozenset()) for layer in cpu_linear.cpu_linears(model)}
    assert len(rows) == 1  # every layer of a model takes the same choice
    return set(rows.pop())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, FEW_ROWS, FEW_ROWS + 1, 40])
def test_every_row_count_computes_what_nn_linear_does(rows, bias):
    torch.manual_seed(rows)
    reference = torch.nn.Linear(96, 80, bias=bias)
    few = FewRowLinear(96, 80, bias=bias)
    few.load_state_dict(reference.state_dict())
    few.weight_first_rows = frozenset(range(1, FEW_ROWS + 1))
    x = torch.randn(1, rows, 96)  # [batch, tokens, features], as a decoder layer passes it
    out = few(x)
    assert out.shape == (1, rows, 80)
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)


def test_weight_first_is_close_to_f_linear_not_bit_identical():
    """Why the choice is fixed per machine and model before any answer: the two paths sum in a
    different order (measured: up to 4e-6 apart at the embedded model's shapes; 3 rows, padded
    to 4, happened to agree)."""
    torch.manual_seed(0)
    weight, x = torch.randn(1536, 576) * 0.05, torch.randn(1, 2, 576)
    reference = torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(weight_first(x, weight, None), reference, rtol=1e-5, atol=1e-5)
    assert not torch.equal(weight_first(x, weight, None), reference)


def test_only_plain_fp32_cpu_linears_are_switched_and_switched_back():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.float64), torch.nn.ReLU())
    assert use_few_row_linear(model, {1, 2}) == 1
    assert type(model[0]) is FewRowLinear and type(model[1]) is torch.nn.Linear
    assert model[0].weight_first_rows == {1, 2}
    assert use_few_row_linear(model, set()) == 0  # weight-first never won: it is not used at all
    assert type(model[0]) is torch.nn.Linear and not hasattr(model[0], "weight_first_rows")


@pytest.mark.parametrize("faster", [{1, 2, 5}, set(), set(range(1, FEW_ROWS + 1))])
def test_the_model_takes_the_path_the_measurement_found_faster(faster, monkeypatch):
    monkeypatch.setattr(linear_choice, "forward_timer", lambda model: fake_timer(faster))
    lm = TransformersLM(tiny_fp32_llama())
    assert weight_first_rows(lm.hf) == faster
    used = []
    monkeypatch.setattr(cpu_linear, "weight_first", lambda *args: used.append(args) or weight_first(*args))
    cache = lm.new_cache()
    lm.forward(torch.tensor([3, 4]), torch.arange(2), cache)  # 2 rows
    lm.forward(torch.tensor([5]), torch.tensor([2]), cache)  # 1 row
    linears = len(cpu_linear.cpu_linears(lm.hf))
    assert len(used) == linears * ((2 in faster) + (1 in faster))


def test_the_ratios_come_from_medians_of_interleaved_rounds():
    calls = []
    choice = measure_choice("m", fake_timer({3}, calls), repeats=3)
    assert choice.weight_first_rows == (3,)
    assert choice.ratios == tuple(0.5 if rows == 3 else 2.0 for rows in range(1, FEW_ROWS + 1))
    timed = calls[4:]  # after the untimed warm-up
    assert len(timed) == 3 * FEW_ROWS * 2
    assert timed[0][0] != timed[2][0]  # consecutive row counts alternate which path goes first
    noisy = []  # a busy spell that slows weight-first in the first round only: the median ignores it

    def time_pass(path, rows):
        noisy.append(path)
        return 9.0 if path == "weight-first" and 4 < len(noisy) <= 4 + 2 * FEW_ROWS else 1.0
    assert measure_choice("m", time_pass, repeats=3).ratios == (1.0,) * FEW_ROWS


def test_the_paths_are_timed_in_the_model_s_own_forwards(monkeypatch):
    """Whole forwards: the layers timed apart misjudged 6-8 rows on one machine (F.linear's time
    per byte depends on the matrix's size and on what ran before it)."""
    model = tiny_fp32_llama()
    used = []
    monkeypatch.setattr(cpu_linear, "weight_first", lambda *args: used.append(args) or weight_first(*args))
    time_pass = linear_choice.forward_timer(model)
    assert time_pass("weight-first", 6) > 0 and len(used) == len(cpu_linear.cpu_linears(model))
    assert all(x.shape[-2] == 6 for x, _, _ in used)  # the forward's 6 rows, the output head's included
    used.clear()
    assert time_pass("F.linear", 6) > 0 and not used


def test_a_model_not_all_on_the_cpu_is_not_timed(tmp_path):
    """A forward of a model split across devices would time the other device too: F.linear."""
    model = tiny_fp32_llama()
    model.model.embed_tokens.to("meta")
    assert choose_cpu_linear(model, time_pass=refused).weight_first_rows == ()
    assert not list(tmp_path.rglob("*.json"))


def test_a_choice_is_kept_and_read_back_without_measuring(tmp_path):
    calls = []
    first = choose_cpu_linear(tiny_fp32_llama(), time_pass=fake_timer({4}, calls))
    assert calls and first.weight_first_rows == (4,)
    again = tiny_fp32_llama()
    assert choose_cpu_linear(again, time_pass=refused) == first
    assert weight_first_rows(again) == {4}
    # `specchat profile` shows it.
    from specchat.app.plan_cmd import cpu_linear_facts

    facts = cpu_linear_facts(probe(measure_bandwidth=False))
    assert facts == [("CPU linear", f"{first.model}: weight-first for 4 rows (0.50x the time of F.linear); "
                                    f"F.linear for 1-3, 5-8 rows (weight-first 2.00x its time here), "
                                    f"measured {first.measured_on}")]


def test_calibration_off_measures_nothing_and_keeps_torch_s_path(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CALIBRATE", "0")
    model = tiny_fp32_llama()
    choice = choose_cpu_linear(model, time_pass=refused)
    assert choice.weight_first_rows == () and choice.ratios == ()
    assert all(type(layer) is torch.nn.Linear for layer in cpu_linear.cpu_linears(model))
    assert not list(tmp_path.rglob("*.json"))  # nothing kept: a later load with calibration on measures
    monkeypatch.setenv("SPECCHAT_CALIBRATE", "1")
    choose_cpu_linear(tiny_fp32_llama(), time_pass=fake_timer({2}))
    monkeypatch.setenv("SPECCHAT_CALIBRATE", "0")  # a choice measured before is still used
    assert choose_cpu_linear(tiny_fp32_llama(), time_pass=refused).weight_first_rows == (2,)


def test_a_measurement_past_its_deadline_is_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setattr(linear_choice, "MAX_SECONDS", 0.0)
    model = tiny_fp32_llama()
    assert choose_cpu_linear(model, time_pass=fake_timer({1, 2})).weight_first_rows == ()
    assert weight_first_rows(model) == set() and not list(tmp_path.rglob("*.json"))


def test_a_layer_skip_draft_keeps_its_target_s_choice(monkeypatch):
    calls = []
    monkeypatch.setattr(linear_choice, "forward_timer", lambda model: fake_timer({1}, calls))
    lm = TransformersLM(tiny_fp32_llama())
    measured = len(calls)
    draft = lm.truncated(1)  # shares the target's layers: they must not switch under it
    assert len(calls) == measured and weight_first_rows(draft.hf) == {1} == weight_first_rows(lm.hf)


def answer(engine, ids, mode):
    events = list(engine.generate(ids, Request(32, SamplingParams(), mode)))
    assert isinstance(events[-1], Finished)
    return events[-1].result.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("rows", [set(), set(range(1, FEW_ROWS + 1))], ids=["F.linear", "weight-first"])
def test_greedy_speculation_equals_plain_under_either_choice(embedded_engine, rows):
    hf = embedded_engine.model.hf
    kept = weight_first_rows(hf)
    use_few_row_linear(hf, rows)
    try:
        text = (DATA / "apache-2.0.txt").read_text()
        ids = embedded_engine.chat_ids([{"role": "user", "content": text[:text.find("\n\n", 2000)]
                                         + "\n\nWhat does this licence grant?"}])
        plain = answer(embedded_engine, ids, "plain")
        assert answer(embedded_engine, ids, "chain") == plain
        assert answer(embedded_engine, ids, "tree") == plain
    finally:
        use_few_row_linear(hf, kept)
