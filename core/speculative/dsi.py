"""DSI, speculation parallelism (Timor et al., seed 002; algorithms.md section 6).

Drafting never waits for verification. The drafter keeps extending a speculative chain beyond the
committed text; every `lookahead` draft tokens, a verification task (the committed text and every
draft so far) goes to a free target instance while drafting goes on. The frontier (the next
position to commit) is always covered by a task: after each resolution the instance that just
answered is free, and if no task still covers the new frontier it gets one at once, with whatever
drafts exist (none: a plain task). So a rejection costs one target latency, exactly what plain
decoding pays per token, and every accepted draft costs only drafting time. Where blocks would
wait for instances anyway (few instances, a fast drafter), the cost model may instead let the new
frontier wait for a lookahead of drafts: no instance then verifies a lone token.

Resolution uses the chain rule of verify.py position by position, so the text is distributed
exactly as the target's (greedy: identical): a task's rows are the target's P at consecutive
positions, drafts there are accepted with min(1, P/Q), the first rejection takes a token from the
residual and cancels every task built on the rejected draft. A task whose drafts are all accepted
checks the next draft too with its last row; if there is none yet, that row gives the bonus token.
Which task resolves which position depends on timing, never on a draft's value, so exactness
holds whatever the instances' speeds.

Every task costs a handoff to an instance and back, and every cancelled one a message. Where
the cost model, pricing a task at its measured latency with that handoff, says the instances
cannot beat plain steps (drafts that keep failing, a drafter as slow as the target), the
orchestrator runs plain steps on the engine's own target instead, measuring the drafter's next
draft against each (min(1, P/Q) at its token: no verification, no pass over the vocabulary),
and goes back to the instances once the acceptance so measured says they pay. A plain step
samples the target's P at the frontier itself, and whether to take one depends on past
verdicts only: exactness holds there too.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from ..decoding import Step
from ..sampling import make_generator, sample, warp
from .dsi_cost import dsi_seconds_per_token
from .lookahead import MAX_DRAFT
from .verify import acceptance_probability, residual, verify_chain

if TYPE_CHECKING:
    from ..decoding import DecodeState
    from .hierarchy import Drafter

EWMA = 0.3  # weight of the newest latency measurement
LOCAL_WINDOW = 5  # plain steps whose median is a plain step's time
DECAY = 0.9  # of the acceptance counts, per verdict
# Before any verdict: as if a quarter of a draft, 70% accepted. Weak, so that where every draft
# fails a few verdicts (4 with a fast drafter) show the instances do not pay.
PRIOR_DRAFTS, PRIOR_ACCEPTANCE = 0.25, 0.7
# The instances must be expected this much faster than a plain step: the cost model leaves out
# about that much (threads contending where a task and a draft end together, the probes below).
MARGIN = 0.98
# During plain steps the drafter drafts beside every PROBE_EVERY-th only: the acceptance is still
# measured, and the steps between run lean, as plain decoding would (their time is what a plain
# step costs: one with a draft beside it is slower by the drafter's share). With every other step
# a full one, DSI's plain steps cost 0.14 ms (of 20) more than plain decoding's on a 2-core VM;
# lean ones between probes, 0.08 ms. Where one more accepted draft would make the instances pay,
# every PROBE_NEAR-th: there a verdict is worth more than the lock (with every 4th there too, a
# cell where they beat plain decoding by 8% took three times as many plain steps and came out at
# 1.01x). Where even drafts that are all accepted could not pay (a drafter as slow as the
# target), only the drafter's latency is worth watching: every PROBE_RARELY-th.
PROBE_NEAR, PROBE_EVERY, PROBE_RARELY = 2, 4, 16
# Each probe costs the drafter's wake-up and the bookkeeping after a forward. Where the instances
# are further than one accepted draft from paying, each gap is twice the last, up to PROBE_BACKOFF
# times its tier's interval (a drafter as slow as the target, 90% accepted: 0.997x plain decoding
# without the backoff, 1.000x with it). Near the break-even a draft the target takes is what
# brings DSI back: there the gaps grow only after more than NEAR_PATIENCE drafts in a row were
# not taken (a draft right 60% of the time misses four in a row one time in 40; a fast drafter
# whose every draft fails is always near, one accepted draft from paying: 0.995x with a probe
# every second step, 0.998x with the backoff, means of 12 interleaved runs). The instances
# paying starts over.
PROBE_BACKOFF = 8
NEAR_PATIENCE = 3


class TargetPool(Protocol):
    """Target instances, each with a cache of its own (dsi_pool.py: threads or processes)."""
    size: int

    def idle(self) -> int:
        """Instances with nothing to do."""
        ...

    def submit(self, tokens: torch.Tensor, count: int) -> int:
        """Give `tokens` [E] to an idle instance: its logits after each of the last `count`
        tokens. Returns the task's id."""
        ...

    def results(self, timeout: float | None) -> list[tuple[int, torch.Tensor, float]]:
        """Finished tasks as (id, logits [count, vocab], seconds it ran), waiting up to
        `timeout` seconds (None: until one finishes, or `wake`) for the first."""
        ...

    def wake(self) -> None:
        """Make a waiting `results` return, from another thread."""
        ...

    def cancel(self, task_ids: set[int]) -> None:
        """Stop these tasks where they are (their results never come)."""
        ...


