"""Speculative verification of a chain of draft tokens (Leviathan et al., algorithms.md section 1).

Vocabulary: the drafter proposes draft tokens x_1..x_g with draft distributions Q_1..Q_g; one
target forward gives P_1..P_{g+1}. Each draft token is accepted with probability
min(1, P_i(x_i) / Q_i(x_i)); at the first rejection a recovered token is drawn from the residual
norm(max(P_i - Q_i, 0)); if all are accepted, a bonus token is drawn from P_{g+1}. The emitted
sequence is then distributed exactly as sampling from P token by token (lossless).
A deterministic drafter (prompt lookup) has one-hot Q; greedy decoding has one-hot P (see
`sampling.warp`), so the same rule serves every case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import sample


@dataclass(frozen=True)
class ChainVerdict:
    accepted: int  # how many leading draft tokens were accepted
    next_token: int  # the recovered token (after a rejection) or the bonus token (all accepted)


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """min(1, P(x) / Q(x)) for each draft token; p, q [g, vocab], tokens [g] -> [g]."""
    rows = torch.arange(tokens.shape[0])
    return (p[rows, tokens] / q[rows, tokens]).clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(P - Q, 0)) [vocab]: what to sample from after rejecting a draft token.

    When P == Q (up to rounding) the residual is all zero; rejection then has probability zero
    in exact arithmetic, so any reachable case is rounding noise and P itself is the right answer.
    """
    leftover = (p - q).clamp(min=0.0)
    total = leftover.sum()
    if total <= 1e-12:
        return p
    return leftover / total


def verify_chain(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                 generator: torch.Generator | None) -> ChainVerdict:
    """draft_tokens [g], q [g, vocab], p [g + 1, vocab] (fp32) -> accepted count and next token."""
    g = draft_tokens.shape[0]
    accept = torch.rand(g, generator=generator) < acceptance_probability(p[:g], q, draft_tokens)
    rejected = (~accept).nonzero()
    if rejected.numel() == 0:
        return ChainVerdict(g, sample(p[g], generator))
    first = int(rejected[0])
    return ChainVerdict(first, sample(residual(p[first], q[first]), generator))
