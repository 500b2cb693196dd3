"""How many tokens to draft before each verification: the cost model, fed as the answer goes.

Expected tokens of a chain of g drafts (algorithms.md section 1, with a rate per position):
E(g) = 1 + sum_{i<=g} prod_{j<=i} a_j, where a_j is the chance that draft j is accepted once
drafts 1..j-1 were. A verification of n tokens costs t(n) one-token forwards (measured on this
machine, `StepTimes`), so a step of g drafts commits E(g) / t(g + 1) tokens per plain step's time;
g = 0 is a plain step (rate 1). Only proposals change with the choice, never verification, so
every choice is lossless.

The rates are counted as the answer goes, per kind of proposal (prompt lookup: the length of
the match it continues, since a 4-token match is followed far more often than a 1-token one),
with old observations fading (`DECAY`), so a document the answer stops quoting stops being
drafted from within a few steps. The drafter proposes first (prompt lookup costs nothing), the
cost model then keeps the first g tokens. A plain choice is probed again every `PROBE_EVERY`
steps of its kind, or the estimates could never recover.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

DECAY = 0.85  # weight of the past per observation: about the last 6-7 verifications count
PRIOR_ACCEPTED, PRIOR_SEEN = 0.5, 1.0  # a weak prior of a = 0.5 at every position
PROBE_EVERY = 8  # plain choices in a row before one short draft is tried again
MAX_DRAFT = 16


class Lookahead(Protocol):
    def most(self, budget: int) -> int:
        """Draft tokens to ask the drafter for, with room for `budget` of them."""
        ...

    def choose(self, proposed: int, context: int, kind: int) -> int:
        """How many of the `proposed` draft tokens (of this kind) to verify, with `context`
        tokens cached; 0 for a plain step."""
        ...

    def observe(self, drafted: int, accepted: int, kind: int) -> None:
        """What the verification of `drafted` tokens of this kind accepted."""
        ...


@dataclass
class FixedLookahead:
    """Always the same length (TriForce's gamma2, the final chain of its hierarchy)."""
    length: int

    def most(self, budget: int) -> int:
        return min(self.length, budget)

    def choose(self, proposed: int, context: int, kind: int) -> int:
        return proposed

    def observe(self, drafted: int, accepted: int, kind: int) -> None:
        pass


@dataclass
class PositionRates:
    """Faded counts, per draft position, of drafts that reached verification and were accepted."""
    seen: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        reached = min(drafted, accepted + 1)  # drafts after the first rejection were never judged
        grow = reached - len(self.seen)
        if grow > 0:
            self.seen += [0.0] * grow
            self.accepted += [0.0] * grow
        for i in range(len(self.seen)):
            self.seen[i] *= DECAY
            self.accepted[i] *= DECAY
        for i in range(reached):
            self.seen[i] += 1
            self.accepted[i] += i < accepted

    def rate(self, position: int) -> float:
        """a_j for position j (0-based), with the prior."""
        seen = self.seen[position] if position < len(self.seen) else 0.0
        taken = self.accepted[position] if position < len(self.accepted) else 0.0
        return (taken + PRIOR_ACCEPTED) / (seen + PRIOR_SEEN)

    def expected_tokens(self, drafts: int) -> float:
        """E(g): tokens one verification of `drafts` chained drafts commits, bonus included."""
        total, reach = 1.0, 1.0
        for position in range(drafts):
            reach *= self.rate(position)
            total += reach
        return total


@dataclass
class CostModelLookahead:
    """The g maximizing E(g) / t(g + 1) at the current context, with the rates of the
    proposal's kind; `relative_time(n, context)` is t(n), a verification of n tokens in one-token
    forwards (StepTimes.relative). For drafters that cost nothing to ask for more (prompt lookup)."""
    relative_time: Callable[[int, int], float]
    cap: int = MAX_DRAFT
    rates: dict[int, PositionRates] = field(default_factory=dict)
    plain_runs: dict[int, int] = field(default_factory=dict)  # plain choices in a row, per kind

    def most(self, budget: int) -> int:
        return min(self.cap, budget)

    def choose(self, proposed: int, context: int, kind: int) -> int:
        rates = self.rates.setdefault(kind, PositionRates())
        best, best_rate = 0, 1.0  # plain decoding: one token per one-token forward
        for drafts in range(1, min(proposed, self.cap) + 1):
            rate = rates.expected_tokens(drafts) / self.relative_time(drafts + 1, context)
            if rate > best_rate:
                best, best_rate = drafts, rate
        if best or not proposed:
            self.plain_runs[kind] = 0
            return best
        self.plain_runs[kind] = self.plain_runs.get(kind, 0) + 1
        if self.plain_runs[kind] >= PROBE_EVERY:
            self.plain_runs[kind] = 0
            return 1
        return 0

    def observe(self, drafted: int, accepted: int, kind: int) -> None:
        if drafted:
            self.rates.setdefault(kind, PositionRates()).observe(drafted, accepted)
