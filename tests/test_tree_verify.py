"""Sequoia tree verification is lossless: exact enumeration of one node's rule (sampled and
deterministic children), its optimal-transport and coverage properties, and chi-square over
seeded samples through `verify_tree` on a multi-level tree."""

import itertools

import pytest
import torch

from conftest import DEVICES
from specchat.core.exact_outcomes import chi_square_p_value
from specchat.core.exact_outcomes import without_replacement_draws
from specchat.core.sampling import SamplingParams, sample, sample_without_replacement, warp
from specchat.core.speculative.tree import Tree
from specchat.core.speculative.verify import (NodeState, child_acceptance, child_proposal, node_start,
                                       reject_child, residual, verify_tree)

VOCAB = 5
# Root with 3 children; its first child has 2 children, the first of which has one: depth 3.
TREE = Tree((-1, 0, 0, 0, 1, 1, 4))


def random_dist(generator, zeros=0):
    probs = torch.rand(VOCAB, generator=generator, dtype=torch.float64) + 0.05
    probs[torch.randperm(VOCAB, generator=generator)[:zeros]] = 0.0
    return probs / probs.sum()


def with_replacement_draws(q, k):
    """SpecInfer's drafting: k independent draws from Q."""
    support = q.nonzero().flatten().tolist()
    for draw in itertools.product(support, repeat=k):
        yield draw, float(torch.prod(q[list(draw)]))


def node_outcome(p, q, children, proposal=child_proposal, acceptance=child_acceptance,
                 reject=reject_child):
    """Exact distribution [vocab] of the token one node emits (the accepted child, else the
    recovered token) for fixed children in rank order, and the probability that a child is
    accepted, through the module's per-node steps (or substitutes for them)."""
    state, reach = node_start(p), 1.0  # reach: probability that every child so far was rejected
    emitted = torch.zeros_like(p)
    for x in children:
        d = proposal(q, state, x)
        accept = acceptance(state, d, x)
        emitted[x] += reach * accept
        reach *= 1 - accept
        state = reject(state, d, x)
    return emitted + reach * state.residual, 1 - reach


def drafted_outcome(p, q, draws, **rule):
    """node_outcome averaged over the drafts' exact probabilities."""
    emitted, accepted = torch.zeros_like(p), 0.0
    for children, prob in draws:
        node_emitted, node_accepted = node_outcome(p, q, children, **rule)
        emitted += prob * node_emitted
        accepted += prob * node_accepted
    return emitted, accepted


def algorithm1_outcome(p, q, k, state=None):
    """Exact emitted distribution and acceptance when each child is drawn from the verifier's own
    D (Algorithm 1 verbatim, its uniform fallback beyond Q's support included)."""
    state = node_start(p) if state is None else state
    if k == 0:
        return state.residual, 0.0
    d = child_proposal(q, state, 0)  # for sampled children D does not depend on the token
    emitted, accepted = torch.zeros_like(p), 0.0
    for x in d.nonzero().flatten().tolist():
        accept = child_acceptance(state, d, x)
        later_emitted, later_accepted = algorithm1_outcome(p, q, k - 1, reject_child(state, d, x))
        emitted[x] += d[x] * accept
        emitted += d[x] * (1 - accept) * later_emitted
        accepted += float(d[x]) * (accept + (1 - accept) * later_accepted)
    return emitted, accepted


