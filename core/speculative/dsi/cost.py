"""Expected seconds per token of speculative inference (SI) and of DSI, and DSI's lookahead.

Pure arithmetic (no torch: the planner uses it and must stay torch-free). The model
is the paper's (Timor et al., seed 002; algorithms.md section 6): a draft step takes `draft_s`
(t1), a verification of a few tokens `target_s` (t2, memory-bound: the same for 1 or k + 1
tokens), and each draft token is accepted with probability `acceptance` (a), independently.
"""

from __future__ import annotations

import math


def _share(acceptance: float, n: int) -> float:
    """(1 - a) / (1 - a^n): one over the expected accepted run of a chain of n, capped. 1/n at
    a = 1, its limit (the plain formula divides 0 by 0 there)."""
    if acceptance >= 1:
        return 1 / n
    return (1 - acceptance) / (1 - acceptance**n)


def si_seconds_per_token(target_s: float, draft_s: float, acceptance: float, lookahead: int) -> float:
    """Draft `lookahead` tokens, then verify them: k t1 + t2 per iteration, which commits
    (1 - a^(k+1)) / (1 - a) tokens on average."""
    return (lookahead * draft_s + target_s) * _share(acceptance, lookahead + 1)


def dsi_seconds_per_token(target_s: float, draft_s: float, acceptance: float, lookahead: int,
                          instances: int, restart_s: float = 0.0, plain_task: bool = True) -> float:
    """DSI over `instances` target instances, verification tasks of `lookahead` drafts.

    Between two rejections a run commits L + 1 tokens, P(L = l) = (1 - a) a^l. With a plain task
    (the paper's DSI), a task with no drafts covers the frontier at once (t2), and block j of k
    drafts is sent at j k t1 or, when every instance is busy, once the task W blocks before it
    ends. The run ends when the task holding draft L ends: block N = ceil(L/k) (N = 0: the plain
    task), sent at N k t1 + floor(N/W) max(0, t2 - W k t1), so with E[N] = a / (1 - a^k) and
    E[floor(N/W)] = a^((W-1)k+1) / (1 - a^(Wk)) the run takes on average
        t2 + k t1 E[N] + max(0, t2 - W k t1) E[floor(N/W)],
    for 1 / (1 - a) tokens. a = 0 is plain decoding (t2 a token); as a -> 1 it tends to
    max(k t1, t2 / W) / k: drafting, or W instances verifying side by side, whichever is slower.
    Where an instance is always free (W k t1 >= t2, what `dsi_lookahead` picks) the last term is 0.

    Without a plain task (`plain_task=False`) the frontier waits for a lookahead of drafts: block
    0 holds drafts 1..k, and the run ends with block M = max(0, N - 1), sent at (M + 1) k t1 plus
    its waits. A first draft that fails then costs k t1 more, but no instance verifies a lone
    token: where blocks wait for instances (W k t1 < t2) that can be worth it.

    `restart_s`: how long the drafter takes, after a rejection, to start drafting from the new
    text (the rest of a draft it had begun on the old one). It delays every block of the run; where
    blocks wait for instances the waits absorb part of it, so there it is an upper bound. With a
    plain task it costs at most t2 - t1: a drafter that restarts later than that finds the plain
    task's token committed and a new plain task covering the frontier, so the run goes on at a
    plain task's pace until the drafts catch up. So bounded, DSI at k = 1 is never slower than
    plain decoding: t2 - a^2 (t2 - t1) a token at most.
    """
    a, k, w = acceptance, lookahead, instances
    waiting = max(0.0, target_s - w * k * draft_s)  # what each W-th block waits for an instance
    if plain_task:
        restart_s = min(restart_s, max(0.0, target_s - draft_s))
        return ((1 - a) * target_s + k * draft_s * a * _share(a, k) + restart_s * a * (1 - a)
                + waiting * a ** ((w - 1) * k + 1) * _share(a, w * k))
    return ((1 - a) * (target_s + restart_s) + k * draft_s * (a * _share(a, k) + (1 - a) ** 2)
            + waiting * a ** (w * k + 1) * _share(a, w * k))


def dsi_lookahead(target_s: float, draft_s: float, instances: int, cap: int) -> int:
    """The smallest k with W k t1 >= t2 (the paper's inequality: a task never waits for an
    instance, and rejections are found as early as possible), within [1, cap]. A free draft
    (t1 = 0) never satisfies it: then `cap`, the most drafts a task may hold."""
    if draft_s <= 0:
        return cap
    # The tolerance keeps an exact ratio (1 / (4 x 0.05) = 5) from rounding up to the next k.
    return max(1, min(cap, math.ceil(target_s / (instances * draft_s) - 1e-9)))
