"""KV reuse across turns: the full caches of recent answers, matched to a new prompt by the
longest common prefix of token ids, under a memory budget with least-recently-used eviction.

Matching on token ids alone makes it work for any caller: the terminal chat and the UI, and a
stateless API that resends the whole conversation. A follow-up's prompt repeats the conversation
so far, so only its new tokens need a prefill.

A conversation (an `owner` named by the request) keeps one entry: its next answer takes that
entry back, trimmed to what the new prompt shares with it, and never copies it, whether the prompt
continues it (a follow-up) or leaves it after the document (Retry, an edited question, the oldest
turn left out): the branch it leaves is dead. Only another conversation, or a request naming
none (the API), copies what it shares, so that the entry's own conversation keeps it.

On a GPU the plan budgets one KV, the answer's own. The cache of the conversation answered last
stays where it is (its follow-up continues it in place); before another cache is needed there,
the store sets every entry it is not handing out aside in host memory, and copies one back when
its conversation is taken up again (a copy over PCIe, against a prefill of the whole document).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .full import FullCache


@dataclass
class _Entry:
    ids: list[int]  # the tokens whose keys and values `cache` holds, in order
    cache: FullCache
    nbytes: int
    home: list[torch.device] | None = None  # while set aside on the host: each layer's device before
    owner: str = ""  # the conversation whose KV this is ("": none named)


def belongs(owner: str, conversation: str) -> bool:
    """Whether an entry kept for `owner` is `conversation`'s: its own, or one of its parts'
    (`conversation:parts`, a document read in parts)."""
    return bool(conversation) and (owner == conversation or owner.startswith(conversation + ":"))


def common_prefix_length(a: list[int], b: list[int]) -> int:
    length = min(len(a), len(b))
    for index in range(length):
        if a[index] != b[index]:
            return index
    return length


class PrefixStore:
    def __init__(self, budget_bytes: int, host: torch.device | str = "cpu", aside: tuple[str, ...] = ("cuda",)):
        self.budget_bytes = budget_bytes  # of the entries, wherever they are
        self.host = torch.device(host)  # where entries are set aside
        # The device types whose memory holds one KV (a GPU's); not Apple's MPS, which shares the RAM.
        self.aside = aside
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
        length = min(common_prefix_length(entry.ids, prompt_ids), len(prompt_ids) - 1)
        # A cache that a copy would not reproduce (a sliding window's) is only continued whole.
        return length if length == len(entry.ids) or entry.cache.movable else 0

    def take(self, prompt_ids: list[int], owner: str = "") -> tuple[FullCache, int] | None:
        """The stored cache sharing the longest prefix with `prompt_ids`, trimmed to that prefix,
        on the devices it was computed on, and the prefix length; None when nothing shares a
        token. Every other entry is set aside on the host first.

        At most `len(prompt_ids) - 1` positions are reused: the last prompt token must run to
        give the first answer token's logits. An entry reused whole, or one of `owner`'s (the
        conversation asking: what it does not share is a branch the conversation left), leaves
        the store trimmed; one reused in part by another conversation is copied, so that the
        conversation it belongs to keeps its own (set aside first: the copy is then the only KV
        on the device). Between entries sharing as much, `owner`'s own is taken.
        """
        best, best_length = None, 0
        for entry in self._entries:
            length = self._reusable(entry, prompt_ids)
            if length > best_length or (length == best_length > 0 and owner and entry.owner == owner):
                best, best_length = entry, length
        for entry in self._entries:
            if entry is not best:
                self._set_aside(entry)
        if best is None:
            return None
        copy_bytes = best.nbytes * best_length // len(best.ids)
        own = bool(owner) and best.owner == owner
        if own or best_length == len(best.ids) or self.nbytes + copy_bytes > self.budget_bytes:
            self._entries.remove(best)
            best.cache.trim(best_length)
            return self._at_home(best), best_length
        # Copying a prefix does not count as using the conversation: recency follows the
        # conversations people continue.
        self._set_aside(best)
        return best.cache.copy_to(best.home or best.cache.devices, best_length), best_length

    def spare(self) -> None:
        """No cache to lend for another prompt (each entry is a conversation's, and new ones are
        cheap); the one about to be made will be the only one on the device."""
        for entry in self._entries:
            self._set_aside(entry)
        return None

    def _set_aside(self, entry: _Entry) -> None:
        """`entry`'s cache copied to the host, a layer at a time, where it is elsewhere (and a
        copy would be exact: else it stays, as every cache did before)."""
        if not entry.cache.movable:
            return
        devices = entry.cache.devices
        if not any(device.type in self.aside for device in devices):
            return
        entry.cache = entry.cache.copy_to([self.host] * len(devices))
        entry.home = devices

    @staticmethod
    def _at_home(entry: _Entry) -> FullCache:
        """`entry`'s cache on the devices it was computed on."""
        return entry.cache if entry.home is None else entry.cache.copy_to(entry.home)

    def put(self, ids: list[int], cache: FullCache, owner: str = "") -> None:
        """Keep `cache` (holding `ids`) as the most recent entry, `owner`'s one (any it had goes);
        evict the least recently used entries until the store fits its budget. A cache larger than
        the whole budget is dropped."""
        if len(ids) != cache.length:
            raise ValueError(f"{len(ids)} token ids for a cache of {cache.length} positions")
        if not ids:  # an answer stopped inside its first prompt chunk: nothing to reuse
            return
        entry = _Entry(list(ids), cache, cache.nbytes, owner=owner)
        # An entry whose ids start another's is superseded by it: the longer one serves both. A
        # conversation's earlier entry is a branch it has left (its answer started from elsewhere).
        self._entries = [old for old in self._entries if common_prefix_length(old.ids, entry.ids) < len(old.ids)
                         and not (owner and old.owner == owner)]
        if entry.nbytes > self.budget_bytes:
            return
        self._entries.append(entry)
        while self.nbytes > self.budget_bytes:
            self._entries.pop(0)

    def drop(self, conversation: str) -> None:
        """Free `conversation`'s entries (`belongs`): it was deleted."""
        self._entries = [entry for entry in self._entries if not belongs(entry.owner, conversation)]

    def clear(self) -> None:
        self._entries.clear()
