"""The chain verification rule is lossless: exact enumeration and chi-square on seeded samples."""

import itertools

import pytest
import torch

from conftest import DEVICES
from specchat.core.exact_outcomes import chi_square_p_value
from specchat.core.sampling import SamplingParams, sample, warp
from specchat.core.speculative.verify import acceptance_probability, residual, verify_chain

VOCAB = 4


def random_dist(generator, size=VOCAB, zeros=0):
    probs = torch.rand(size, generator=generator, dtype=torch.float64) + 0.05
    probs[torch.randperm(size, generator=generator)[:zeros]] = 0.0
    return probs / probs.sum()


def emitted_distribution(p, q, correction):
    """Exact distribution of the first emitted token when one draft token x ~ Q is verified:
    sum_x Q(x) [a(x) delta_x + (1 - a(x)) correction(P, Q)]."""
    out = torch.zeros_like(p)
    for x in range(p.shape[0]):
        if q[x] == 0:
            continue
        a = acceptance_probability(p[None], q[None], torch.tensor([x]))[0]
        out[x] += q[x] * a
        out += q[x] * (1 - a) * correction(p, q)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(20))
def test_enumeration_emits_exactly_p(seed, device):
    generator = torch.Generator().manual_seed(seed)
    # Disjoint and partial supports included: P and Q each may have zeros.
    p = random_dist(generator, zeros=seed % 3).to(device)
    q = random_dist(generator, zeros=(seed // 3) % 3).to(device)
    assert torch.allclose(emitted_distribution(p, q, residual), p, atol=1e-12, rtol=0)


def test_enumeration_catches_the_triforce_bug():
    """Sampling P instead of the residual after a rejection is not lossless: the test above
    would catch it."""
    generator = torch.Generator().manual_seed(0)
    p, q = random_dist(generator), random_dist(generator)
    wrong = emitted_distribution(p, q, lambda p, q: p)
    assert (wrong - p).abs().max() > 1e-3


def test_single_draft_acceptance_is_one_minus_total_variation():
    generator = torch.Generator().manual_seed(1)
    p, q = random_dist(generator), random_dist(generator)
    accept = sum(q[x] * acceptance_probability(p[None], q[None], torch.tensor([x]))[0] for x in range(VOCAB))
    assert torch.isclose(accept, 1 - (p - q).abs().sum() / 2, atol=1e-12)


def test_equal_distributions_have_a_well_defined_residual():
    p = torch.tensor([0.25, 0.25, 0.5, 0.0], dtype=torch.float64)
    assert torch.equal(residual(p, p.clone()), p)
    assert not residual(p, p.clone()).isnan().any()


def test_greedy_accepts_the_matching_prefix_then_corrects():
    p = torch.nn.functional.one_hot(torch.tensor([2, 1, 3, 0]), VOCAB).float()  # argmaxes 2, 1, 3, 0
    draft = torch.tensor([2, 1, 0])
    q = torch.nn.functional.one_hot(draft, VOCAB).float()
    verdict = verify_chain(draft, q, p, torch.Generator().manual_seed(0))
    assert (verdict.accepted, verdict.next_token) == (2, 3)
    all_right = torch.tensor([2, 1, 3])
    verdict = verify_chain(all_right, torch.nn.functional.one_hot(all_right, VOCAB).float(), p, None)
    assert (verdict.accepted, verdict.next_token) == (3, 0)


def toy_model(seed, params):
    """Next-token distributions of a toy autoregressive 'target' and 'draft' over VOCAB tokens:
    row t is the distribution after token t, warped as the user asked."""
    generator = torch.Generator().manual_seed(seed)
    target = warp(torch.randn(VOCAB, VOCAB, generator=generator) * 2, params).double()
    draft = warp(torch.randn(VOCAB, VOCAB, generator=generator) * 2, params).double()
    return target, draft


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=1.0, top_p=0.9),
])
def test_chain_of_two_drafts_samples_sequences_from_p(params, device):
    """Draft 2 tokens from Q, verify with P, record the first 2 emitted tokens: their joint
    distribution must be P(y1 | s) P(y2 | y1), checked by chi-square over 16 outcomes. On a GPU
    every draw is made there, from the host generator's companion."""
    target, draft = (rows.to(device) for rows in toy_model(7, params))
    start = 0
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(6000):
        x1 = sample(draft[start], generator)
        x2 = sample(draft[x1], generator)
        tokens = torch.tensor([x1, x2])
        q = torch.stack([draft[start], draft[x1]])
        p = torch.stack([target[start], target[x1], target[x2]])
        verdict = verify_chain(tokens, q, p, generator)
        emitted = tokens[:verdict.accepted].tolist() + [verdict.next_token]
        if len(emitted) < 2:  # the first token was rejected: continue plainly from it
            emitted.append(sample(target[emitted[0]], generator))
        counts[emitted[0], emitted[1]] += 1
    exact = (target[start][:, None] * target).cpu()  # [y1, y2]
    assert chi_square_p_value(counts.flatten(), exact.flatten()) > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    """The chi-square check has teeth: samples from the draft fail against the target."""
    target, draft = toy_model(7, SamplingParams(temperature=1.0))
    generator = torch.Generator().manual_seed(0)
    samples = torch.multinomial(draft[0], 6000, replacement=True, generator=generator)
    counts = torch.bincount(samples, minlength=VOCAB)
    assert chi_square_p_value(counts, target[0]) < 1e-3


