"""The cost model that picks each verification's draft length (speculative/lookahead.py), and the
step-time curves it reads (speculative/step_times.py)."""

import pytest

from conftest import tiny_llama
from specchat.core.speculative import lookahead
from specchat.core.speculative.lookahead import CostModelLookahead, PositionRates
from specchat.core.speculative.forward_times import ForwardTimes
from specchat.core.speculative.step_times import StepTimes
from test_decoding import prompts, run
from specchat.core.decoding import ChainDecoder
from specchat.core.sampling import SamplingParams
from specchat.core.speculative.drafters import PromptLookupDrafter

FLAT = lambda n, context: 1.0  # noqa: E731  verification costs what a plain step does
STEEP = lambda n, context: float(n)  # noqa: E731  every verified token costs a plain step


def test_expected_tokens_follow_the_counted_rates():
    rates = PositionRates()
    assert rates.expected_tokens(0) == 1.0
    assert rates.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)  # the prior, a = 0.5
    for _ in range(60):
        rates.observe(drafted=3, accepted=3)
    assert rates.rate(0) > 0.9 and rates.expected_tokens(3) > 3.4
    for _ in range(60):
        rates.observe(drafted=3, accepted=0)  # the answer stops quoting: the past fades
    assert rates.rate(0) < 0.1
    assert rates.rate(1) == pytest.approx(0.5, abs=0.01)  # never judged since: back to the prior


def test_flat_costs_draft_long_and_steep_costs_fall_back_to_plain_and_probe():
    cheap = CostModelLookahead(FLAT, cap=8)
    for _ in range(20):
        cheap.observe(8, 8, kind=4)
    assert cheap.most(budget=20) == 8 and cheap.most(budget=2) == 2  # never past the answer's budget
    assert cheap.choose(8, context=100, kind=4) == 8
    assert cheap.choose(3, context=100, kind=4) == 3  # a shorter proposal: all of it

    dear = CostModelLookahead(STEEP, cap=8)
    choices = [dear.choose(8, context=100, kind=2) for _ in range(3 * lookahead.PROBE_EVERY)]
    assert choices.count(0) == len(choices) - 3 and choices.count(1) == 3  # a probe every PROBE_EVERY


def test_the_choice_follows_acceptance_within_an_answer_and_by_kind():
    model = CostModelLookahead(lambda n, context: 1 + 0.3 * (n - 1), cap=8)
    for _ in range(20):
        model.observe(4, 4, kind=4)  # long matches are copied
        model.observe(4, 0, kind=1)  # unigram matches are not
    copying = model.choose(8, 100, kind=4)
    assert copying >= 4 and model.choose(8, 100, kind=1) == 0
    for _ in range(20):
        model.observe(copying, 0, kind=4)  # the answer stops quoting
    assert model.choose(8, 100, kind=4) == 0


def test_greedy_output_is_plains_while_the_draft_length_moves():
    """Acceptance changes mid-answer (the prompt repeats, the answer wanders off): the chosen
    lengths vary, some steps fall back to plain, and the tokens are plain decoding's."""
    for seed in range(3):
        model = tiny_llama(seed)
        prompt = prompts(seed)["n-gram hits"]
        plain, _ = run(model, prompt, "plain", SamplingParams(), 60)
        decoder = ChainDecoder(PromptLookupDrafter(min_ngram=1),
                               CostModelLookahead(lambda n, context: 1 + 0.4 * (n - 1), cap=6))
        tokens, steps = run(model, prompt, "chain", SamplingParams(), 60, decoder)
        assert tokens == plain
        lengths = {step.drafted for step in steps[1:]}
        assert len(lengths) >= 2


def times(context, one, ratios):
    return ForwardTimes(sizes=(1, 2, 4), ratios=(1.0, *ratios), one_token_seconds=one, context=context, device="cpu")


def test_step_times_interpolate_between_measured_contexts():
    steps = StepTimes((times(1000, 0.1, (1.0, 1.2)), times(3000, 0.3, (1.2, 2.0))))
    assert steps.seconds(1, 1000) == pytest.approx(0.1)
    assert steps.seconds(1, 2000) == pytest.approx(0.2)
    assert steps.relative(4, 2000) == pytest.approx(1.6)
    assert steps.seconds(4, 500) == pytest.approx(0.12)  # below the first: the first
    assert steps.seconds(2, 9000) == pytest.approx(0.36)  # beyond the last: the last


def test_the_prediction_prices_each_step_by_its_size_and_context_and_the_stages_below():
    from types import SimpleNamespace

    from specchat.core.decoding import TriforceSettings
    from specchat.core.prediction import AnswerPrediction
    from specchat.core.speculative.types import Step

    steps = StepTimes((times(1000, 0.1, (1.0, 1.2)), times(3000, 0.3, (1.2, 2.0))))
    model = SimpleNamespace(num_layers=30)
    prediction = AnswerPrediction(steps, model, TriforceSettings(budget=1000, sinks=4, window=996))
    assert prediction.add(Step([7]), 2000, {}, 1) is None  # the prefill's token: no decode time yet
    rate = prediction.add(Step([1, 2, 3], drafted=3, accepted=2, verified=4), 2000, {}, 4)
    assert rate == pytest.approx(4 / (0.2 * 1.6))
    stages = {"retrieval": {"forwards": 2, "drafted": 2, "accepted": 1}, "skip10": {"forwards": 4}}
    rate = prediction.add(Step([4], verified=1), 3000, stages, 5)
    seconds = 0.2 * 1.6 + 0.3 + 2 * 0.1 * 1.0 + 4 * 0.1 * 10 / 30  # retrieval: 2-token forwards over 1K
    assert rate == pytest.approx(5 / seconds)
    assert prediction.add(Step([5]), 3000, {"pair": {"forwards": 1}}, 6) is None  # not calibrated: no figure
