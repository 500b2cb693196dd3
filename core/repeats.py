"""The repeat guard: an answer that has started repeating itself ends there.

A stop condition on the committed text, like the end-of-turn token: it changes no distribution,
and since it looks at the tokens one at a time, every decoding mode stops at the same token.
"""

from __future__ import annotations

RUN = 12  # tokens in a repeated run: shorter runs recur in ordinary text (names, set phrases)
TIMES = 3  # occurrences of one run, none overlapping another, that end an answer


class RepeatGuard:
    """Fed an answer's tokens in order; says at which token the answer's last `run` tokens occur
    for the `times`-th time without overlapping (so "a a a ..." needs run * times tokens, not a
    few more than run: a long ruler or table border is not a loop)."""

    def __init__(self, run: int = RUN, times: int = TIMES):
        if run < 1 or times < 2:
            raise ValueError(f"a repeat needs a run of at least 1 token seen at least twice, got {run} x {times}")
        self.run, self.times = run, times
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # run -> where its occurrences end, in order

    def feed(self, tokens: list[int]) -> int | None:
        """Add tokens; the number of them up to and including the one that completes a repeat
        (the answer ends after it), or None when none does."""
        for index, token in enumerate(tokens):
            if self._add(token):
                return index + 1
        return None

    def _add(self, token: int) -> bool:
        self.tokens.append(token)
        end = len(self.tokens)
        if end < self.run:
            return False
        ends = self._ends.setdefault(tuple(self.tokens[-self.run:]), [])
        # Greedy from the latest occurrence backwards counts the most non-overlapping ones.
        count, last = 1, end
        for earlier in reversed(ends):
            if count >= self.times:
                break
            if earlier <= last - self.run:
                count, last = count + 1, earlier
        ends.append(end)
        return count >= self.times


def repeat_end(tokens: list[int], run: int = RUN, times: int = TIMES) -> int | None:
    """Where the guard would end `tokens` (the count kept), or None: they never repeat so."""
    return RepeatGuard(run, times).feed(tokens)