def random_case(seed):
    """P and Q with zeros and partial (even disjoint) supports, varying with the seed."""
    generator = torch.Generator().manual_seed(seed)
    return random_dist(generator, zeros=seed % 3), random_dist(generator, zeros=(seed // 3) % 4)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(12))
def test_enumeration_emits_exactly_p(seed, k):
    p, q = random_case(seed)
    emitted, _ = drafted_outcome(p, q, without_replacement_draws(q, k))
    assert torch.allclose(emitted, p, atol=1e-9, rtol=0)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("seed", range(6))
def test_algorithm1_sampling_with_uniform_fallback_emits_exactly_p(seed, k):
    """Children drawn from D itself, past Q's support when k exceeds it: still exactly P, and
    with k = vocabulary size a child is always accepted, whatever Q."""
    p, q = random_case(seed)
    emitted, accepted = algorithm1_outcome(p, q, k)
    assert torch.allclose(emitted, p, atol=1e-9, rtol=0)
    if k == VOCAB:
        assert accepted == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_deterministic_children_emit_exactly_p(seed):
    """q=None: each child is a point-mass proposal; any fixed child list, repeats included."""
    generator = torch.Generator().manual_seed(100 + seed)
    p, _ = random_case(seed)
    for _ in range(6):
        length = int(torch.randint(1, 6, (), generator=generator))
        children = torch.randint(VOCAB, (length,), generator=generator).tolist()
        emitted, _ = node_outcome(p, None, children)
        assert torch.allclose(emitted, p, atol=1e-12, rtol=0), children


@pytest.mark.parametrize("seed", range(6))
def test_repeated_siblings_are_no_ops(seed):
    """A child D could not have drawn (here a repeat of a rejected sibling) is treated as absent,
    so even SpecInfer-style drafts with replacement stay lossless under this rule."""
    p, q = random_case(seed)
    emitted, _ = drafted_outcome(p, q, with_replacement_draws(q, 3))
    assert torch.allclose(emitted, p, atol=1e-9, rtol=0)


def test_enumeration_catches_wrong_rules():
    """The enumeration has teeth: verifying without-replacement drafts against a D that is not
    updated after a rejection, or updating R with the D that already excludes the rejected
    token, emits something other than P; so does accepting a repeated sibling (ratio R[x] / 0)
    in with-replacement drafts."""
    p, q = random_case(1)

    def stale_draft(q, state, x):
        return q

    def late_residual(state, d, x):
        later = reject_child(state, d, x)
        return NodeState(residual(state.residual, child_proposal(q, later, x)), later.rejected)

    def accept_undrawable(state, d, x):
        return 1.0 if d[x] == 0 else child_acceptance(state, d, x)

    for draws, rule in [(without_replacement_draws, dict(proposal=stale_draft)),
                        (without_replacement_draws, dict(reject=late_residual)),
                        (with_replacement_draws, dict(acceptance=accept_undrawable))]:
        emitted, _ = drafted_outcome(p, q, draws(q, 3), **rule)
        assert (emitted - p).abs().max() > 1e-3


@pytest.mark.parametrize("seed", range(12))
def test_one_child_acceptance_is_optimal_transport(seed):
    p, q = random_case(seed)
    _, accepted = drafted_outcome(p, q, without_replacement_draws(q, 1))
    assert accepted == pytest.approx(1 - float((p - q).abs().sum()) / 2, abs=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_coverage_k_children_over_a_k_token_support_always_accept(seed, k):
    generator = torch.Generator().manual_seed(200 + seed)
    support = torch.randperm(VOCAB, generator=generator)[:k]
    q = torch.zeros(VOCAB, dtype=torch.float64)
    q[support] = random_dist(generator)[:k]
    q /= q.sum()
    p = torch.zeros(VOCAB, dtype=torch.float64)
    p[support[torch.randperm(k, generator=generator)[:max(1, k - seed % 2)]]] = 1.0
    p *= random_dist(generator)
    p /= p.sum()
    _, accepted = drafted_outcome(p, q, without_replacement_draws(q, k))
    assert accepted == pytest.approx(1.0, abs=1e-9)


def test_specinfer_lacks_coverage():
    """The paper's counterexample, for contrast: SpecInfer (drafts with replacement, D kept at Q)
    is lossless but accepts only 75% with P = [1, 0], Q = [0.5, 0.5] and two children."""
    p = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    emitted, accepted = drafted_outcome(p, q, with_replacement_draws(q, 2),
                                        proposal=lambda q, state, x: q)
    assert torch.allclose(emitted, p, atol=1e-12) and accepted == pytest.approx(0.75, abs=1e-12)
    _, accepted = drafted_outcome(p, q, without_replacement_draws(q, 2))
    assert accepted == pytest.approx(1.0, abs=1e-12)


def test_sampling_without_replacement_follows_q_then_q_without_the_first():
    q = torch.tensor([0.4, 0.25, 0.0, 0.2, 0.15])
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(8000):
        first, second = sample_without_replacement(q, 2, generator).tolist()
        counts[first, second] += 1
    exact = q.double()[:, None] * q.double() / (1 - q.double()[:, None])  # [first, second]
    exact.fill_diagonal_(0.0)
    assert chi_square_p_value(counts.flatten(), exact.flatten()) > 1e-3


def test_sampling_without_replacement_returns_only_tokens_with_mass():
    q = torch.tensor([0.0, 0.7, 0.0, 0.3, 0.0])
    generator = torch.Generator().manual_seed(0)
    for k in [2, 4, 9]:
        drawn = sample_without_replacement(q, k, generator)
        assert sorted(drawn.tolist()) == [1, 3]
    assert sample_without_replacement(q, 1, generator).tolist() in ([1], [3])


def toy_model(seed, params):
    """Toy autoregressive target and draft over VOCAB tokens: row t is the next-token
    distribution after token t, warped as the user asked (fp32, as verification receives it).
    The draft's logits are the target's plus noise, so that every level of a tree gets accepted
    often enough to matter, yet rejections are common."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=generator) * 2
    draft_logits = logits + torch.randn(VOCAB, VOCAB, generator=generator) * 1.5
    return warp(logits, params), warp(draft_logits, params), draft_logits


def draft_tree(tree, draft, start, generator):
    """Tokens [n] for the tree, level by level: each node's children drawn without replacement
    from the draft's row for the node's token; when Q has fewer tokens than children, the last
    ones repeat the first child, which verification treats as absent."""
    tokens = [start] * tree.size
    for node, children in enumerate(tree.children):  # breadth-first: a parent's token is set
        if children:
            k = len(children)
            drawn = sample_without_replacement(draft[tokens[node]], k, generator).tolist()
            for child, token in zip(children, drawn + drawn[:1] * (k - len(drawn))):
                tokens[child] = token
    return torch.tensor(tokens)


def greedy_children(tree, draft_logits, start):
    """Tokens [n] with each node's children = the draft's top-k after the node's token."""
    tokens = torch.full((tree.size,), start)
    for node, children in enumerate(tree.children):
        if children:
            tokens[list(children)] = draft_logits[tokens[node]].topk(len(children)).indices.cpu()
    return tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params, deterministic", [
    (SamplingParams(temperature=1.0), False),
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(temperature=0.3), False),
    (SamplingParams(temperature=1.0, top_p=0.9), False),
    (SamplingParams(temperature=0.7), True),
    (SamplingParams(temperature=1.0, top_p=0.9), True),
])
def test_tree_samples_sequences_from_p(params, deterministic, device):
    """Draft the tree (without replacement from Q, or Q's top-k as deterministic children),
    verify, record the first 2 emitted tokens: their joint distribution must be
    P(y1 | s) P(y2 | y1), checked by chi-square over 25 outcomes (on a GPU, drawn there)."""
    target, draft, draft_logits = (rows.to(device) for rows in toy_model(7, params))
    start = 0
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(3000):
        if deterministic:  # the same tree every time: only verification is random
            tokens, q = greedy_children(TREE, draft_logits, start), None
        else:
            tokens = draft_tree(TREE, draft, start, generator)
            q = draft[tokens]  # [n, vocab]
        verdict = verify_tree(TREE, tokens, target[tokens], q, generator)
        emitted = tokens[verdict.path].tolist() + [verdict.next_token]
        if len(emitted) < 2:  # nothing accepted: continue plainly from the recovered token
            emitted.append(sample(target[emitted[0]], generator))
        counts[emitted[0], emitted[1]] += 1
    exact = (target[start].double()[:, None] * target.double()).cpu()  # [y1, y2]
    assert chi_square_p_value(counts.flatten(), exact.flatten()) > 1e-3


