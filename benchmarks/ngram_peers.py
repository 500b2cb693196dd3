"""Other projects' model-free n-gram drafters, rewritten from their published rules so the
yardstick (benchmarks/yardstick.py) can set specchat's lookup beside them. Each proposes a chain
continuing `ids` (the committed text; its last token is the one the next forward reads).

- Hugging Face transformers' prompt lookup (PromptLookupCandidateGenerator, transformers 5):
  n-gram sizes from `max_ngram` down to 1; the first (leftmost) earlier occurrence of the text's
  last n tokens that has a token after it wins; propose up to `num_output_tokens` of what
  followed, never past the text's end, cut before the first end-of-sequence token.
- llama.cpp `ngram-simple` (common/ngram-map.cpp): the latest earlier occurrence of the last
  `size_n` tokens; copy up to `size_m` of what followed, and nothing when fewer than `size_n`
  follow or the text is at most size_n + size_m + 1 tokens long.
- llama.cpp `ngram-mod` (common/ngram-mod.cpp, common/speculative.cpp): a table from each
  `n_match`-gram to the token that followed it (the latest occurrence wins), filled with the
  prompt first and then with the answer in chunks of more than 32 new tokens; the draft walks the
  table token by token from the text's last n_match tokens, up to `n_max`, and is dropped when
  the walk stops before `n_min`. Differences: an exact table instead of llama.cpp's hashed 4M
  slots (no collisions), and neither of its resets (table occupancy over 25%, three drafts in a
  row under half accepted), which only clear entries the next chunk adds back.
"""

from __future__ import annotations

import torch


def _occurrences(ids: torch.Tensor, n: int) -> torch.Tensor:
    """Start positions of every window of `ids` equal to its last n tokens (the final one included)."""
    return (ids.unfold(0, n, 1) == ids[-n:]).all(-1).nonzero()[:, 0]


def hf_prompt_lookup(ids: torch.Tensor, num_output_tokens: int, max_ngram: int = 2,
                     eos_ids: frozenset[int] = frozenset()) -> list[int]:
    """transformers' prompt lookup: the first match of the longest n-gram that has a continuation."""
    length = ids.shape[0]
    for n in range(min(max_ngram, length - 1), 0, -1):
        starts = _occurrences(ids, n)
        starts = starts[starts + n < length]  # the text's own last n-gram has nothing after it
        if starts.numel():
            start = int(starts[0]) + n
            proposed = ids[start:start + num_output_tokens].tolist()
            return next((proposed[:i] for i, token in enumerate(proposed) if token in eos_ids), proposed)
    return []


def llama_ngram_simple(ids: torch.Tensor, size_n: int = 12, size_m: int = 48) -> list[int]:
    """llama.cpp's ngram-simple: what followed the latest earlier occurrence of the last size_n tokens."""
    history = ids.shape[0] - 1  # llama.cpp's `tokens`: the committed text but its last (sampled) token
    if history <= size_n + size_m + 1:
        return []
    starts = _occurrences(ids, size_n)
    starts = starts[(starts >= 1) & (starts <= history - size_n - 1)]  # position 0 means "no match" there
    if not starts.numel():
        return []
    follow = int(starts[-1]) + size_n
    copied = min(size_m, history - follow)
    return ids[follow:follow + copied].tolist() if copied >= size_n else []


class LlamaNgramMod:
    """llama.cpp's ngram-mod for one answer: `draft` is called with the committed text each step,
    and the first call's text (but its last token) stands for the prompt llama.cpp indexes in
    `begin`."""

    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64):
        self.n_match, self.n_min, self.n_max = n_match, n_min, n_max
        self.next_token: dict[tuple[int, ...], int] = {}
        self.indexed_until: int | None = None  # llama.cpp's i_last: n-grams starting before it are in

    def _index(self, tokens: list[int], start: int) -> None:
        n = self.n_match
        for i in range(start, len(tokens) - n):
            self.next_token[tuple(tokens[i:i + n])] = tokens[i + n]
        self.indexed_until = max(start, len(tokens) - n)

    def draft(self, ids: torch.Tensor) -> list[int]:
        tokens = ids[:-1].tolist()  # llama.cpp's prompt_tgt; ids[-1] is its id_last
        n = self.n_match
        if self.indexed_until is None:
            self._index(tokens, 0)
        elif self.indexed_until + 32 < len(tokens):
            self._index(tokens, self.indexed_until)
        if len(tokens) < n:
            return []
        window, drafted = ids[-n:].tolist(), []
        for step in range(self.n_max):
            token = self.next_token.get(tuple(window))
            if token is None:
                return [] if step < self.n_min else drafted
            drafted.append(token)
            window = window[1:] + [token]
        return drafted
