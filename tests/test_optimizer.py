"""The hardware-aware optimizer: the speedup formula, choices that follow the shape of t(n),
agreement with a brute-force grid over DP trees, t(n) interpolation and its file, measurement."""

import json
import time

import pytest
import torch
from conftest import tiny_llama

from specchat.core.speculative.forward_times import ForwardTimes
from specchat.core.speculative.optimizer import (chain_choice, choose_tree,
                                          measure_forward_times, relative_times, speedup)
from specchat.core.speculative.tree import Tree
from specchat.core.speculative.tree_dp import best_tree

ACCEPTANCE = [0.7, 0.12, 0.05, 0.03, 0.02]  # sums to < 1, like a measured vector
TOL = 1e-12


def times(sizes, ratios, context=1024) -> ForwardTimes:
    return ForwardTimes(tuple(sizes), tuple(float(r) for r in ratios), one_token_seconds=0.02,
                        context=context, device="test")


FLAT = times([1, 1024], [1, 1])  # offloaded: the transfer dominates, t(n) = 1
LINEAR = times([1, 2], [1, 2])  # compute-bound: t(n) = n (extrapolated along the last segment)


def test_speedup_formula():
    assert speedup(3.0, 1.5, 4, 0.125) == pytest.approx(3.0 / (1.5 + 4 * 0.125))
    assert speedup(2.8, 1.2, 2, 0.05) == pytest.approx(2.8 / 1.3)
    assert speedup(1.0, 1.0, 0, 123.0) == 1.0  # plain decoding


def test_plain_decoding_when_drafts_are_too_expensive():
    choice = choose_tree(ACCEPTANCE, FLAT, draft_cost=10.0, max_size=64, max_depth=8)
    assert (choice.size, choice.depth, choice.expected_tokens, choice.speedup) == (1, 0, 1.0, 1.0)
    assert "does not pay" in choice.reason


def test_plain_decoding_when_acceptance_is_tiny():
    choice = choose_tree([1e-4, 1e-5], FLAT, draft_cost=0.05, max_size=64, max_depth=8)
    assert (choice.size, choice.depth, choice.speedup) == (1, 0, 1.0)
    assert "does not pay" in choice.reason


def test_flat_verification_time_picks_a_large_deep_tree():
    choice = choose_tree(ACCEPTANCE, FLAT, draft_cost=0.001, max_size=128, max_depth=16)
    assert choice.size == 128  # G grows with every node and the forward costs the same
    assert choice.depth >= 8
    assert choice.speedup > 3.0
    assert f"n={choice.size}, d={choice.depth}" in choice.reason


def test_linear_verification_time_never_pays():
    # t(n) = n: each node scores at most 1, so G(n, d) <= n = t(n) and no tree beats plain decoding.
    choice = choose_tree([0.95, 0.04], LINEAR, draft_cost=0.0, max_size=64, max_depth=8)
    assert choice.size == 1


def test_steep_verification_time_picks_a_small_tree():
    steep = times([1, 2, 64], [1, 1.2, 1 + 0.2 * 63])  # t(n) = 1 + 0.2 (n - 1)
    choice = choose_tree(ACCEPTANCE, steep, draft_cost=0.01, max_size=128, max_depth=16)
    assert 2 <= choice.size <= 8 and choice.speedup > 1.0


@pytest.mark.parametrize("acceptance", [ACCEPTANCE, [0.9, 0.05], [0.3, 0.2, 0.1], [0.05, 0.01]])
@pytest.mark.parametrize("draft_cost", [0.0, 0.1, 0.4])
def test_choice_matches_brute_force_grid(acceptance, draft_cost):
    curve = times([1, 3, 8, 16], [1, 1.05, 1.6, 2.5])
    best = (1.0, 1, 0)  # plain decoding
    for depth in range(1, 5):
        for size in range(2, 13):
            try:
                tree = best_tree(acceptance, size, depth)
            except ValueError:  # no tree of that size fits the depth with this many ranks
                continue
            rate = tree.score(acceptance) / (curve.relative(size) + depth * draft_cost)
            if rate > best[0] + TOL:
                best = (rate, size, depth)
    choice = choose_tree(acceptance, curve, draft_cost, max_size=12, max_depth=4)
    assert choice.speedup == pytest.approx(best[0], abs=1e-9)
    assert (choice.size, choice.depth) == best[1:]
    if choice.size > 1:
        tree = best_tree(acceptance, choice.size, choice.depth)
        assert tree.depth == choice.depth  # the chosen depth is the draft steps the tree needs
        assert choice.expected_tokens == pytest.approx(tree.score(acceptance), abs=1e-9)


def test_choice_is_fast_at_512_nodes_depth_16():
    acceptance = [0.8] + [0.03 * 0.85**i for i in range(31)]  # deep: the bound binds at every depth
    curve = times([1, 64, 256, 512], [1, 1.1, 1.6, 2.4])
    start = time.perf_counter()
    choice = choose_tree(acceptance, curve, draft_cost=0.02, max_size=512, max_depth=16)
    elapsed = time.perf_counter() - start
    assert choice.size > 1
    assert elapsed < 5.0, f"choose_tree took {elapsed:.2f} s"  # typically ~0.5 s; a shared box


