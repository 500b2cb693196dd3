"""DSI's policy (core/speculative/dsi/policy.py) alone, on sequences of observations: no threads,
no instances, a fake clock. The plain steps are driven as the orchestrator drives them, so the
probe intervals, their backoff and its resets are asserted exactly."""

import pytest

from specchat.core.speculative.dsi.policy import (NEAR_PATIENCE, PROBE_BACKOFF, PROBE_EVERY, PROBE_NEAR,
                                                  PROBE_RARELY, DsiPolicy)

STEP = 0.020  # a plain step's seconds on the fake clock


def failing(draft: float, handoff: float = 0.0, local: float | None = None, restart: float = 0.0) -> DsiPolicy:
    """Two instances, a 20 ms target, a drafter at `draft` seconds a token whose every draft fails."""
    policy = DsiPolicy(instances=2)
    policy.observe_task(0.020)
    if handoff:
        policy.observe_handoff(handoff)
    if local is not None:
        policy.observe_local(local)
    policy.observe_draft(draft, 1)
    if restart:
        policy.observe_restart(restart)
    for _ in range(40):
        policy.observe_verdict(1, 0)
    assert not policy.pays()
    return policy


def near() -> DsiPolicy:
    """So fast a drafter that one accepted draft would make the instances pay."""
    policy = failing(0.0004, handoff=0.0005)
    assert policy.probe_every() == PROBE_NEAR
    return policy


def far() -> DsiPolicy:
    """A drafter at 70% of the target, half a draft to restart: several accepted drafts from paying."""
    policy = failing(0.014, local=0.020, restart=0.007)
    assert policy.probe_every() == PROBE_EVERY
    return policy


def rarely() -> DsiPolicy:
    """A drafter as slow as the target: even drafts all accepted would not pay."""
    policy = failing(0.020, local=0.020)
    assert policy.probe_every() == PROBE_RARELY
    return policy


class PlainSteps:
    """The orchestrator's plain steps over a policy (orchestrator.DsiDecoder._plain_step), each
    STEP seconds on a fake clock."""

    def __init__(self, policy: DsiPolicy, seconds: float = STEP):
        self.policy, self.seconds, self.now = policy, seconds, 0.0
        self.rooms: list[int] = []  # the drafts worth holding during each step

    def run(self, outcomes, tasks_live: bool = False, drafting: bool = False) -> list[int]:
        """Plain steps until one with bookkeeping has run for each outcome (whether the target's
        token was the draft beside it). Returns the gap each such step decided: itself and the
        lean steps after it, up to the next probe."""
        gaps = []
        outcomes = iter(outcomes)
        while True:
            if self.policy.lean_run_ended():
                self.policy.probe_beside(self.now)
            self.rooms.append(self.policy.room())
            self.now += self.seconds
            if self.policy.lean_step():
                continue
            matched = next(outcomes, None)
            if matched is None:
                return gaps
            self.policy.plain_step_ended(self.now, matched, tasks_live, drafting)
            gaps.append(self.policy.lean + 1)


def test_the_constants_these_sequences_assume():
    assert (PROBE_NEAR, PROBE_EVERY, PROBE_RARELY, PROBE_BACKOFF, NEAR_PATIENCE) == (2, 4, 16, 8, 3)


def test_far_from_paying_each_gap_doubles_up_to_the_backoff_cap():
    assert PlainSteps(far()).run([False] * 7) == [4, 8, 16, 32, 32, 32, 32]
    assert PlainSteps(rarely()).run([False] * 6) == [16, 32, 64, 128, 128, 128]


def test_far_from_paying_a_taken_draft_does_not_shorten_the_gaps():
    """Far from the break-even one taken draft changes little: only the instances paying starts over."""
    assert PlainSteps(far()).run([False, True, True, False, True]) == [4, 8, 16, 32, 32]


def test_near_the_break_even_the_gaps_grow_only_after_near_patience_missed_drafts():
    assert PlainSteps(near()).run([False] * 9) == [2, 2, 2, 4, 8, 16, 16, 16, 16]


def test_near_the_break_even_a_taken_draft_starts_the_gaps_over():
    gaps = PlainSteps(near()).run([False] * 5 + [True] + [False] * 4)
    assert gaps == [2, 2, 2, 4, 8, 2, 2, 2, 2, 4]


def test_a_far_tier_after_a_near_one_starts_its_gaps_over():
    policy = far()
    tiers = iter([PROBE_EVERY, PROBE_EVERY, PROBE_NEAR, PROBE_EVERY, PROBE_EVERY])
    policy.probe_every = lambda fresh=True: next(tiers)
    assert PlainSteps(policy).run([False] * 5) == [4, 8, 2, 4, 8]


