"""KV reuse where caches are too large to copy or to keep two of (an offloaded KV: the plan's whole
context in host memory): one slot holds the cache of the conversation answered last.

A follow-up that resends that conversation takes the cache back trimmed to the common prefix, so
only its new tokens are read. Another conversation takes the same cache trimmed to what it shares
(often nothing): its memory is reused, never allocated beside the old one. Nothing is copied.
"""

from __future__ import annotations

from .cache import KVCache
from .prefix_store import belongs, common_prefix_length


class ConversationSlot:
    """The `PrefixStore` interface the engine uses, for one cache moved from answer to answer."""

    def __init__(self):
        self._ids: list[int] = []  # the tokens whose keys and values the held cache holds
        self._cache: KVCache | None = None
        self._owner = ""  # the conversation whose KV it holds ("": none named)

    @property
    def nbytes(self) -> int:
        return self._cache.nbytes if self._cache is not None else 0

    def __len__(self) -> int:
        return int(self._cache is not None)

    def best_length(self, prompt_ids: list[int]) -> int:
        """How many prompt positions `take` would reuse (the last prompt token always runs)."""
        if self._cache is None:
            return 0
        return min(common_prefix_length(self._ids, prompt_ids), len(prompt_ids) - 1)

    def take(self, prompt_ids: list[int], owner: str = "") -> tuple[KVCache, int] | None:
        """The held cache trimmed to what it shares with `prompt_ids` (maybe nothing), and that
        length; None when the slot is empty. The slot is empty afterwards. (`owner`: one cache is
        never copied, whoever asks.)"""
        if self._cache is None:
            return None
        length = self.best_length(prompt_ids)
        cache, self._cache, self._ids, self._owner = self._cache, None, [], ""
        cache.trim(length)
        return cache, length

    def spare(self) -> KVCache | None:
        """The held cache emptied, for another prompt to fill (a saved document read into it);
        None when the slot is empty. The slot is empty afterwards."""
        if self._cache is None:
            return None
        cache, self._cache, self._ids, self._owner = self._cache, None, [], ""
        cache.trim(0)
        return cache

    def put(self, ids: list[int], cache: KVCache, owner: str = "") -> None:
        if len(ids) != cache.length:
            raise ValueError(f"{len(ids)} token ids for a cache of {cache.length} positions")
        self._ids, self._cache, self._owner = list(ids), cache, owner

    def drop(self, conversation: str) -> None:
        """Empty the cache if it is `conversation`'s (`belongs`: it was deleted); the memory stays
        held for the next answer, which fills it again rather than allocating the whole context."""
        if belongs(self._owner, conversation) and self._cache is not None:
            self._cache.trim(0)
            self._ids, self._owner = [], ""

    def clear(self) -> None:
        self._ids, self._cache, self._owner = [], None, ""
