"""KV reuse across turns: the full caches of recent answers, matched to a new prompt by the
longest common prefix of token ids, under a memory budget with least-recently-used eviction.

Matching on token ids alone makes it work for any caller: the terminal chat and the UI, and a
stateless API that resends the whole conversation. A follow-up's prompt repeats the conversation
so far, so only its new tokens need a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

from .full import FullCache


@dataclass
class _Entry:
    ids: list[int]  # the tokens whose keys and values `cache` holds, in order
    cache: FullCache
    nbytes: int


def common_prefix_length(a: list[int], b: list[int]) -> int:
    length = min(len(a), len(b))
    for index in range(length):
        if a[index] != b[index]:
            return index
    return length


class PrefixStore:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: list[_Entry] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def best_length(self, prompt_ids: list[int]) -> int:
        """How many prompt positions `take` would reuse."""
        return max((self._reusable(entry, prompt_ids) for entry in self._entries), default=0)

    def _reusable(self, entry: _Entry, prompt_ids: list[int]) -> int:
        return min(common_prefix_length(entry.ids, prompt_ids), len(prompt_ids) - 1)

    def take(self, prompt_ids: list[int]) -> tuple[FullCache, int] | None:
        """The stored cache sharing the longest prefix with `prompt_ids`, trimmed to that prefix,
        and the prefix length; None when nothing shares a token.

        At most `len(prompt_ids) - 1` positions are reused: the last prompt token must run to
        give the first answer token's logits. An entry reused whole leaves the store (its owner
        carries on from it); one reused in part is copied, so the conversation it belongs to
        keeps its own.
        """
        best, best_length = None, 0
        for entry in self._entries:
            length = self._reusable(entry, prompt_ids)
            if length > best_length:
                best, best_length = entry, length
        if best is None:
            return None
        copy_bytes = best.nbytes * best_length // len(best.ids)
        if best_length == len(best.ids) or self.nbytes + copy_bytes > self.budget_bytes:
            self._entries.remove(best)
            best.cache.trim(best_length)
            return best.cache, best_length
        # Copying a prefix does not count as using the conversation: recency follows the
        # conversations people continue.
        return best.cache.clone_prefix(best_length), best_length

    def spare(self) -> None:
        """No cache to lend for another prompt: each entry is a conversation's, and new ones are cheap."""
        return None

    def put(self, ids: list[int], cache: FullCache) -> None:
        """Keep `cache` (holding `ids`) as the most recent entry; evict the least recently used
        entries until the store fits its budget. A cache larger than the whole budget is dropped."""
        if len(ids) != cache.length:
            raise ValueError(f"{len(ids)} token ids for a cache of {cache.length} positions")
        entry = _Entry(list(ids), cache, cache.nbytes)
        # An entry whose ids start another's is superseded by it: the longer one serves both.
        self._entries = [old for old in self._entries if common_prefix_length(old.ids, entry.ids) < len(old.ids)]
        if entry.nbytes > self.budget_bytes:
            return
        self._entries.append(entry)
        while self.nbytes > self.budget_bytes:
            self._entries.pop(0)

    def clear(self) -> None:
        self._entries.clear()
