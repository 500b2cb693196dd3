import pytest
import torch

from specchat.core.sampling import SamplingParams, warp


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    probs = warp(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    probs = warp(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits.float() / 0.5, -1))


def test_top_k_keeps_k_most_likely():
    probs = warp(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_k=2))
    expected = torch.softmax(torch.tensor([4.0, 3.0]), -1)
    assert probs[[0, 3]].tolist() == [0.0, 0.0]
    assert torch.allclose(probs[[1, 2]], expected)


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the two most likely tokens stay, renormalized.
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # The most likely token always stays, even when it alone exceeds p.
    assert warp(logits, SamplingParams(temperature=1.0, top_p=0.1)).tolist() == [1.0, 0.0, 0.0, 0.0]


def full_sort_top_p(probs, top_p):
    """The nucleus by a full sort of the vocabulary (what `warp` did before it searched the top k)."""
    sorted_probs, order = probs.sort(-1, descending=True)
    sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


@pytest.mark.parametrize("spread", [8.0, 3.0, 1.0, 0.2])  # nuclei of 6 to 48,329 tokens: every k the search reaches
def test_top_p_among_the_top_k_is_the_full_sorts_nucleus(spread):
    from specchat.core.sampling import _top_p_filter

    generator = torch.Generator().manual_seed(11)
    probs = (torch.randn(5, 49152, generator=generator) * spread).softmax(-1)
    for top_p in (0.5, 0.9, 0.99):
        assert torch.equal(_top_p_filter(probs, top_p), full_sort_top_p(probs, top_p))


def test_penalties_on_the_seen_columns_equal_them_over_the_whole_vocabulary():
    from test_repetition import reference_penalties

    from specchat.core.sampling import apply_penalties

    generator = torch.Generator().manual_seed(12)
    logits = torch.randn(3, 500, generator=generator) * 3
    counts = torch.zeros(3, 500)
    counts[0, [3, 7, 400]] = torch.tensor([1.0, 2.0, 1.0])  # each row its own seen tokens
    counts[2, [7, 9]] = 3.0
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=-0.5)
    torch.testing.assert_close(apply_penalties(logits, counts, params), reference_penalties(logits, counts, params),
                               rtol=0, atol=1e-6)
    assert torch.equal(apply_penalties(logits, torch.zeros(3, 500), params), logits)


def test_temperature_divides_in_float32_unless_it_rounds_to_zero_there():
    logits = torch.tensor([[1.0, 2.0, 3.0, -50.0]])
    for temperature in (0.7, 1e-30):
        expected = ((logits - 3.0).double() / temperature).softmax(-1).float()
        torch.testing.assert_close(warp(logits, SamplingParams(temperature=temperature)), expected,
                                   rtol=1e-6, atol=1e-7)
    tiny = warp(logits, SamplingParams(temperature=1e-50))  # 0 in float32: float64 keeps it finite
    assert tiny.tolist() == [[0.0, 0.0, 1.0, 0.0]]


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")),
                                    dict(temperature=float("inf")), dict(top_k=-1), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(seed=-1), dict(seed=2**64)])
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-30, 1e-3])
def test_any_positive_temperature_gives_a_distribution(temperature):
    # A tiny temperature concentrates on the most likely tokens (ties share), never NaN or inf.
    logits = torch.tensor([[1.0, 3.0, 3.0, -float("inf")], [-2.0, 0.5, 0.25, 0.0]])
    probs = warp(logits, SamplingParams(temperature=temperature))
    assert probs.tolist() == [[0.0, 0.5, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0]]


def test_shifting_before_the_temperature_keeps_the_distribution():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    for temperature in (0.3, 1.0, 1.7):
        expected = torch.softmax(logits.double() / temperature, -1).float()
        assert torch.allclose(warp(logits, SamplingParams(temperature=temperature)), expected, atol=1e-7)
