"""Speculative verification of a chain of draft tokens (Leviathan et al., algorithms.md section 1).

Vocabulary: the drafter proposes draft tokens x_1..x_g with draft distributions Q_1..Q_g; one
target forward gives P_1..P_{g+1}. Each draft token is accepted with probability
min(1, P_i(x_i) / Q_i(x_i)); at the first rejection a recovered token is drawn from the residual
norm(max(P_i - Q_i, 0)); if all are accepted, a bonus token is drawn from P_{g+1}. The emitted
sequence is then distributed exactly as sampling from P token by token (lossless).
A deterministic drafter (prompt lookup) has one-hot Q; greedy decoding has one-hot P (see
`sampling.warp`), so the same rule serves every case.

Trees (Sequoia, Chen et al., Algorithm 1; algorithms.md section 2): a node's children are draft
tokens drawn without replacement from the node's Q (or chosen deterministically) and are tested
in rank order against a residual R and a draft D, both updated after each rejection, so that a
rejected token is never proposed again. The first accepted child is descended into; if none is,
a recovered token is drawn from the final R; an accepted node without children gives a bonus
token from its P. Each node emits a token distributed exactly as its P, so the tree is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import draw, on_device, sample
from .tree import Tree


@dataclass(frozen=True)
class ChainVerdict:
    accepted: int  # how many leading draft tokens were accepted
    next_token: int  # the recovered token (after a rejection) or the bonus token (all accepted)


def acceptance_probability(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """min(1, P(x) / Q(x)) for each draft token, on p's device; p [g, vocab], tokens [g], q [g,
    vocab] or None for a deterministic draft (Q(x) = 1) -> [g]."""
    rows, tokens = torch.arange(tokens.shape[0], device=p.device), tokens.to(p.device)
    target = p[rows, tokens]
    return (target if q is None else target / q.to(p.device)[rows, tokens]).clamp(max=1.0)


def point_mass(token: torch.Tensor | int, like: torch.Tensor) -> torch.Tensor:
    """[vocab] all on `token` (an int, or a one-element tensor: no host read), in `like`'s dtype
    and on its device: the Q of a deterministic draft token."""
    mass = torch.zeros_like(like)
    if isinstance(token, int):
        mass[token] = 1.0
    else:
        mass.index_fill_(0, token.to(like.device).view(1), 1.0)
    return mass


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(P - Q, 0)) [vocab]: what to sample from after rejecting a draft token.

    When P == Q (up to rounding) the residual is all zero; rejection then has probability zero
    in exact arithmetic, so any reachable case is rounding noise and P itself is the right answer.
    (Chosen on the device: deciding on the host would wait for the GPU.)
    """
    leftover = (p - q).clamp(min=0.0)
    total = leftover.sum()
    return torch.where(total > 1e-12, leftover / total, p)


def verify_chain(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                 generator: torch.Generator | None) -> ChainVerdict:
    """draft_tokens [g], q [g, vocab] (or None: a deterministic draft, each Q the one-hot of its
    token), p [g + 1, vocab] (fp32) -> accepted count and next token.

    Runs where p is: the uniforms are drawn there, and the two numbers of the verdict are all
    that comes back to the host, in one transfer."""
    g = draft_tokens.shape[0]
    if g == 0:
        return ChainVerdict(0, sample(p[0], generator))
    device = p.device
    tokens = draft_tokens.to(device)
    q = None if q is None else q.to(device)
    uniforms = torch.rand(g, generator=on_device(generator, device), device=device)
    accept = uniforms < acceptance_probability(p[:g], q, tokens)
    # The first rejected draft's index, or g when every one was accepted (the sentinel).
    accepted = torch.cat([~accept, accept.new_ones(1)]).to(torch.uint8).argmax()
    row = accepted.clamp(max=g - 1).view(1)
    p_row = p.index_select(0, row)[0]
    q_row = point_mass(tokens.index_select(0, row), p_row) if q is None else q.index_select(0, row)[0]
    next_distribution = torch.where(accepted < g, residual(p_row, q_row), p[g])
    count, token = torch.cat([accepted.view(1), draw(next_distribution, generator)]).tolist()
    return ChainVerdict(count, token)


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted nodes, from the root's child downward (empty: none accepted)
    next_token: int  # the recovered token (no child of the last node reached was accepted) or
    #                  the bonus token (the last accepted node has no children)


@dataclass(frozen=True)
class NodeState:
    """Verification state at one node once some children were rejected (Algorithm 1's R and S)."""
    residual: torch.Tensor  # [vocab] R: the recovered token's distribution if no child is accepted
    rejected: torch.Tensor  # [vocab] bool S: the children rejected so far