def test_greedy_accepts_the_argmax_child_else_emits_the_argmax():
    """One-hot P (temperature 0) and top-k deterministic children: the verdict is the walk that
    follows the child equal to argmax P and stops with argmax P, on a depth-3 tree."""
    generator = torch.Generator().manual_seed(11)
    target_logits = torch.randn(VOCAB, VOCAB, generator=generator)
    target = warp(target_logits, SamplingParams(temperature=0.0))
    depths = []
    for trial in range(60):
        # A draft that often but not always agrees with the target.
        draft_logits = target_logits + 1.5 * torch.randn(VOCAB, VOCAB, generator=generator)
        tokens = greedy_children(TREE, draft_logits, start=trial % VOCAB)
        verdict = verify_tree(TREE, tokens, target[tokens], None, generator)
        path, node = [], 0
        while (matching := [c for c in TREE.children[node]
                            if tokens[c] == target[tokens[node]].argmax()]):
            node = matching[0]
            path.append(node)
        assert verdict.path == path
        assert verdict.next_token == int(target[tokens[node]].argmax())
        depths.append(len(path))
    assert min(depths) == 0 and max(depths) == TREE.depth


def test_root_alone_gives_a_bonus_token_from_p():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    verdict = verify_tree(Tree((-1,)), torch.tensor([3]), p, None, None)
    assert (verdict.path, verdict.next_token) == ([], 2)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_p=0.9)])
def test_draft_equal_to_target_accepts_the_first_child_at_every_level(params):
    target, _, _ = toy_model(3, params)
    generator = torch.Generator().manual_seed(4)
    for trial in range(200):
        tokens = draft_tree(TREE, target, trial % VOCAB, generator)
        verdict = verify_tree(TREE, tokens, target[tokens], target[tokens], generator)
        assert verdict.path == [1, 4, 6]  # the leftmost path down to a leaf
        assert target[tokens[6], verdict.next_token] > 0  # the bonus token
