"""DSI's cost model (core/spec/dsi_cost.py) against the paper's claims: never slower than plain
decoding, never slower than SI where an instance is always free, and its lookahead example."""

import itertools

import pytest

from specchat.core.spec.dsi_cost import dsi_lookahead, dsi_seconds_per_token, si_seconds_per_token

TARGET = 1.0
DRAFT_COSTS = (0.0, 0.01, 0.05, 0.14, 0.3, 0.65, 1.0)  # a draft step over a verification
ACCEPTANCES = (0.0, 0.1, 0.3, 0.5, 0.8, 0.9, 0.99, 0.999999, 1.0)
INSTANCES = (2, 3, 4, 7)
CAP = 16


def test_with_nothing_accepted_both_are_plain_decoding():
    for draft, k, w in itertools.product(DRAFT_COSTS, (1, 5, 16), INSTANCES):
        assert dsi_seconds_per_token(TARGET, draft, 0.0, k, w) == pytest.approx(TARGET)
    assert si_seconds_per_token(TARGET, 0.0, 0.0, 4) == pytest.approx(TARGET)
    assert si_seconds_per_token(TARGET, 0.1, 0.0, 4) == pytest.approx(TARGET + 0.4)  # SI pays its drafts


def test_dsi_at_its_lookahead_is_never_slower_than_plain():
    for draft, a, w in itertools.product(DRAFT_COSTS, ACCEPTANCES, INSTANCES):
        k = dsi_lookahead(TARGET, draft, w, CAP)
        assert dsi_seconds_per_token(TARGET, draft, a, k, w) <= TARGET * (1 + 1e-12)


def test_dsi_is_never_slower_than_si_at_the_same_lookahead():
    for draft, a, w, k in itertools.product(DRAFT_COSTS, ACCEPTANCES, INSTANCES, range(1, CAP + 1)):
        dsi = dsi_seconds_per_token(TARGET, draft, a, k, w)
        assert dsi <= si_seconds_per_token(TARGET, draft, a, k) * (1 + 1e-12), (draft, a, w, k)


def test_the_papers_lookahead_example():
    """A draft at 5% of the target's latency and SP degree 4: lookahead 5 suffices (appendix D)."""
    assert dsi_lookahead(TARGET, 0.05, 4, CAP) == 5
    assert dsi_lookahead(0.030, 0.0015, 4, CAP) == 5  # the same ratio in seconds
    assert dsi_lookahead(TARGET, 0.05, 2, CAP) == 10
    assert dsi_lookahead(TARGET, 0.05, 2, 8) == 8  # capped
    assert dsi_lookahead(TARGET, 0.65, 2, CAP) == 1  # a slow draft: every draft goes out at once
    assert dsi_lookahead(TARGET, 0.0, 2, CAP) == CAP  # a free draft: the most a task may hold


def test_more_acceptance_is_never_slower():
    """At DSI's own lookahead. (A lookahead whose drafting outlasts a verification, k t1 > t2,
    can lose at low acceptance: each accepted draft then waits for a dear block.)"""
    for draft, w in itertools.product(DRAFT_COSTS, INSTANCES):
        k = dsi_lookahead(TARGET, draft, w, CAP)
        times = [dsi_seconds_per_token(TARGET, draft, a, k, w) for a in ACCEPTANCES]
        assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(times, times[1:])), (draft, w, k)
    for draft, k in itertools.product(DRAFT_COSTS, (1, 5, 16)):
        times = [si_seconds_per_token(TARGET, draft, a, k) for a in ACCEPTANCES]
        assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(times, times[1:])), (draft, k)


def test_the_limits_at_full_acceptance():
    """All drafts accepted: drafting or W instances side by side bound DSI, whichever is slower."""
    assert dsi_seconds_per_token(TARGET, 0.05, 1.0, 10, 2) == pytest.approx(0.05)  # W k t1 = t2: drafting
    assert dsi_seconds_per_token(TARGET, 0.01, 1.0, 10, 2) == pytest.approx(TARGET / 20)  # instances
    assert dsi_seconds_per_token(TARGET, 0.05, 1 - 1e-9, 10, 2) == pytest.approx(0.05, rel=1e-6)
    assert si_seconds_per_token(TARGET, 0.05, 1.0, 4) == pytest.approx(1.2 / 5)


def test_dsi_beats_si_by_the_drafting_it_hides():
    """The paper's running example: a draft at 14% of the target, acceptance 0.8."""
    k = dsi_lookahead(TARGET, 0.14, 2, CAP)
    si = min(si_seconds_per_token(TARGET, 0.14, 0.8, g) for g in range(1, CAP + 1))
    assert dsi_seconds_per_token(TARGET, 0.14, 0.8, k, 2) < 0.8 * si