@dataclass(frozen=True)
class Task:
    id: int
    first: int  # the first position its rows predict (the frontier when it was sent)
    end: int  # tokens it ran; its last row predicts position `end`
    sent: float  # time.perf_counter() when it was sent


def resolve(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor,
            generator: torch.Generator | None) -> tuple[int, int | None]:
    """The target's P at m consecutive positions (p [m, vocab]) against the draft tokens at the
    first g <= m of them (drafts [g], drawn from q [g, vocab]).

    Returns (accepted drafts, next token): the recovered token at the first rejection, or the
    bonus token from p[g] when all are accepted and g < m; None when all g = m are accepted (the
    position after needs a later task's P).
    """
    g, m = drafts.shape[0], p.shape[0]
    if g < m:
        verdict = verify_chain(drafts, q, p[:g + 1], generator)
        return verdict.accepted, verdict.next_token
    accept = torch.rand(g, generator=generator) < acceptance_probability(p, q, drafts)
    rejected = (~accept).nonzero()
    if rejected.numel() == 0:
        return g, None
    first = int(rejected[0])
    return first, sample(residual(p[first], q[first]), generator)


class Latencies:
    """Measured seconds of a verification task, of the handoff around it (from sending a task
    that covers the frontier to its verdict committed, less its run: the queues, the threads'
    wake-ups and the verification), of drafting one token (the drafting thread's whole turn),
    of the drafter's restart after a rejection (until it drafts from the new text) and of a
    whole plain step on the engine's own target (moving averages), and the drafts' acceptance.
    They choose the lookahead and whether a rejection's new frontier gets a plain task at once
    or waits for a lookahead of drafts, those with the lowest expected time per token in DSI's
    cost model (dsi_cost.py), a task priced at its latency plus the handoff: where drafts are
    nearly always accepted that is the paper's choice, the smallest lookahead that keeps an
    instance free; where they often fail, shorter blocks, whose tasks end sooner and waste less;
    where blocks wait for instances anyway, no plain task. And whether the instances pay at
    all: the cost model's time per token so chosen against a plain step's, less `MARGIN`
    (`plain_steps=False`: always, to measure DSI itself)."""

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
        # The median of the last few, not a moving average: it is measured only while plain steps
        # run, so one stall (the process paused, a page fault) could move the instances on, and
        # there nothing would measure it again. It leaves the cost model's choice alone: only
        # `pays` reads it, so a plain step recomputes nothing (code that runs after a forward's
        # wait runs cold, several times slower than in a loop).
        self._locals.append(seconds)
        self.local = sorted(self._locals)[len(self._locals) // 2]

    def observe_verdict(self, drafted: int, accepted: int) -> None:
        self.drafted = DECAY * self.drafted + drafted
        self.accepted = DECAY * self.accepted + accepted
        self._chosen = None

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

    def _plain(self) -> float:
        """A plain step's time, less the margin the instances must win by."""
        if self.target is None:
            return float("inf")
        return (self.target if self.local is None else self.local) * MARGIN

    def _choose(self, fresh: bool = True) -> Choice:
        """The choice for the figures as they are; with `fresh=False`, the last one made, if any.
        Choosing prices every lookahead, about 100 us after a forward's wait (0.5% of a 20 ms
        step): a plain step takes the last choice, which the drafting thread's next turn makes
        again beside a forward, and so decides one verdict late."""
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


class Choice(NamedTuple):
    lookahead: int
    plain_task: bool  # a new frontier's task at once, before any draft exists
    seconds: float  # expected per token on the instances, so chosen
    full: float  # ... were every draft accepted
    next_accepted: float  # ... at this lookahead, were the next draft accepted


def _average(mean: float | None, sample: float) -> float:
    return sample if mean is None else (1 - EWMA) * mean + EWMA * sample


_drafting: weakref.WeakSet[DsiDecoder] = weakref.WeakSet()  # decoders whose drafting thread started
# A thread still inside torch when the interpreter exits aborts it: let them finish first.
atexit.register(lambda: [decoder._join() for decoder in list(_drafting)])


class DsiDecoder:
    """The `Decoder` interface (decoding.py) over a pool of target instances.

    Two threads: a drafting thread extends the chain and wakes the caller's thread, which in
    `step` waits for results and drafts, commits what the task that covers the frontier
    resolves, covers the new frontier at once and sends each lookahead of drafts to an idle
    instance. So a finished task is resolved at once, never after a draft forward, and only the
    caller's thread gives out instances: an instance that just answered always goes to the
    frontier first. The engine's own cache advances only with plain steps, where the instances
    do not pay (`Latencies.pays`): it then reads whatever the instances committed since.
    `close` stops the drafting thread (decoding.decode calls it after each answer).
    `plain_steps=False`: every token from the instances, whatever the cost model says.
    """

    def __init__(self, drafter: Drafter, pool: TargetPool, cap: int = MAX_DRAFT, start: int = 4,
                 plain_steps: bool = True):
        self.drafter = drafter
        self.pool = pool
        self.latencies = Latencies(pool.size, cap, start, plain_steps)
        self.drafts: list[int] = []  # the speculative chain beyond the committed text
        self.q: list[torch.Tensor] = []  # the distribution each draft was drawn from
        self.live: dict[int, Task] = {}  # tasks whose results may still be used
        self.done: dict[int, tuple[torch.Tensor, float]] = {}  # finished live tasks: logits, seconds
        self.exhausted = False  # the drafter found nothing to add to the current chain
        self.closed = False
        self.error: Exception | None = None  # the drafting thread's, raised in the caller's
        self.counts = {"instances": pool.size, "dispatched": 0, "cancelled": 0, "accepted": 0, "hidden_ms": 0,
                       "plain_steps": 0}  # plain steps: on the engine's own target, where the instances did not pay
        self._task_seconds = 0.0  # run time of the tasks whose results were used
        self._waited = 0.0  # time the caller spent waiting for a result
        self._changed = threading.Condition()  # guards all of the above; wakes the drafting thread
        self._drafting: threading.Thread | None = None
        self._state: DecodeState | None = None  # the answer's, for the drafting thread's view of the chain
        self._returned: float | None = None  # time.perf_counter() when the last step ended
        self._frontier_task: tuple[float, float] | None = None  # (sent, seconds) of a resolving frontier task
        self._rejected: float | None = None  # time.perf_counter() of a rejection the drafter has not seen yet
        self._probe = True  # during plain steps: whether the drafter drafts for the next
        self._plain_next = False  # the last plain step found the instances still do not pay
        self._lean = 0  # plain steps to come with no draft beside them and no bookkeeping after
        self._backoff = 1  # the next lean run's length, in intervals of its probe tier (PROBE_BACKOFF)
        self._missed = 0  # probes near the break-even in a row whose draft the target did not take
        self._run: tuple[float, int] | None = None  # when the lean steps began, and how many
        self._in_turn = False  # whether the drafting thread drafts now

    @property
    def drafter_wants_queries(self) -> bool:
        return self.drafter.wants_queries

    def observe_queries(self, queries: dict[int, torch.Tensor]) -> None:
        self.drafter.observe_queries(queries)

    def stage_counts(self) -> dict[str, dict[str, int]]:
        with self._changed:
            self.counts["hidden_ms"] = round(1000 * max(0.0, self._task_seconds - self._waited))
            return {**self.drafter.counts(), "dsi": dict(self.counts)}

    def close(self) -> None:
        """The drafting thread ends after its current draft (not awaited: the next answer has
        a drafter of its own and need not wait for a draft nobody will use; at exit it is)."""
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    def _join(self) -> None:
        self.close()
        if self._drafting is not None:
            self._drafting.join(timeout=10)

    def begin(self, state: DecodeState) -> None:
        """Every instance starts reading the prompt (each has its own cache) while the engine
        reads it too, for the first token."""
        with self._changed:
            while self.pool.idle():
                self._submit(state)

    def step(self, state: DecodeState, budget: int) -> Step:
        if self._plain_next and self.error is None:
            # Read without the lock, as the plain step's own bookkeeping decided it: a figure the
            # drafting thread changed since shows a step later. Each line here runs cold, after
            # a forward's wait, and plain decoding has none of them.
            return self._plain_step(state, budget)
        self._state = state
        if self._drafting is None:
            with self._changed:
                # The prompt reads `begin` sent predict a token already committed: stopping them
                # keeps what they read. Without `begin`, every instance gets the frontier: the
                # first to answer resolves it.
                self._cancel(lambda t: t.end < state.ids.shape[0])
                while self.pool.idle():
                    self._submit(state)
            # The drafter samples with a generator of its own: two threads never share one.
            seed = int(torch.randint(0, 2**62, (1,), generator=state.generator))
            self._drafting = threading.Thread(target=self._draft_loop, args=(state, make_generator(seed)),
                                              daemon=True, name="dsi-drafting")
            self._drafting.start()
            _drafting.add(self)
        while True:
            with self._changed:
                if self.error is not None:
                    raise self.error
                step = self._resolve(state, budget)
                pays = self.latencies.pays()
                if step is None and not pays and not self.live:  # a live task would cover the frontier
                    break
                if pays:
                    # Nothing covers the frontier: a task for it now, or (no plain task) once a
                    # lookahead of drafts is ready, unless the drafter has nothing to add.
                    if (self._covering(state.ids.shape[0], finished_only=False) is None and self.pool.idle()
                            and (self.latencies.plain_task() or self.exhausted)):
                        self._submit(state)
                    self._dispatch_block(state)
                if step is not None:
                    self._changed.notify_all()
                    previous, self._returned = self._returned, time.perf_counter()
                    # A task sent for the frontier had its whole handoff on the critical path
                    # (the first step's may have waited for the engine's prompt read instead).
                    if self._frontier_task is not None and previous is not None:
                        sent, seconds = self._frontier_task
                        self.latencies.observe_handoff(self._returned - sent - seconds)
                    return step
            started = time.perf_counter()
            finished = self.pool.results(None)
            received = time.perf_counter()
            with self._changed:
                self._waited += received - started
                for task_id, logits, seconds in finished:
                    task = self.live.get(task_id)
                    self.latencies.observe_task(seconds)
                    if task is not None:
                        self.done[task_id] = (logits, seconds)
        return self._plain_step(state, budget)

    def _plain_step(self, state: DecodeState, budget: int) -> Step:
        """One forward of the engine's own target over what its cache lacks (the tokens the
        instances committed since its last step, and the newest), and its token.

        Most plain steps are lean: nothing beside them (the drafting thread waits) and nothing
        to decide after them, plain decoding's own work. The orchestrator's bookkeeping runs
        cold after a forward's wait (0.14 ms of a 20 ms step, were it on every step). Every
        `probe_every()`-th step (later while the probes find the instances no nearer to
        paying: PROBE_BACKOFF, NEAR_PATIENCE) has a draft beside it, which it measures at its
        end, not verifies: min(1, P/Q) at its token, whose expectation over the draft is the
        acceptance rate, costs no pass over the vocabulary. Where the target's token equals that
        draft the drafts after it still continue the text (`_extend`'s argument)."""
        if not self._lean and self._run is not None:
            self._probe_beside()
        start = state.cache.length
        logits = state.model.forward(state.ids[start:], torch.arange(start, state.ids.shape[0]), state.cache)
        p = warp(logits[-1], state.params)
        token = sample(p, state.generator)
        if self._lean:  # no lock: the drafting thread waits, and only this thread gives out instances
            self._lean -= 1
            state.commit([token])
            self.counts["plain_steps"] += 1
            return Step([token])
        with self._changed:
            self._returned = time.perf_counter()
            self.counts["plain_steps"] += 1
            if self.drafts:
                self.latencies.observe_verdict(1, self._acceptance(p, token, state.params.greedy))
            matched = bool(self.drafts) and self.drafts[0] == token
            if matched:
                del self.drafts[:1], self.q[:1]
            else:
                self.drafts, self.q = [], []
            state.commit([token])
            self.exhausted = False
            pays = self.latencies.pays(fresh=False)
            self._plain_next = not pays and not self.live
            self._probe = False
            if pays:
                self._backoff, self._missed = 1, 0
                self._changed.notify_all()
            elif self._plain_next and not self._in_turn:  # else a draft runs beside: the next step waits for it
                every = self.latencies.probe_every(fresh=False)
                if every == PROBE_NEAR:
                    self._missed = 0 if matched else self._missed + 1
                    self._backoff = 1  # a far tier after this one starts its series of gaps over
                    self._lean = every * min(PROBE_BACKOFF, 2 ** max(0, self._missed - NEAR_PATIENCE)) - 1
                else:
                    self._lean = every * self._backoff - 1
                    self._backoff = min(PROBE_BACKOFF, 2 * self._backoff)
                self._run = (self._returned, self._lean)
        return Step([token])

    def _probe_beside(self) -> None:
        """A run of lean steps ended: their time is a plain step's (a catch-up over the tokens
        the instances committed is not, nor is a step with a draft beside it). The drafter drafts
        beside the next, woken as its forward starts, so that its wake-up runs beside the forward,
        not in the caller's way between forwards."""
        with self._changed:
            started, steps = self._run
            if steps:
                self.latencies.observe_local((time.perf_counter() - started) / steps)
            self._run, self._probe = None, True
            self._changed.notify_all()

    def _acceptance(self, p: torch.Tensor, token: int, greedy: bool) -> float:
        """min(1, P/Q) at the next draft's token. Greedy P is one-hot at `token`: then 1 if the
        draft is it, else 0, without a tensor operation (each costs tens of microseconds on the
        critical path, after a forward's wait)."""
        draft = self.drafts[0]
        if greedy:
            return float(draft == token)
        return min(1.0, float(p[draft] / self.q[0][draft]))

    def _submit(self, state: DecodeState) -> None:
        tokens = torch.cat([state.ids, torch.tensor(self.drafts, dtype=torch.long)])
        task_id = self.pool.submit(tokens, len(self.drafts) + 1)
        self.live[task_id] = Task(task_id, state.ids.shape[0], tokens.shape[0], time.perf_counter())
        self.counts["dispatched"] += 1

    def _covering(self, frontier: int, finished_only: bool) -> Task | None:
        """The task that covers the frontier and reaches furthest."""
        tasks = [t for t in self.live.values() if t.first <= frontier <= t.end
                 and (t.id in self.done or not finished_only)]
        return max(tasks, key=lambda t: t.end, default=None)

    def _resolve(self, state: DecodeState, budget: int) -> Step | None:
        """The frontier resolved by the finished task that covers it, if there is one."""
        frontier = state.ids.shape[0]
        task = self._covering(frontier, finished_only=True)
        if task is None:
            return None
        logits, seconds = self.done.pop(task.id)
        del self.live[task.id]
        self._frontier_task = (task.sent, seconds) if task.first == frontier else None
        self.counts["accepted"] += 1  # a task whose verdict was used
        self._task_seconds += seconds
        return self._verdict(state, warp(logits[frontier - task.first:], state.params), budget)

    def _verdict(self, state: DecodeState, p: torch.Tensor, budget: int) -> Step:
        """Commit what the target's P at the frontier and the positions after it (p [m, vocab])
        says of the drafts there, and drop what that invalidates."""
        g = min(len(self.drafts), p.shape[0])
        drafts = torch.tensor(self.drafts[:g], dtype=torch.long)
        q = torch.stack(self.q[:g]) if g else p[:0]
        accepted, next_token = resolve(p, drafts, q, state.generator)
        if g:  # the drafts after the first rejection were never judged
            self.latencies.observe_verdict(min(g, accepted + 1), accepted)
        tokens = self.drafts[:accepted] + ([] if next_token is None else [next_token])
        state.commit(tokens[:budget])
        if next_token is None:
            del self.drafts[:accepted], self.q[:accepted]
            self._cancel(lambda t: t.end < state.ids.shape[0])
            last = "draft"
        else:
            # A recovered token invalidates every task built on the rejected draft; after a bonus
            # no draft existed past this task, so nothing live reaches further either.
            if len(self.drafts) > accepted:
                self._rejected = time.perf_counter()  # the drafter starts again from here
            self.drafts, self.q = [], []
            self._cancel(lambda t: True)
            last = "bonus" if accepted == g and g else "recovered" if g else "plain"
        self.exhausted = False  # the committed text changed: the drafter may find more
        return Step(tokens[:budget], drafted=g, accepted=accepted, depth=g, verified=p.shape[0], last=last)

    def _cancel(self, which) -> None:
        tasks = {t.id for t in self.live.values() if which(t)}
        for task_id in tasks:
            del self.live[task_id]
            self.done.pop(task_id, None)
        self.pool.cancel(tasks)
        self.counts["cancelled"] += len(tasks)

    def _draft_loop(self, state: DecodeState, generator: torch.Generator) -> None:
        """The drafting thread: extend the chain while there is room and something to draft."""
        while True:
            with self._changed:
                while not self.closed and (self.exhausted or len(self.drafts) >= self._room()):
                    self._changed.wait()
                if self.closed:
                    return
                started = time.perf_counter()  # a draft's time: this loop's whole turn, its locks included
                self._in_turn = True
                # Read under the lock, before any observation here: a step or a new figure may
                # change the room (plain steps or not) after the check above.
                count = min(max(1, self.latencies.lookahead() - self._unsent(state)), self._room() - len(self.drafts))
                # One a turn until the cost model has its figures: a drafter as slow as the target
                # shows in one token, and a long draft begun on a guess is not the restart a
                # rejection then measures.
                if self.latencies.draft is None or self.latencies.target is None:
                    count = 1
                if self._rejected is not None:  # the rest of a draft on the rejected text, or a wake-up
                    self.latencies.observe_restart(started - self._rejected)
                    self._rejected = None
                chain = torch.cat([state.ids, torch.tensor(self.drafts, dtype=torch.long)])
                drafting = replace(state, ids=state.ids, generator=generator)
            try:
                proposal = self.drafter.draft(drafting, chain, count)
            except Exception as error:  # the caller raises it: the answer ends with the reason
                with self._changed:
                    self.error, self._in_turn = error, False
                return
            with self._changed:
                self._in_turn = False
                if proposal is None or len(proposal) == 0:
                    self.exhausted = self._current().shape[0] == chain.shape[0]  # else: try the new text
                else:
                    self.latencies.observe_draft(time.perf_counter() - started, len(proposal))
                    self._extend(chain, proposal)
                if self.latencies.pays() and (self._block_ready(state) or self.exhausted) and self.pool.idle():
                    self.pool.wake()  # the caller's thread sends it (or a task for an uncovered frontier)

    def _current(self) -> torch.Tensor:
        return torch.cat([self._state.ids, torch.tensor(self.drafts, dtype=torch.long)])

    def _extend(self, chain: torch.Tensor, proposal) -> None:
        """Take the drafts of `proposal` (which continues `chain`) past the current chain, if
        the current chain still agrees with it. It may have moved on meanwhile: a rejection
        replaced a draft (then nothing agrees), or the target committed tokens past every draft,
        and where they equal the proposal's first tokens the rest still continues the text, as
        DSI keeps the threads that drew the target's token. Keeping or not depends on a draft's
        value only through that equality, which leaves later drafts distributed as Q given
        their context: verification stays exact."""
        current = self._current()
        extended = torch.cat([chain, proposal.tokens])
        start = current.shape[0] - chain.shape[0]  # the proposal's first token past the current chain
        if start < 0 or start >= len(proposal) or not torch.equal(extended[:current.shape[0]], current):
            return
        self.drafts += proposal.tokens[start:].tolist()
        self.q += list(proposal.q[start:])

    def _room(self) -> int:
        """Drafts worth holding: a lookahead for each instance, and the next one being drafted
        while they all verify (so an instance that frees finds a block ready). During plain
        steps one, for a step that measures the draft (`probe_every`), else none; none during
        lean steps, whatever the figures say, for they commit without the lock."""
        if self._lean:
            return 0
        if self.latencies.pays():
            return self.latencies.lookahead() * (self.pool.size + 1)
        return 1 if self._probe else 0

    def _unsent(self, state: DecodeState) -> int:
        """Drafts no live task holds yet."""
        reach = max((t.end for t in self.live.values()), default=state.ids.shape[0])  # drafts held: before it
        return max(0, state.ids.shape[0] + len(self.drafts) - reach)

    def _block_ready(self, state: DecodeState) -> bool:
        """A lookahead of drafts no task holds yet, or whatever there is when the drafter has
        run dry."""
        unsent = self._unsent(state)
        return unsent >= self.latencies.lookahead() or (self.exhausted and unsent > 0)

    def _dispatch_block(self, state: DecodeState) -> None:
        if self._block_ready(state) and self.pool.idle():
            self._submit(state)
