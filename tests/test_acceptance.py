"""Acceptance vectors: the layer-skip self-draft, measurement against exact expectations computed
from the same logits (ranks 1 and 2, sampled and greedy), calibration decoding, the file format."""

import json

import pytest
import torch

from conftest import tiny_llama
from specchat.core.sampling import SamplingParams, make_generator, warp
from specchat.core.acceptance import (AcceptanceFileError, AcceptanceVector,
                                           calibration_sequences, measure_acceptance)

SAMPLED = SamplingParams(temperature=1.0)
GREEDY = SamplingParams()


def ids_and_positions(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 97, (n,), generator=make_generator(seed)), torch.arange(n)


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.forward(ids, torch.arange(ids.shape[0]), model.new_cache())  # [L, vocab]


# --- TransformersLM.truncated ---

def test_truncated_shares_weights_and_keeps_the_original():
    model = tiny_llama(0)
    ids, positions = ids_and_positions(12)
    before = model.forward(ids, positions, model.new_cache())
    whole, short = model.truncated(2), model.truncated(1)
    original = dict(model.hf.named_parameters())
    for name, parameter in short.hf.named_parameters():
        assert parameter.data_ptr() == original[name].data_ptr(), name
    assert len(list(short.hf.parameters())) < len(original)  # the second layer is gone
    assert torch.equal(whole.forward(ids, positions, whole.new_cache()), before)
    assert not torch.allclose(short.forward(ids, positions, short.new_cache()), before, atol=1e-3)
    assert torch.equal(model.forward(ids, positions, model.new_cache()), before)
    assert model.hf.config.num_hidden_layers == len(model.hf.model.layers) == 2


def test_truncated_cache_forward_and_trim():
    short = tiny_llama(0).truncated(1)
    ids, positions = ids_and_positions(8)
    cache = short.new_cache()
    assert len(cache.transformers_cache.layers) == 1
    reference = short.forward(ids, positions, cache)  # [8, vocab]
    cache.trim(5)
    again = short.forward(ids[5:], positions[5:], cache)
    assert cache.length == 8
    assert torch.allclose(again, reference[5:], atol=1e-9)


@pytest.mark.parametrize("num_layers", [0, -1, 3])
def test_truncated_rejects_bad_layer_counts(num_layers):
    with pytest.raises(ValueError, match="between 1 and 2"):
        tiny_llama(0).truncated(num_layers)


# --- measure_acceptance ---

def random_sequences(count: int, length: int, seed: int) -> list[torch.Tensor]:
    """Teacher forcing measures any contexts: random ones spare the tests a decoding loop."""
    generator = make_generator(seed)
    return [torch.randint(0, 97, (length,), generator=generator) for _ in range(count)]


@pytest.mark.parametrize("params", [SAMPLED, GREEDY, SamplingParams(temperature=0.7, top_p=0.8)])
def test_draft_equal_to_target_is_always_accepted_at_rank_1(params):
    model = tiny_llama(0, weight_scale=8.0)
    vector = measure_acceptance(model, model, random_sequences(2, 36, 0), [6, 6], params, 3,
                                make_generator(1))
    assert vector.accepted == (vector.positions, 0, 0) and vector.positions == 2 * 30
    assert vector.p == (1.0, 0.0, 0.0)


def test_noisy_draft_ranks_decrease():
    target, draft = tiny_llama(3, weight_scale=8.0), tiny_llama(4, weight_scale=8.0)
    vector = measure_acceptance(target, draft, random_sequences(2, 100, 1), [6, 6], SAMPLED, 4,
                                make_generator(2), models="tiny 4 -> tiny 3")
    assert sum(vector.p) <= 1.0 and vector.width == 4 and vector.models == "tiny 4 -> tiny 3"
    assert vector.p[0] > vector.p[2] > 0 and vector.p[0] < 0.9


