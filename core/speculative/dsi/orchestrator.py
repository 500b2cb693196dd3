"""DSI's orchestrator: `DsiDecoder`, verification tasks on a pool of target instances (pool.py)
while a drafting thread drafts, every decision taken by the policy (policy.py). How and why it
stays exact: the package's docstring (__init__.py).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ...sampling import make_generator, sample, warp
from ..lookahead import MAX_DRAFT
from ..types import Step
from ..verify import acceptance_probability, point_mass, residual, verify_chain
from .policy import DsiPolicy

# With no task in flight only the drafting thread's wake-up can end a wait for results: so long
# at most, then a task for the frontier (a wait for a wake-up that never came hung an answer in CI).
DRAFTER_WAIT_S = 0.2

if TYPE_CHECKING:
    from ..types import DecodeState, Drafter
    from .pool import TargetPool


@dataclass(frozen=True)
class Task:
    id: int
    first: int  # the first position its rows predict (the frontier when it was sent)
    end: int  # tokens it ran; its last row predicts position `end`
    sent: float  # time.perf_counter() when it was sent
    tokens: torch.Tensor  # [end] what it ran: each row's prefix, for the repetition penalties


def resolve(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
            generator: torch.Generator | None) -> tuple[int, int | None]:
    """The target's P at m consecutive positions (p [m, vocab]) against the draft tokens at the
    first g <= m of them (drafts [g], drawn from q [g, vocab]; None: deterministic drafts).

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
    q_first = point_mass(drafts[first], p[first]) if q is None else q[first].to(p.device)
    return first, sample(residual(p[first], q_first), generator)


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
    do not pay (`DsiPolicy.pays`): it then reads whatever the instances committed since.
    `close` stops the drafting thread (decoding.decode calls it after each answer).
    `plain_steps=False`: every token from the instances, whatever the cost model says.
    """

    def __init__(self, drafter: Drafter, pool: TargetPool, cap: int = MAX_DRAFT, start: int = 4,
                 plain_steps: bool = True):
        self.drafter = drafter
        self.pool = pool
        self.policy = DsiPolicy(pool.size, cap, start, plain_steps)  # fed what is measured, under `_changed`
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

    def read_prompt(self, ids: torch.Tensor, end: int) -> None:
        """A draft model reads the prompt during the prefill, before the drafting thread starts."""
        self.drafter.read_prompt(ids, end)

    def begin(self, state: DecodeState) -> None:
        """Every instance starts reading the prompt (each has its own cache) while the engine
        reads it too, for the first token."""
        with self._changed:
            while self.pool.idle():
                self._submit(state)

    def step(self, state: DecodeState, budget: int) -> Step:
        if self.policy.plain_next and self.error is None:
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
                pays = self.policy.pays()
                if step is None and not pays and not self.live:  # a live task would cover the frontier
                    break
                if pays:
                    # Nothing covers the frontier: a task for it now, or (no plain task) once a
                    # lookahead of drafts is ready, unless the drafter has nothing to add.
                    if (self._covering(state.ids.shape[0], finished_only=False) is None and self.pool.idle()
                            and (self.policy.plain_task() or self.exhausted)):
                        self._submit(state)
                    self._dispatch_block(state)
                if step is not None:
                    self._changed.notify_all()
                    previous, self._returned = self._returned, time.perf_counter()
                    # A task sent for the frontier had its whole handoff on the critical path
                    # (the first step's may have waited for the engine's prompt read instead).
                    if self._frontier_task is not None and previous is not None:
                        sent, seconds = self._frontier_task
                        self.policy.observe_handoff(self._returned - sent - seconds)
                    return step
            started = time.perf_counter()
            idle = not self.live  # read without the lock: only this thread sends tasks
            finished = self.pool.results(DRAFTER_WAIT_S if idle else None)
            received = time.perf_counter()
            with self._changed:
                self._waited += received - started
                for task_id, logits, seconds in finished:
                    task = self.live.get(task_id)
                    self.policy.observe_task(seconds)
                    if task is not None:
                        self.done[task_id] = (logits, seconds)
                if idle and not finished and received - started >= DRAFTER_WAIT_S and self.pool.idle():
                    self._submit(state)  # no wake-up came: the frontier's task, not a wait forever
        return self._plain_step(state, budget)

    def _plain_step(self, state: DecodeState, budget: int) -> Step:
        """One forward of the engine's own target over what its cache lacks (the tokens the
        instances committed since its last step, and the newest), and its token.

        Most plain steps are lean, plain decoding's own work: nothing beside them (the drafting
        thread waits) and nothing to decide after them (bookkeeping runs cold after a forward's
        wait). The policy's probes (`DsiPolicy.probe_every`, backing off
        while they find the instances no nearer to paying) have a draft beside them, which the
        step measures at its end, not verifies: min(1, P/Q) at its token, whose expectation over
        the draft is the acceptance rate, costs no pass over the vocabulary. Where the target's
        token equals that draft the drafts after it still continue the text (`_extend`'s argument)."""
        policy = self.policy
        if policy.lean_run_ended():
            self._probe_beside()
        start = state.cache.length
        logits = state.model.forward(state.ids[start:], torch.arange(start, state.ids.shape[0]), state.cache)
        p = warp(logits[-1], state.params, state.counts())
        token = sample(p, state.generator)
        if policy.lean_step():  # no lock: the drafting thread waits, and only this thread gives out instances
            state.commit([token])
            self.counts["plain_steps"] += 1
            return Step([token])
        with self._changed:
            self._returned = time.perf_counter()
            self.counts["plain_steps"] += 1
            if self.drafts:
                self.policy.observe_verdict(1, self._acceptance(p, token, state.params.greedy))
            matched = bool(self.drafts) and self.drafts[0] == token
            if matched:
                del self.drafts[:1], self.q[:1]
            else:
                self.drafts, self.q = [], []
            state.commit([token])
            self.exhausted = False
            if policy.plain_step_ended(self._returned, matched, bool(self.live), self._in_turn):
                self._changed.notify_all()  # the instances pay: the drafting thread drafts for them
        return Step([token])

    def _probe_beside(self) -> None:
        """A run of lean steps ended: their time is a plain step's (a catch-up over the tokens
        the instances committed is not, nor is a step with a draft beside it). The drafter drafts
        beside the next, woken as its forward starts, so that its wake-up runs beside the forward,
        not in the caller's way between forwards."""
        with self._changed:
            self.policy.probe_beside(time.perf_counter())
            self._changed.notify_all()

    def _acceptance(self, p: torch.Tensor, token: int, greedy: bool) -> float:
        """min(1, P/Q) at the next draft's token. Greedy P is one-hot at `token`: then 1 if the
        draft is it, else 0, without a tensor operation (each is slow on the critical path,
        cold after a forward's wait)."""
        draft = self.drafts[0]
        if greedy:
            return float(draft == token)
        q = self.q[0]
        return min(1.0, float(p[draft]) / (1.0 if q is None else float(q[draft])))

    def _submit(self, state: DecodeState) -> None:
        tokens = torch.cat([state.ids, torch.tensor(self.drafts, dtype=torch.long)])
        task_id = self.pool.submit(tokens, len(self.drafts) + 1)
        self.live[task_id] = Task(task_id, state.ids.shape[0], tokens.shape[0], time.perf_counter(), tokens)
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
        counts = state.chain_counts(task.tokens[frontier:], task.tokens[:frontier])  # each row's own prefix
        return self._verdict(state, warp(logits[frontier - task.first:], state.params, counts), budget)

    def _verdict(self, state: DecodeState, p: torch.Tensor, budget: int) -> Step:
        """Commit what the target's P at the frontier and the positions after it (p [m, vocab])
        says of the drafts there, and drop what that invalidates."""
        g = min(len(self.drafts), p.shape[0])
        drafts = torch.tensor(self.drafts[:g], dtype=torch.long)
        q = torch.stack(self.q[:g]) if g and self.q[0] is not None else None
        accepted, next_token = resolve(p, drafts, q, state.generator)
        if g:  # the drafts after the first rejection were never judged
            self.policy.observe_verdict(min(g, accepted + 1), accepted)
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
                while not self.closed and (self.exhausted or len(self.drafts) >= self.policy.room()):
                    self._changed.wait()
                if self.closed:
                    return
                started = time.perf_counter()  # a draft's time: this loop's whole turn, its locks included
                self._in_turn = True
                # Read under the lock, before any observation here: a step or a new figure may
                # change the room (plain steps or not) after the check above.
                count = self.policy.draft_count(self._unsent(state), len(self.drafts))
                if self._rejected is not None:  # the rest of a draft on the rejected text, or a wake-up
                    self.policy.observe_restart(started - self._rejected)
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
                    self.policy.observe_draft(time.perf_counter() - started, len(proposal))
                    self._extend(chain, proposal)
                if self.policy.pays() and (self._block_ready(state) or self.exhausted) and self.pool.idle():
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
        self.q += [None] * (len(proposal) - start) if proposal.q is None else list(proposal.q[start:])

    def _unsent(self, state: DecodeState) -> int:
        """Drafts no live task holds yet."""
        reach = max((t.end for t in self.live.values()), default=state.ids.shape[0])  # drafts held: before it
        return max(0, state.ids.shape[0] + len(self.drafts) - reach)

    def _block_ready(self, state: DecodeState) -> bool:
        """A lookahead of drafts no task holds yet, or whatever there is when the drafter has
        run dry."""
        unsent = self._unsent(state)
        return unsent >= self.policy.lookahead() or (self.exhausted and unsent > 0)

    def _dispatch_block(self, state: DecodeState) -> None:
        if self._block_ready(state) and self.pool.idle():
            self._submit(state)
