"""Pure: the exact distribution each verification rule emits, by enumeration over tiny
vocabularies (the `verify` module's rules looked up at call time, so a broken rule shows), and
Pearson's chi-square p-value for sampled checks. The self-test and the tests share them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from .speculative import verify


def random_distribution(generator: torch.Generator, size: int, zeros: int = 0) -> torch.Tensor:
    """A float64 distribution over `size` tokens with `zeros` of them impossible."""
    probs = torch.rand(size, generator=generator, dtype=torch.float64) + 0.05
    probs[torch.randperm(size, generator=generator)[:zeros]] = 0.0
    return probs / probs.sum()


def random_case(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Q) with zeros and partial (even disjoint) supports, varying with the seed."""
    generator = torch.Generator().manual_seed(seed)
    return random_distribution(generator, size, seed % 3), random_distribution(generator, size, (seed // 3) % 4)


def chain_outcome(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Exact distribution [vocab] of the token emitted for one draft token x ~ Q verified against
    P, and the acceptance probability: sum_x Q(x) [a(x) delta_x + (1 - a(x)) residual(P, Q)]."""
    emitted, accepted = torch.zeros_like(p), 0.0
    for x in q.nonzero().flatten().tolist():
        a = float(verify.acceptance_probability(p[None], q[None], torch.tensor([x]))[0])
        emitted[x] += q[x] * a
        emitted += q[x] * (1 - a) * verify.residual(p, q)
        accepted += float(q[x]) * a
    return emitted, accepted


def without_replacement_draws(q: torch.Tensor, k: int) -> Iterator[tuple[tuple[int, ...], float]]:
    """Every ordered tuple `sample_without_replacement(q, k)` can return, with its probability:
    min(k, |support|) distinct tokens, the j-th with probability Q(x_j) / (1 - Q(x_1..x_{j-1}))."""
    support = q.nonzero().flatten().tolist()
    for draw in itertools.permutations(support, min(k, len(support))):
        prob, left = 1.0, 1.0
        for x in draw:
            prob, left = prob * float(q[x]) / left, left - float(q[x])
        yield draw, prob


def node_outcome(p: torch.Tensor, q: torch.Tensor | None, children: list[int]) -> tuple[torch.Tensor, float]:
    """Exact distribution [vocab] of the token one tree node emits (the accepted child, else the
    recovered token) for fixed children in rank order, and the probability that a child is
    accepted: `verify.verify_node`'s walk, with each uniform's outcome weighted instead of drawn."""
    state, reach = verify.node_start(p), 1.0  # reach: probability that every child so far was rejected
    emitted = torch.zeros_like(p)
    for x in children:
        d = verify.child_proposal(q, state, x)
        accept = verify.child_acceptance(state, d, x)
        emitted[x] += reach * accept
        reach *= 1 - accept
        state = verify.reject_child(state, d, x)
    return emitted + reach * state.residual, 1 - reach


def drafted_outcome(p: torch.Tensor, q: torch.Tensor, k: int) -> tuple[torch.Tensor, float]:
    """`node_outcome` averaged over the exact probabilities of k children drawn without replacement."""
    emitted, accepted = torch.zeros_like(p), 0.0
    for children, prob in without_replacement_draws(q, k):
        node_emitted, node_accepted = node_outcome(p, q, list(children))
        emitted += prob * node_emitted
        accepted += prob * node_accepted
    return emitted, accepted


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p - q).abs().sum()) / 2


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square p-value that `counts` were drawn from `probs` (no SciPy needed).

    Outcomes expected fewer than `min_expected` times are pooled into one bin, as the test's
    approximation requires; an outcome of probability 0 that was sampled gives 0.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    rare = (expected < min_expected) & (probs > 0)
    common = expected >= min_expected
    observed_bins, expected_bins = [counts[common]], [expected[common]]
    if rare.any():
        observed_bins.append(counts[rare].sum()[None])
        expected_bins.append(expected[rare].sum()[None])
    observed, expected = torch.cat(observed_bins), torch.cat(expected_bins)
    if observed.numel() < 2:
        raise ValueError("too few outcomes for a chi-square test")
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(observed.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))