def test_draft_equal_to_target_accepts_everything():
    generator = torch.Generator().manual_seed(3)
    for _ in range(200):
        p = torch.stack([random_dist(generator) for _ in range(4)]).float()
        tokens = torch.stack([torch.multinomial(row, 1, generator=generator)[0] for row in p[:3]])
        assert verify_chain(tokens, p[:3], p, generator).accepted == 3


def test_a_zero_uniform_never_accepts_a_token_the_target_gives_no_mass(monkeypatch):
    """Accept iff u < min(1, P/Q): u = 0 is a possible float32 uniform (2**-24 of draws), and `<=`
    would then accept a token the target gives no mass (a mutation audit found no test for it)."""
    from specchat.core.speculative.dsi.orchestrator import resolve
    from specchat.core.speculative.verify import verify_node

    p = torch.eye(5)[[2, 1]]  # greedy: the target says 2
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros_like(real_rand(*a, **k)))
    verdict = verify_chain(torch.tensor([3]), None, p, torch.Generator().manual_seed(0))
    assert (verdict.accepted, verdict.next_token) == (0, 2)
    assert resolve(p[:1], torch.tensor([3]), None, torch.Generator().manual_seed(0)) == (0, 2)
    assert verify_node(p[0], None, [3], [0.0])[0] is None


def resolved_law(monkeypatch, p, drafts, q):
    """Exact law [vocab, vocab] of the first two tokens when DSI's `resolve` judges two drafts at
    its two positions of P (every position drafted: g == m), a token after a rejection at the first
    continuing from p[1]. Each min(1, P/Q) must be a multiple of 1/4: u < min(1, P/Q) then holds
    for exactly that share of the midpoints (k + 1/2) / 4, so their 16 pairs weigh the accept and
    reject outcomes exactly; each recovered token's distribution is taken as `resolve` samples it."""
    from specchat.core.speculative.dsi import orchestrator

    uniforms, recovered = [], []
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor(uniforms.pop()))
    monkeypatch.setattr(orchestrator, "sample", lambda probs, generator: recovered.append(probs) or -1)
    law = torch.zeros(p.shape[1], p.shape[1], dtype=torch.float64)
    for pair in itertools.product([0.125, 0.375, 0.625, 0.875], repeat=2):
        uniforms.append(pair)
        accepted, token = orchestrator.resolve(p, drafts, q, None)
        if accepted == 2:
            assert token is None  # the position after needs a later task's P
            law[drafts[0], drafts[1]] += 1 / 16
        elif accepted == 1:
            law[drafts[0]] += recovered.pop() / 16
        else:
            law += torch.outer(recovered.pop(), p[1]) / 16
    return law


def test_resolve_with_every_position_drafted_is_lossless(monkeypatch):
    """DSI's `resolve` judges the drafts at every position of a task's P by itself (g == m, not
    `verify_chain`): after a rejection it must sample the residual, not P (a mutation audit: only
    the slow sampled DSI test caught that). Exact over every draft pair: sampled drafts weighted
    by Q, and each fixed pair of deterministic drafts."""
    p = torch.tensor([[0.25, 0.25, 0.5, 0.0], [0.5, 0.25, 0.25, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.25, 0.0, 0.25], [0.25, 0.5, 0.0, 0.25]], dtype=torch.float64)
    target, pairs = torch.outer(p[0], p[1]), list(itertools.product(range(VOCAB), repeat=2))
    drafted = sum(q[0, x] * q[1, y] * resolved_law(monkeypatch, p, torch.tensor([x, y]), q)
                  for x, y in pairs if q[0, x] * q[1, y] > 0)
    assert torch.allclose(drafted, target, atol=1e-12, rtol=0)
    for x, y in pairs:
        deterministic = resolved_law(monkeypatch, p, torch.tensor([x, y]), None)
        assert torch.allclose(deterministic, target, atol=1e-12, rtol=0), (x, y)
