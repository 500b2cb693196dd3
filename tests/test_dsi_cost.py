"""DSI's cost model (core/speculative/dsi/cost.py) against the paper's claims: never slower than plain
decoding, never slower than SI where an instance is always free, and its lookahead example; and
its closed form against the event model it stands for, summed run by run."""

import heapq
import itertools
import math

import pytest

from specchat.core.speculative.dsi.cost import dsi_lookahead, dsi_seconds_per_token, si_seconds_per_token

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
    """Also where the drafter, after each rejection, first ends a draft it began on the old text."""
    for draft, a, w in itertools.product(DRAFT_COSTS, ACCEPTANCES, INSTANCES):
        k = dsi_lookahead(TARGET, draft, w, CAP)
        for restart in (0.0, draft):
            assert dsi_seconds_per_token(TARGET, draft, a, k, w, restart) <= TARGET * (1 + 1e-12), (draft, a, w)


def test_dsi_is_never_slower_than_si_at_the_same_lookahead():
    for draft, a, w, k, plain_task in itertools.product(DRAFT_COSTS, ACCEPTANCES, INSTANCES, range(1, CAP + 1),
                                                        (True, False)):
        dsi = dsi_seconds_per_token(TARGET, draft, a, k, w, plain_task=plain_task)
        assert dsi <= si_seconds_per_token(TARGET, draft, a, k) * (1 + 1e-12), (draft, a, w, k, plain_task)


def task_sends(target, draft, k, w, restart, plain_task, tasks):
    """When each of the first `tasks` tasks of a run is sent: a plain task at once (if any), then
    blocks of k drafts, drafted one per `draft` seconds from `restart` on, each to the instance
    that frees first, as soon as both it and the block are ready."""
    free = [0.0] * w  # when each instance frees
    sends = []
    for index in range(tasks):
        block = index if plain_task else index + 1  # blocks of drafts before this task's end
        ready = 0.0 if plain_task and index == 0 else restart + block * k * draft
        send = max(ready, heapq.heappop(free))
        heapq.heappush(free, send + target)
        sends.append(send)
    return sends


def event_seconds_per_token(target, draft, a, k, w, restart, plain_task):
    """E[run time] / E[tokens a run commits], the run that accepts L drafts ending with the task
    that resolves draft L + 1: block ceil(L/k) with a plain task (0: the plain task), else block
    max(0, ceil(L/k) - 1). Summed over L until the rest weighs < 1e-13."""
    longest = 0 if a == 0 else math.ceil(math.log(1e-13) / math.log(a))
    sends = task_sends(target, draft, k, w, restart, plain_task, math.ceil(longest / k) + 1)
    run = 0.0
    for accepted in range(longest + 1):
        task = math.ceil(accepted / k) if plain_task else max(0, math.ceil(accepted / k) - 1)
        run += (1 - a) * a**accepted * (sends[task] + target)
    return run * (1 - a)


@pytest.mark.parametrize("plain_task", [True, False])
def test_the_closed_form_is_the_event_model(plain_task):
    """Exact where nothing delays blocks but instances or where the drafter restarts at once; an
    upper bound where both delay them (the waits absorb part of the restart)."""
    for draft, a, k, w, restart in itertools.product((0.01, 0.05, 0.3, 1.0), (0.0, 0.3, 0.8, 0.95), (1, 3, 8),
                                                     (1, 2, 3), (0.0, 0.2)):
        # The event model has no plain task after the first: it stands for the closed form with
        # the restart bounded as that form bounds it, by what a plain task leaves the drafter.
        bounded = min(restart, max(0.0, TARGET - draft)) if plain_task else restart
        exact = event_seconds_per_token(TARGET, draft, a, k, w, bounded, plain_task)
        closed = dsi_seconds_per_token(TARGET, draft, a, k, w, restart, plain_task)
        case = (draft, a, k, w, restart)
        if bounded == 0 or w * k * draft >= TARGET:
            assert closed == pytest.approx(exact, rel=1e-9), case
        else:
            assert exact <= closed * (1 + 1e-9), case


def test_without_a_plain_task_where_blocks_wait_for_instances():
    """Two instances and a fast drafter: blocks wait (W k t1 < t2), and sparing the instance a
    plain task pays at high acceptance; where an instance is always free, or drafts often fail,
    the plain task wins."""
    best = {plain_task: min(dsi_seconds_per_token(TARGET, 0.02, 0.9, k, 2, plain_task=plain_task)
                            for k in range(1, CAP + 1)) for plain_task in (True, False)}
    assert best[False] < 0.97 * best[True]
    assert dsi_seconds_per_token(TARGET, 0.3, 0.9, 2, 2) < dsi_seconds_per_token(TARGET, 0.3, 0.9, 2, 2,
                                                                                  plain_task=False)
    assert dsi_seconds_per_token(TARGET, 0.02, 0.3, 4, 2) < dsi_seconds_per_token(TARGET, 0.02, 0.3, 4, 2,
                                                                                   plain_task=False)


def test_a_restart_costs_at_each_rejection_after_an_accepted_draft():
    """A drafter at 70% of the target that needs half a draft to start on the new text after a
    rejection: each rejection after an accepted draft (a (1 - a) a token) delays the run by it."""
    without = dsi_seconds_per_token(TARGET, 0.7, 0.6, 1, 2)
    assert dsi_seconds_per_token(TARGET, 0.7, 0.6, 1, 2, restart_s=0.2) == pytest.approx(without + 0.2 * 0.6 * 0.4)
    # No plain task: each rejection waits for it.
    without = dsi_seconds_per_token(TARGET, 0.7, 0.6, 1, 2, plain_task=False)
    assert dsi_seconds_per_token(TARGET, 0.7, 0.6, 1, 2, 0.2, plain_task=False) == pytest.approx(without + 0.2 * 0.4)


def test_a_restart_costs_no_more_than_a_plain_task_leaves_the_drafter():
    """With a plain task, a drafter that restarts later than t2 - t1 finds the frontier covered by
    plain tasks until it catches up: a restart of any length delays a run by t2 - t1 at most, and
    one draft per task is never slower than plain decoding."""
    assert dsi_seconds_per_token(TARGET, 0.7, 0.6, 1, 2, restart_s=5.0) == pytest.approx(
        dsi_seconds_per_token(TARGET, 0.7, 0.6, 1, 2, restart_s=0.3))
    for draft, a, restart in itertools.product(DRAFT_COSTS, ACCEPTANCES, (0.1, 0.5, 1.0, 5.0)):
        assert dsi_seconds_per_token(TARGET, draft, a, 1, 2, restart) <= TARGET * (1 + 1e-12), (draft, a, restart)


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