def exact_rank_probabilities(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q [m, vocab] (fp64) -> [m, 2]: the exact probability that child 1, resp. child 2 (drawn
    from Q without replacement) is the accepted one, written out independently of verify.py:
    rank 1 = sum min(P, Q) = 1 - TV(P, Q); rank 2 = sum over x1 of Q(x1) (1 - P(x1)/Q(x1))^+
    times sum_x2 min(R(x2), Q_x1(x2)), R = norm((P - Q)^+), Q_x1 = Q without x1, renormalized."""
    first = torch.minimum(p, q).sum(-1)  # [m]
    leftover = (p - q).clamp(min=0)
    r = leftover / leftover.sum(-1, keepdim=True).clamp(min=1e-300)  # [m, vocab]
    vocab = p.shape[-1]
    without = q[:, None, :] * (1 - torch.eye(vocab, dtype=q.dtype))  # [m, x1, x2]
    without = without / (1 - q[:, :, None]).clamp(min=1e-300)
    second_given = torch.minimum(r[:, None, :], without).sum(-1)  # [m, x1]
    second = ((q - p).clamp(min=0) * second_given).sum(-1)  # [m]
    return torch.stack([first, second], -1)


@pytest.mark.parametrize("width", [1, 2])
def test_sampled_acceptance_matches_the_exact_expectation(width):
    target, draft = tiny_llama(3, weight_scale=8.0), tiny_llama(4, weight_scale=8.0)
    sequences, lengths = random_sequences(4, 106, 3), [6] * 4
    repeats = 4  # fresh draws on the same contexts: more positions at no forward cost
    vector = measure_acceptance(target, draft, sequences * repeats, lengths * repeats, SAMPLED,
                                width, make_generator(4))
    exact = torch.cat([exact_rank_probabilities(
        warp(full_logits(target, ids)[length - 1:-1], SAMPLED).double(),
        warp(full_logits(draft, ids)[length - 1:-1], SAMPLED).double())
        for ids, length in zip(sequences, lengths)]).repeat(repeats, 1)  # [positions, 2]
    assert vector.positions == exact.shape[0] == repeats * 4 * 100
    expected = exact.mean(0)
    # Counts are sums of independent Bernoullis: standard error sqrt(sum a (1 - a)) / n.
    standard_error = (exact * (1 - exact)).sum(0).sqrt() / exact.shape[0]
    assert 0.3 < float(expected[0]) < 0.9  # a draft that is neither perfect nor useless
    for rank in range(width):
        assert abs(vector.p[rank] - float(expected[rank])) < 4 * float(standard_error[rank]) + 1e-9


def test_greedy_acceptance_is_the_rank_of_the_target_argmax_among_draft_top_tokens():
    target = tiny_llama(5, weight_scale=8.0)
    draft = target.truncated(1)
    sequences, lengths = random_sequences(3, 56, 5), [6] * 3
    vector = measure_acceptance(target, draft, sequences, lengths, GREEDY, 3, make_generator(0))
    expected = [0, 0, 0]
    for ids, length in zip(sequences, lengths):
        best = full_logits(target, ids)[length - 1:-1].argmax(-1)  # [m]
        top = full_logits(draft, ids)[length - 1:-1].topk(3).indices  # [m, 3]
        for rank in range(3):
            expected[rank] += int((top[:, rank] == best).sum())
    assert list(vector.accepted) == expected and vector.positions == 150
    assert vector.accepted[0] > 0 and sum(expected) < 150


def test_measure_rejects_bad_input():
    model = tiny_llama(0)
    ids = torch.arange(10)
    with pytest.raises(ValueError, match="width"):
        measure_acceptance(model, model, [ids], [4], SAMPLED, 0, make_generator(0))
    with pytest.raises(ValueError, match="prompt length"):
        measure_acceptance(model, model, [ids], [11], SAMPLED, 2, make_generator(0))
    with pytest.raises(ValueError, match="no continuation"):
        measure_acceptance(model, model, [ids], [10], SAMPLED, 2, make_generator(0))
    with pytest.raises(ValueError, match="vocabulary"):
        measure_acceptance(model, tiny_llama(0, vocab_size=50), [ids], [4], SAMPLED, 2,
                           make_generator(0))


# --- calibration_sequences ---

def test_calibration_decodes_greedily_and_stops_after_a_stop_token():
    model = tiny_llama(0, weight_scale=8.0)
    prompt = torch.arange(5)
    [full] = calibration_sequences(model, [prompt], GREEDY, make_generator(0), 20)
    assert full.shape[0] == 25 and torch.equal(full[:5], prompt)
    # Greedy: each continuation token is the argmax after its context.
    assert torch.equal(full_logits(model, full)[4:-1].argmax(-1), full[5:])
    stop = int(full[9])
    first_stop = 5 + int((full[5:] == stop).nonzero()[0])
    [stopped] = calibration_sequences(model, [prompt], GREEDY, make_generator(0), 20, {stop})
    assert torch.equal(stopped, full[:first_stop + 1])


# --- the file ---

def test_save_and_load_round_trip(tmp_path):
    vector = AcceptanceVector((40, 9, 3), 60, 0.7, 0, 0.9, "draft -> target")
    path = tmp_path / "sub" / "acceptance.json"
    vector.save(path)
    loaded = AcceptanceVector.load(path, SamplingParams(temperature=0.7, top_p=0.9, seed=3),
                                   "draft -> target")
    assert loaded == vector and loaded.p == (40 / 60, 9 / 60, 3 / 60)
    assert json.loads(path.read_text())["p"] == list(vector.p)
    assert list(tmp_path.glob("sub/*")) == [path]  # no temporary file left behind


def test_load_refuses_corrupt_and_mismatched_files(tmp_path):
    path = tmp_path / "acceptance.json"
    vector = AcceptanceVector((40, 9), 60, 1.0, 0, 1.0, "a -> b")
    vector.save(path)
    good = json.loads(path.read_text())
    with pytest.raises(AcceptanceFileError, match="temperature 1.0"):
        AcceptanceVector.load(path, SamplingParams(temperature=0.5))
    with pytest.raises(AcceptanceFileError, match="'a -> b'"):
        AcceptanceVector.load(path, models="c -> b")
    for broken in [path.read_text()[:30], "[]", json.dumps({**good, "version": 0}),
                   json.dumps({**good, "accepted": [40, 30]}),  # more acceptances than positions
                   json.dumps({**good, "positions": 60.5}),
                   json.dumps({key: value for key, value in good.items() if key != "top_p"})]:
        path.write_text(broken)
        with pytest.raises(AcceptanceFileError, match="not a valid acceptance file"):
            AcceptanceVector.load(path)
    with pytest.raises(FileNotFoundError):
        AcceptanceVector.load(tmp_path / "missing.json")


# --- the embedded model ---

@pytest.mark.slow
def test_embedded_layer_skip_draft(embedded_engine):
    """20 of 30 layers: shallower self-drafts of SmolLM2 accept too rarely (p_1 ~ 0.05 at 10
    layers) for a 32-token sample to assert p_1 > 0 robustly."""
    target = embedded_engine.model
    prompt = torch.tensor(embedded_engine.chat_ids(
        [{"role": "user", "content": "Name three uses of copper."}]))
    [sequence] = calibration_sequences(target, [prompt], GREEDY, make_generator(0), 32,
                                       embedded_engine.stop_ids)
    draft = target.truncated(20)
    for params in (GREEDY, SAMPLED):
        vector = measure_acceptance(target, draft, [sequence], [prompt.shape[0]], params, 4,
                                    make_generator(0))
        assert vector.positions == sequence.shape[0] - prompt.shape[0]
        assert vector.p[0] > 0 and sum(vector.p) <= 1.0