def test_the_instances_paying_starts_the_backoff_over():
    policy = far()
    steps = PlainSteps(policy)
    assert steps.run([False] * 3) == [4, 8, 16]
    for _ in range(3):  # plain steps turn slow (the median of the last five): the instances pay
        policy.observe_local(1.0)
    assert steps.run([False]) == [1] and not policy.plain_next
    for _ in range(5):
        policy.observe_local(STEP)
    assert steps.run([False] * 3) == [4, 8, 16]


def test_near_the_instances_paying_forgets_the_missed_drafts():
    policy = near()
    steps = PlainSteps(policy)
    assert steps.run([False] * 5) == [2, 2, 2, 4, 8]
    for _ in range(3):
        policy.observe_local(1.0)
    assert steps.run([False]) == [1]
    for _ in range(5):
        policy.observe_local(STEP)
    assert steps.run([False] * 4) == [2, 2, 2, 4]


def test_the_drafter_drafts_only_for_the_probes_and_a_lean_run_measures_a_plain_step():
    policy = far()
    steps = PlainSteps(policy, seconds=0.019)
    assert steps.run([False] * 3) == [4, 8, 16]
    # The first step may have a draft beside it; then only the step after each lean run.
    assert steps.rooms == [1] + [0, 0, 0] + [1] + [0] * 7 + [1] + [0] * 15 + [1], steps.rooms
    assert policy.local == pytest.approx(0.019)  # the median of 20 ms (far()'s) and the lean runs' 19 ms


def test_no_draft_during_lean_steps_whatever_the_figures_say():
    """Lean steps commit without the orchestrator's lock: the drafter must not touch the chain."""
    policy = far()
    assert not policy.plain_step_ended(1.0, False, tasks_live=False, drafting=False)
    for _ in range(3):  # the figures change: the instances pay now
        policy.observe_local(1.0)
    assert policy.pays() and policy.room() == 0
    lean = 0
    while policy.lean_step():
        lean += 1
        assert policy.room() == (policy.lookahead() * 3 if lean == PROBE_EVERY - 1 else 0)
    assert lean == PROBE_EVERY - 1


def test_no_lean_run_while_tasks_are_live_or_a_draft_runs_beside():
    policy = far()
    assert not policy.plain_step_ended(1.0, False, tasks_live=True, drafting=False)
    assert not policy.plain_next and policy.lean == 0 and policy.lean_run is None
    assert not policy.plain_step_ended(1.0, False, tasks_live=False, drafting=True)
    assert policy.plain_next and policy.lean == 0 and policy.lean_run is None  # the next step waits for it
    assert not policy.plain_step_ended(1.0, False, tasks_live=False, drafting=False)
    assert policy.plain_next and policy.lean == PROBE_EVERY - 1 and policy.lean_run == (1.0, PROBE_EVERY - 1)


def test_a_plain_step_decides_by_the_last_choice_made():
    """It recomputes nothing after a forward's wait: a verdict shows once the drafting thread's
    next turn (a fresh question) has chosen again."""
    policy = near()
    policy.observe_verdict(1, 1)  # one accepted draft: enough to pay, so near the break-even
    assert not policy.pays(fresh=False)
    assert not policy.plain_step_ended(1.0, True, tasks_live=False, drafting=False)
    assert policy.pays()  # the drafting thread's question
    assert policy.pays(fresh=False)
    assert policy.plain_step_ended(2.0, True, tasks_live=False, drafting=False) and not policy.plain_next


def test_room_and_draft_count():
    policy = DsiPolicy(instances=2)
    # Nothing measured: the instances, at the starting lookahead, one token a turn.
    assert (policy.pays(), policy.lookahead(), policy.room()) == (True, 4, 12)
    assert policy.draft_count(unsent=0, held=0) == 1
    policy.observe_task(0.020)
    policy.observe_handoff(0.0005)
    policy.observe_draft(0.0004, 1)
    for _ in range(40):
        policy.observe_verdict(8, 8)
    k = policy.lookahead()
    assert policy.pays() and k > 2 and policy.room() == 3 * k
    assert policy.draft_count(unsent=0, held=0) == k  # a lookahead of drafts no task holds
    assert policy.draft_count(unsent=k - 1, held=k - 1) == 1
    assert policy.draft_count(unsent=k + 3, held=2 * k) == 1  # at least one, while there is room
    assert policy.draft_count(unsent=0, held=3 * k - 2) == 2  # within the room
    for _ in range(80):
        policy.observe_verdict(1, 0)
    assert not policy.pays() and policy.room() == 1  # a probe: one draft beside the next plain step
