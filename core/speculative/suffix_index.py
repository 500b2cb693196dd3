"""An incremental index of a token text for suffix drafting (SuffixDecoding, arXiv 2411.04975):
the longest earlier match of a query's last tokens, and the continuations under it with counts.

Hashes of the n-grams ending at each position, for n in powers of two, rather than a suffix
automaton or tree: a few dict appends per token are the cheapest Python append (128K tokens in a
fraction of a second), and the occurrence lists give continuation counts without a subtree walk.
The top level with a hit bounds the match within a factor of two; comparing the latest
occurrences backwards makes it exact (up to `MAX_MATCH`). Pure Python: no torch here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

LEVELS = (1, 2, 4, 8, 16, 32)  # n-gram lengths hashed at every position
MAX_MATCH = 64  # matches are measured up to this many tokens: longer ones continue just as reliably
MAX_OCCURRENCES = 32  # the latest occurrences whose continuations are counted: bounded work per lookup
SEPARATOR = -1  # never a token: ends a text inside an index (between answers), never matched or proposed

_MOD = (1 << 61) - 1  # a Mersenne prime: polynomial hashes with negligible collisions (still verified)
_BASE = 1_000_000_007
_POWERS = {level: pow(_BASE, level, _MOD) for level in LEVELS}


@dataclass(frozen=True)
class Match:
    """Earlier occurrences of a query's last `length` or more tokens (at least the top level's
    n-gram), latest first, each by the index of its last token in `index.tokens`."""
    length: int  # the longest of them, in tokens (capped at MAX_MATCH); 0 when nothing matched
    ends: list[int]
    index: "SuffixIndex"


class SuffixIndex:
    """Token ids and, per level n, n-gram hash -> the positions where that n-gram ends (ascending)."""

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list[int] = []
        self._prefix_hashes = [0]  # hash of tokens[:i] at i
        self._ends: list[defaultdict[int, list[int]]] = [defaultdict(list) for _ in LEVELS]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens: a prefix hash each, then per level one hash and one list append each
        (level by level, so the inner loops stay tight)."""
        text, hashes = self.tokens, self._prefix_hashes
        start = len(text)
        text.extend(tokens)
        running = hashes[-1]
        for token in text[start:]:
            running = (running * _BASE + token) % _MOD
            hashes.append(running)
        for level, table in zip(LEVELS, self._ends):
            first, power = max(start, level - 1), _POWERS[level]
            ends = range(first, len(text))
            keys = [(whole - head * power) % _MOD
                    for whole, head in zip(hashes[first + 1:], hashes[first + 1 - level:])]
            for end, key in zip(ends, keys):
                table[key].append(end)

    def match(self, query: Sequence[int]) -> Match:
        """The earlier occurrences of `query`'s longest suffix found here with a token after it
        (so the text's own last n-gram never matches itself): those of the top level's n-gram,
        the latest MAX_OCCURRENCES."""
        tail = list(query[-MAX_MATCH:])
        hashes = [0]
        for token in tail:
            hashes.append((hashes[-1] * _BASE + token) % _MOD)
        last = len(self.tokens) - 1
        for level, table in reversed(list(zip(LEVELS, self._ends))):
            if level > len(tail):
                continue
            bucket = table.get((hashes[-1] - hashes[-1 - level] * _POWERS[level]) % _MOD)
            if not bucket:
                continue
            pattern = tail[-level:]
            ends = []
            for end in reversed(bucket):
                if end < last and self.tokens[end + 1 - level:end + 1] == pattern:
                    ends.append(end)
                    if len(ends) == MAX_OCCURRENCES:
                        break
            if ends:
                return Match(max(self._matched_length(end, tail, level) for end in ends), ends, self)
        return Match(0, [], self)

    def _matched_length(self, end: int, tail: list[int], known: int) -> int:
        """How many of `tail`'s last tokens the text ending at `end` repeats (at least `known`)."""
        length, limit = known, min(len(tail), end + 1)
        while length < limit and self.tokens[end - length] == tail[-1 - length]:
            length += 1
        return length

    def followers(self, ends: list[int]) -> dict[int, list[int]]:
        """Next token -> the positions of that next token, for occurrences ending at `ends`;
        tokens in the order of their first occurrence in `ends` (latest first: recency breaks
        ties). Text ends and separators continue nowhere."""
        groups: dict[int, list[int]] = {}
        text, size = self.tokens, len(self.tokens)
        for end in ends:
            following = end + 1
            if following < size and text[following] != SEPARATOR:
                group = groups.get(text[following])
                if group is None:
                    groups[text[following]] = [following]
                else:
                    group.append(following)
        return groups
