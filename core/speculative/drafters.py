"""Drafters: sources of draft tokens for a verifier.

Every drafter returns a `Proposal`: draft tokens and, per token, the distribution Q it was drawn
from (one-hot for deterministic drafters), which verification needs to stay lossless.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

VOTERS = 64  # the latest occurrences whose continuations vote: bounded work in long documents


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [g] draft tokens
    q: torch.Tensor | None  # [g, vocab] draft distributions; None: deterministic (each Q one-hot)
    kind: int = 0  # what sort of proposal, for acceptance bookkeeping (prompt lookup: the matched n)

    def first(self, count: int) -> "Proposal":
        """The first `count` draft tokens."""
        return Proposal(self.tokens[:count], None if self.q is None else self.q[:count], self.kind)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class QueryBlind:
    """The drafter interface's hooks for drafters that never score with the target's queries
    (only TriForce's retrieval stages do) and read no prompt with a model of their own (only a
    separate draft model does)."""
    wants_queries = False

    def observe_queries(self, queries: dict[int, torch.Tensor]) -> None:
        pass

    def read_prompt(self, ids: torch.Tensor, end: int) -> None:
        pass


class PromptLookupDrafter(QueryBlind):
    """Model-free drafting: find the earlier occurrences of the text's last n tokens (longest n
    first) and propose what followed them, token by token the way most of them went on. Pays off
    when the answer quotes the document or the conversation. (Voting rather than copying the
    latest occurrence: a summary reuses the phrasing the document uses most, not the nearest.)"""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def _match(self, ids: torch.Tensor) -> tuple[int, list[int]]:
        """(n, where the earlier occurrences of the last n tokens start, latest first) for the
        longest n that occurs; (0, []) when none does."""
        length = ids.shape[0]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if length <= n:
                continue
            # Windows start at 0..L-1-n, so the final n-gram never matches itself and every
            # match has at least one token after it.
            windows = ids[:-1].unfold(0, n, 1)  # [L - n, n]
            starts = (windows == ids[-n:]).all(-1).nonzero()[:, 0]
            if starts.numel():
                return n, starts.flip(0).tolist()
        return 0, []

    def draft(self, state, seq: torch.Tensor, max_tokens: int) -> Proposal | None:
        """The `Drafter` interface (speculative/hierarchy.py): lookup needs nothing but the text."""
        return self.propose(seq, max_tokens)

    def counts(self) -> dict[str, dict[str, int]]:
        return {}

    def propose(self, ids: torch.Tensor, max_tokens: int) -> Proposal | None:
        """ids [L]: prompt plus generated tokens so far. None when nothing matches. The
        proposal's kind is the matched n: longer matches are accepted more often."""
        n, starts = self._match(ids)
        if not starts:
            return None
        voted = vote([ids[s + n:s + n + max_tokens].tolist() for s in starts[:VOTERS]])
        tokens = torch.tensor(voted, dtype=ids.dtype)
        return Proposal(tokens, None, n)


def vote(continuations: list[list[int]]) -> list[int]:
    """Token by token, the token most of the continuations that agree so far go on with (a tie
    goes to the earliest listed); ends where none of them goes on."""
    chosen, alive = [], continuations
    for depth in range(max(map(len, continuations), default=0)):
        alive = [c for c in alive if len(c) > depth]
        if not alive:
            break
        counts = Counter(c[depth] for c in alive)
        top = max(counts.values())
        token = next(c[depth] for c in alive if counts[c[depth]] == top)
        chosen.append(token)
        alive = [c for c in alive if c[depth] == token]
    return chosen