def node_start(p: torch.Tensor) -> NodeState:
    """Before any child is tested: R = P [vocab], nothing rejected."""
    return NodeState(p, torch.zeros(p.shape, dtype=torch.bool, device=p.device))


def child_proposal(q: torch.Tensor | None, state: NodeState, token: int) -> torch.Tensor:
    """D [vocab]: the distribution the next child (draft token `token`) was drawn from.

    Sampled children (q [vocab]): Q without the tokens rejected so far, renormalized, which is
    what drawing without replacement draws from; once Q's whole support is rejected, uniform over
    the tokens not rejected (Algorithm 1's fallback; `sample_without_replacement` never draws
    there, but a drafter following Algorithm 1 may). Computing D from Q and S rather than
    updating it in place gives the same sequence. Deterministic children (q None, e.g. prompt
    lookup branches or greedy top-k): the one-hot of the child's own token, a point-mass proposal,
    so a rejection just removes that token from R.
    """
    if q is None:
        return point_mass(token, state.residual)
    draft = q.masked_fill(state.rejected, 0.0)  # [vocab]
    total = draft.sum()
    if total == 0:
        draft = (~state.rejected).to(q.dtype)
        total = draft.sum()
    return draft / total


def child_acceptance(state: NodeState, d: torch.Tensor, token: int) -> float:
    """min(1, R[x] / D[x]): the probability that child x is accepted, its elder siblings rejected.

    A child with D[x] == 0 cannot have been drawn from D (a repeated sibling, or a token outside
    Q's support while Q has mass left): it is treated as absent, never accepted (and
    `reject_child` leaves the state alone), instead of dividing by zero.
    """
    d_x = float(d[token])
    return min(1.0, float(state.residual[token]) / d_x) if d_x > 0 else 0.0


def reject_child(state: NodeState, d: torch.Tensor, token: int) -> NodeState:
    """After child x, drawn from D, is rejected: R <- norm(max(R - D, 0)) with this D, x joins S.

    A rejection needs R[x] < D[x], so max(R - D, 0) has mass at least D[x] - R[x] > 0 in exact
    arithmetic; `residual`'s fallback to R only catches rounding with R ~ D (for a one-hot R, as
    in greedy decoding, R is then exactly right). An absent child (D[x] == 0) changes nothing: the
    node then behaves as if that child did not exist, which is still lossless, so a drafter may
    pad a static tree by repeating a sibling's token.
    """
    if not d[token] > 0:
        return state
    rejected = state.rejected.clone()
    rejected[token] = True
    return NodeState(residual(state.residual, d), rejected)


def verify_node(p: torch.Tensor, q: torch.Tensor | None, children: list[int],
                uniforms: list[float]) -> tuple[int | None, torch.Tensor | None]:
    """Test one node's children (draft tokens, in rank order) with one uniform each.

    p [vocab], q [vocab] or None (deterministic children) -> (rank of the accepted child, None),
    or (None, R [vocab]) when every child was rejected: R is what the recovered token is drawn
    from (P itself for a node without children: the bonus token's distribution).
    """
    state = node_start(p)
    for rank, (token, uniform) in enumerate(zip(children, uniforms)):
        d = child_proposal(q, state, token)  # [vocab]
        if uniform < child_acceptance(state, d, token):
            return rank, None
        state = reject_child(state, d, token)
    return None, state.residual


def verify_tree(tree: Tree, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                generator: torch.Generator | None) -> TreeVerdict:
    """Sequoia verification of a token tree from one target forward.

    tokens [n] (tokens[0], the root, is the last committed token), p [n, vocab] target
    distributions after each node (fp32, warped), q [n, vocab] the draft distributions each
    node's children were drawn from without replacement (leaves' rows are unused), or None when
    children were chosen deterministically -> the accepted path and the recovered or bonus token.
    """
    if q is not None:
        q = q.to(p.device)
    # Fresh, one per child tested. The walk reads a few numbers per child tested from the device
    # (a handful of short waits); every distribution stays there.
    uniforms = torch.rand(tree.size, generator=on_device(generator, p.device), device=p.device).tolist()
    token_ids = tokens.tolist()
    path, node = [], 0
    while True:
        children = tree.children[node]
        rank, recovered = verify_node(p[node], None if q is None else q[node],
                                      [token_ids[child] for child in children],
                                      [uniforms[child] for child in children])
        if rank is None:
            return TreeVerdict(path, sample(recovered, generator))
        node = children[rank]
        path.append(node)
