"""DSI's policy: what the orchestrator does, decided from what it measured.

The orchestrator (orchestrator.py) feeds it observations (the latencies of tasks, handoffs, drafts,
restarts and plain steps; each verdict's drafts judged and accepted) and asks it the lookahead,
whether a new frontier gets a task at once, whether the instances pay at all, how many tokens a
draft turn drafts and, where they do not pay, which plain steps are lean and which measure a draft
(the probes, and their backoff). Pure: no threads, no clock (times come in as arguments), no torch,
so a test can drive it through any sequence of observations. The orchestrator calls it under its
lock, except `lean_step` and `plain_next`, which only the caller's thread uses during plain steps.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from ..lookahead import MAX_DRAFT
from .cost import dsi_seconds_per_token

EWMA = 0.3  # weight of the newest latency measurement
LOCAL_WINDOW = 5  # plain steps whose median is a plain step's time
DECAY = 0.9  # of the acceptance counts, per verdict: the drafter's recent record counts most
# Before any verdict: as if a quarter of a draft, 70% accepted. Weak, so that where every draft
# fails a few verdicts show the instances do not pay.
PRIOR_DRAFTS, PRIOR_ACCEPTANCE = 0.25, 0.7
# The instances must be expected this much faster than a plain step: the cost model leaves out
# about that much (threads contending where a task and a draft end together, the probes below).
MARGIN = 0.98
# During plain steps a draft is measured beside every PROBE_EVERY-th only, the steps between lean
# (plain decoding's cost); every PROBE_NEAR-th where one more accepted draft would pay (a verdict is
# worth more than the lock there), every PROBE_RARELY-th where all accepted would not. Figures:
# bench/notes/dsi-tuning.md, as for the backoff below.
PROBE_NEAR, PROBE_EVERY, PROBE_RARELY = 2, 4, 16
# Each probe costs a wake-up and bookkeeping: far from paying each gap doubles, up to PROBE_BACKOFF
# times its tier's. Near it a taken draft brings DSI back, so the gaps grow only after more than
# NEAR_PATIENCE misses in a row (a 60% drafter misses four in a row one time in 40).
PROBE_BACKOFF = 8
NEAR_PATIENCE = 3


class Choice(NamedTuple):
    lookahead: int
    plain_task: bool  # a new frontier's task at once, before any draft exists
    seconds: float  # expected per token on the instances, so chosen
    full: float  # ... were every draft accepted
    next_accepted: float  # ... at this lookahead, were the next draft accepted


class DsiPolicy:
    """Measured seconds of a verification task, of the handoff around it (from sending a task
    that covers the frontier to its verdict committed, less its run: the queues, the threads'
    wake-ups and the verification), of drafting one token (the drafting thread's whole turn),
    of the drafter's restart after a rejection (until it drafts from the new text) and of a
    whole plain step on the engine's own target (moving averages), and the drafts' acceptance.

    They choose the lookahead and whether a rejection's new frontier gets a plain task at once
    or waits for a lookahead of drafts, those with the lowest expected time per token in DSI's
    cost model (cost.py), a task priced at its latency plus the handoff: where drafts are nearly
    always accepted that is the paper's choice, the smallest lookahead that keeps an instance
    free; where they often fail, shorter blocks, whose tasks end sooner and waste less; where
    blocks wait for instances anyway, no plain task. And whether the instances pay at all: the
    cost model's time per token so chosen against a plain step's, less `MARGIN`
    (`plain_steps=False`: always, to measure DSI itself).

    Where they do not pay, plain steps run on the engine's own target: most lean (no draft beside,
    no bookkeeping after), every `probe_every()`-th with a draft beside it whose verdict keeps
    the acceptance measured; the lean runs between probes back off (PROBE_BACKOFF, NEAR_PATIENCE).
    """

    def __init__(self, instances: int, cap: int = MAX_DRAFT, start: int = 4, plain_steps: bool = True):
        self.instances, self.cap, self.start, self.plain_steps = instances, cap, start, plain_steps
        self.target: float | None = None
        self.handoff: float | None = None
        self.draft: float | None = None
        self._locals: deque[float] = deque(maxlen=LOCAL_WINDOW)  # the last plain steps' seconds
        self.local: float | None = None  # their median: a whole plain step (None: not run yet, as a task's)
        self.restart: float | None = None  # the drafter's, after a rejection
        self.drafted, self.accepted = PRIOR_DRAFTS, PRIOR_DRAFTS * PRIOR_ACCEPTANCE  # decayed counts
        self._chosen: Choice | None = None  # for the figures above
        self._last: Choice | None = None  # the last choice made, for figures since changed or not
        # Plain steps: the probes and their backoff.
        self.plain_next = False  # the last plain step found the instances still do not pay
        self.lean = 0  # plain steps to come with no draft beside them and no bookkeeping after
        self.probe = True  # during plain steps: whether the drafter drafts for the next
        self.lean_run: tuple[float, int] | None = None  # when the lean steps began, and how many
        self._backoff = 1  # the next lean run's length, in intervals of its probe tier (PROBE_BACKOFF)
        self._missed = 0  # probes near the break-even in a row whose draft the target did not take

    # Observations.

    def observe_task(self, seconds: float) -> None:
        self.target = _average(self.target, seconds)
        self._chosen = None

    def observe_handoff(self, seconds: float) -> None:
        self.handoff = _average(self.handoff, max(0.0, seconds))
        self._chosen = None

    def observe_draft(self, seconds: float, tokens: int) -> None:
        self.draft = _average(self.draft, seconds / tokens)
        self._chosen = None

    def observe_restart(self, seconds: float) -> None:
        self.restart = _average(self.restart, max(0.0, seconds))
        self._chosen = None

    def observe_local(self, seconds: float) -> None:
        # A median, not a moving average: measured only during plain steps, one stall could move
        # the instances on for good. Only `pays` reads it: a plain step recomputes no choice.
        self._locals.append(seconds)
        self.local = sorted(self._locals)[len(self._locals) // 2]

    def observe_verdict(self, drafted: int, accepted: int) -> None:
        """`drafted`: the drafts judged (up to the first rejection), `accepted` of them."""
        self.drafted = DECAY * self.drafted + drafted
        self.accepted = DECAY * self.accepted + accepted
        self._chosen = None

    # The cost model's decisions.

    def lookahead(self) -> int:
        return self._choose().lookahead

    def plain_task(self) -> bool:
        """Whether a new frontier gets a task at once, before any draft exists."""
        return self._choose().plain_task

    def pays(self, fresh: bool = True) -> bool:
        """Whether the instances are expected to beat plain steps (before any measurement: yes).
        `fresh=False`: by the choice last made, if a figure changed since (see `_choose`)."""
        chosen = self._choose(fresh)
        return not self.plain_steps or chosen.seconds < self._plain()

    def probe_every(self, fresh: bool = True) -> int:
        """During plain steps: every how many a draft is measured. Rarely where even drafts that
        are all accepted would not pay; often where one more accepted draft would make them pay."""
        chosen = self._choose(fresh)
        if chosen.full >= self._plain():
            return PROBE_RARELY
        return PROBE_NEAR if chosen.next_accepted < self._plain() else PROBE_EVERY

    def room(self) -> int:
        """Drafts worth holding: a lookahead for each instance, and the next one being drafted
        while they all verify (so an instance that frees finds a block ready). During plain
        steps one, for a step that measures the draft (a probe), else none; none during lean
        steps, whatever the figures say, for they commit without the orchestrator's lock."""
        if self.lean:
            return 0
        if self.pays():
            return self.lookahead() * (self.instances + 1)
        return 1 if self.probe else 0

    def draft_count(self, unsent: int, held: int) -> int:
        """Tokens the drafter's next turn drafts, with `held` drafts, `unsent` of them in no task
        yet: up to a lookahead of unsent drafts, within the room. One a turn until the cost model
        has its figures: a drafter as slow as the target shows in one token, and a long draft
        begun on a guess is not the restart a rejection then measures."""
        count = min(max(1, self.lookahead() - unsent), self.room() - held)
        if self.draft is None or self.target is None:
            count = 1
        return count

    # Plain steps: which are lean, which measure a draft.

    def lean_step(self) -> bool:
        """Whether the plain step just run is lean (no draft beside, no bookkeeping after),
        counting it off its run."""
        if self.lean:
            self.lean -= 1
            return True
        return False

    def lean_run_ended(self) -> bool:
        """Before a plain step: whether a run of lean steps just ended (then `probe_beside`)."""
        return not self.lean and self.lean_run is not None

    def probe_beside(self, now: float) -> None:
        """A run of lean steps ended at `now`: their time is a plain step's (a catch-up over the
        tokens the instances committed is not, nor is a step with a draft beside it), and the
        next plain step has a draft beside it."""
        started, steps = self.lean_run
        if steps:
            self.observe_local((now - started) / steps)
        self.lean_run, self.probe = None, True

    def plain_step_ended(self, now: float, matched: bool, tasks_live: bool, drafting: bool) -> bool:
        """After a plain step with its bookkeeping (its probe's verdict observed already): whether
        the instances pay now, and if not, whether the next step is plain too and how many lean
        steps follow. `matched`: the target's token was the draft beside the step; `tasks_live`:
        the instances still run tasks (they cover the frontier); `drafting`: a draft runs beside
        (the next step waits for it, so no lean run starts). By the last choice made: a plain step
        recomputes nothing after a forward's wait, and so decides one verdict late."""
        pays = self.pays(fresh=False)
        self.plain_next = not pays and not tasks_live
        self.probe = False
        if pays:
            self._backoff, self._missed = 1, 0
        elif self.plain_next and not drafting:
            every = self.probe_every(fresh=False)
            if every == PROBE_NEAR:
                self._missed = 0 if matched else self._missed + 1
                self._backoff = 1  # a far tier after this one starts its series of gaps over
                self.lean = every * min(PROBE_BACKOFF, 2 ** max(0, self._missed - NEAR_PATIENCE)) - 1
            else:
                self.lean = every * self._backoff - 1
                self._backoff = min(PROBE_BACKOFF, 2 * self._backoff)
            self.lean_run = (now, self.lean)
        return pays

    def _plain(self) -> float:
        """A plain step's time, less the margin the instances must win by."""
        if self.target is None:
            return float("inf")
        return (self.target if self.local is None else self.local) * MARGIN

    def _choose(self, fresh: bool = True) -> Choice:
        """The choice for the figures as they are; with `fresh=False`, the last one made, if any.
        Pricing every lookahead is slow after a forward's wait: a plain step takes the last
        choice, which the drafting thread's next turn makes again beside a forward."""
        if self.target is None or self.draft is None:  # the instances, as DSI was asked for
            return Choice(min(self.start, self.cap), True, 0.0, 0.0, 0.0)
        if self._chosen is None and not fresh and self._last is not None:
            return self._last
        if self._chosen is None:  # asked several times per step, changed once per result
            latency = self.target + (self.handoff or 0.0)
            # Without a plain task DSI can only win where blocks wait for instances (W k t1 < t2).
            costs = {(k, plain_task): dsi_seconds_per_token(latency, self.draft, self.accepted / self.drafted, k,
                                                            self.instances, self.restart or 0.0, plain_task)
                     for k in range(1, self.cap + 1)
                     for plain_task in ((True, False) if self.instances * k * self.draft < latency else (True,))}
            lookahead, plain_task = min(costs, key=costs.get)
            # With every draft accepted the most drafts a task may hold are best.
            full = dsi_seconds_per_token(latency, self.draft, 1.0, self.cap, self.instances)
            hoped = (DECAY * self.accepted + 1) / (DECAY * self.drafted + 1)  # after one more draft, accepted
            next_accepted = dsi_seconds_per_token(latency, self.draft, hoped, lookahead, self.instances,
                                                  self.restart or 0.0, plain_task)
            self._chosen = self._last = Choice(lookahead, plain_task, costs[lookahead, plain_task], full,
                                               next_accepted)
        return self._chosen


def _average(mean: float | None, sample: float) -> float:
    return sample if mean is None else (1 - EWMA) * mean + EWMA * sample