def test_chain_choice_matches_chain_scores():
    curve = times([1, 4, 16], [1, 1.1, 1.9])
    draft_cost = 0.05
    rates = {g: Tree.chain(g).score(ACCEPTANCE) / (curve.relative(g + 1) + g * draft_cost)
             for g in range(1, 13)}
    length = max(rates, key=rates.get)
    choice = chain_choice(ACCEPTANCE, curve, draft_cost, max_length=12)
    assert (choice.size, choice.depth) == (length + 1, length)
    assert choice.speedup == pytest.approx(rates[length], abs=1e-12)
    assert choice.expected_tokens == pytest.approx(sum(0.7**i for i in range(length + 1)))
    assert "chain of" in choice.reason
    # a chain is one of the trees the grid searches, so the tree choice is at least as fast
    tree = choose_tree(ACCEPTANCE, curve, draft_cost, max_size=13, max_depth=12)
    assert tree.speedup >= choice.speedup - TOL


def test_chain_choice_falls_back_to_plain_decoding():
    choice = chain_choice([0.1], FLAT, draft_cost=0.5, max_length=8)
    assert (choice.size, choice.depth, choice.speedup) == (1, 0, 1.0)


def test_invalid_grids_are_rejected():
    with pytest.raises(ValueError):
        choose_tree(ACCEPTANCE, FLAT, 0.1, max_size=1, max_depth=4)
    with pytest.raises(ValueError):
        choose_tree(ACCEPTANCE, FLAT, 0.1, max_size=8, max_depth=0)
    with pytest.raises(ValueError):
        choose_tree(ACCEPTANCE, FLAT, -0.1, max_size=8, max_depth=4)
    with pytest.raises(ValueError):
        chain_choice([], FLAT, 0.1, max_length=4)


def test_forward_times_interpolate():
    curve = times([1, 5, 9], [1, 2, 2.4])
    assert curve.relative(1) == 1.0 and curve.relative(5) == 2.0 and curve.relative(9) == 2.4
    assert curve.relative(3) == pytest.approx(1.5)
    assert curve.relative(7) == pytest.approx(2.2)
    assert curve.relative(13) == pytest.approx(2.8)  # beyond: along the last segment
    assert curve.relative(0) == 1.0  # flat below 1
    batch = relative_times(curve, torch.arange(15))  # the tensor form the optimizer uses
    assert batch.dtype == torch.float64
    assert batch.tolist() == pytest.approx([curve.relative(n) for n in range(15)])


def test_forward_times_never_extrapolate_downwards():
    noisy = times([1, 8, 16], [1, 1.5, 1.4])  # measurement noise: t(16) < t(8)
    assert noisy.relative(12) == pytest.approx(1.45)  # inside: as measured
    assert noisy.relative(64) == pytest.approx(1.4)  # beyond: flat, not falling
    assert times([1], [1]).relative(100) == 1.0


@pytest.mark.parametrize("sizes, ratios", [
    ([2, 4], [1, 2]), ([1, 4], [1.1, 2]), ([1, 4, 4], [1, 2, 3]), ([1, 4], [1, -2]), ([1, 4], [1]),
])
def test_forward_times_reject_bad_curves(sizes, ratios):
    with pytest.raises(ValueError):
        ForwardTimes(tuple(sizes), tuple(ratios), one_token_seconds=0.02, context=0, device="x")


def test_forward_times_file_round_trip(tmp_path):
    curve = times([1, 16, 128], [1, 1.25, 3.5], context=8192)
    path = tmp_path / "sub" / "times.json"
    curve.save(path)
    assert ForwardTimes.load(path) == curve
    assert [p.name for p in path.parent.iterdir()] == ["times.json"]  # no temporary left


@pytest.mark.parametrize("content", [
    "not json {",
    "[1, 2]",
    json.dumps({"version": 1, "sizes": [1, 4]}),
    json.dumps({"version": 99, "sizes": [1], "ratios": [1], "one_token_seconds": 1,
                "context": 0, "device": "x"}),
    json.dumps({"version": 1, "sizes": [1, 4], "ratios": [1, 0], "one_token_seconds": 1,
                "context": 0, "device": "x"}),
])
def test_forward_times_corrupt_file(tmp_path, content):
    path = tmp_path / "times.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="not a valid forward-times file"):
        ForwardTimes.load(path)


class Recording:
    """A CausalLM recording every cache and each forward's (cache length before, positions, n,
    last_only)."""

    def __init__(self, model):
        self.model, self.calls, self.caches = model, [], []
        self.vocab_size, self.context_length = model.vocab_size, model.context_length

    def new_cache(self):
        self.caches.append(self.model.new_cache())
        return self.caches[-1]

    def forward(self, ids, positions, cache, mask=None, last_only=False):
        self.calls.append((cache.length, positions.tolist(), ids.shape[0], last_only))
        return self.model.forward(ids, positions, cache, mask, last_only)


def test_measure_forward_times_on_a_tiny_model():
    model = Recording(tiny_llama(0))
    context, repeats = 80, 3
    measured = measure_forward_times(model, context, sizes=[4, 16], repeats=repeats)
    assert measured.sizes == (1, 4, 16) and measured.relative(1) == 1.0
    assert all(r > 0 for r in measured.ratios) and measured.one_token_seconds > 0
    assert measured.context == context and measured.device.startswith("cpu")
    assert [cache.length for cache in model.caches] == [context]  # one cache, nothing leaked
    timed = [call for call in model.calls if not call[3]]
    assert len(timed) == 3 * (1 + repeats)  # a warm-up and the repeats per size
    for length, positions, n, _ in timed:  # every timed forward sees the same context
        assert length == context and positions == list(range(context, context + n))


def test_measure_forward_times_rejects_too_long_a_context():
    with pytest.raises(ValueError, match="exceeds"):
        measure_forward_times(tiny_llama(0), context=500, sizes=[16], repeats=1)
