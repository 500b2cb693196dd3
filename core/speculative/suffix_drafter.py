"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): the longest earlier match of the text's
last tokens, in the conversation or in this process's earlier answers, and the continuations
that followed it, counted, as a chain (the most frequent path) or a tree (best first by
empirical path probability). Model-free and deterministic: verification treats every draft
token as a point mass, so it is lossless whatever it proposes.
"""

from __future__ import annotations

import heapq
from collections import deque

import torch

from .drafters import Proposal, QueryBlind
from .suffix_index import LEVELS, MAX_MATCH, SEPARATOR, Match, SuffixIndex
from .tree import Tree
from .tree_drafters import TreeProposal


class AnswerHistory:
    """The latest answers' token ids (one model's: the integrator keeps one per model), indexed,
    in memory only. At most `max_answers` answers and `max_tokens` tokens: past either cap the
    oldest answers go until a quarter of the room is free, and the index is rebuilt once, so
    eviction costs O(max_tokens) per max_tokens / 4 tokens added."""

    def __init__(self, max_tokens: int = 65536, max_answers: int = 64):
        self.max_tokens = max_tokens
        self.max_answers = max_answers
        self._answers: deque[list[int]] = deque()
        self._held = 0  # tokens in _answers
        self.index = SuffixIndex()

    @property
    def tokens_held(self) -> int:
        return self._held

    def add(self, token_ids) -> None:
        """One finished answer (its generated token ids); an answer longer than the cap keeps
        its tail."""
        answer = [int(token) for token in token_ids][-self.max_tokens:]
        if not answer:
            return
        self._answers.append(answer)
        self._held += len(answer)
        if self._held <= self.max_tokens and len(self._answers) <= self.max_answers:
            self.index.extend(answer + [SEPARATOR])  # matches never run from one answer into the next
            return
        while self._held > 3 * self.max_tokens // 4 or len(self._answers) > 3 * self.max_answers // 4:
            self._held -= len(self._answers.popleft())
        self.index = SuffixIndex(token for kept in self._answers for token in kept + [SEPARATOR])

    def match(self, query: list[int]) -> Match:
        return self.index.match(query)

    def clear(self) -> None:
        self._answers.clear()
        self._held = 0
        self.index = SuffixIndex()


class SuffixDrafter(QueryBlind):
    """Both a `Drafter` (chain) and a `TreeDrafter`. It indexes the committed text incrementally:
    the prompt once per answer (or nothing new when a follow-up's prompt extends what it indexed),
    then each step's committed tokens. `history`, when given, is consulted too and wins when it
    holds a longer match than the conversation; not for a seeded sampled answer, whose random
    numbers a draft that changed with the history would spend differently: it must repeat.

    Tree size follows the evidence (SuffixDecoding's spec factor): at most
    `drafts_per_matched_token` drafts per matched token, up to `max_nodes`, and no node whose
    path probability is below `min_probability`. A long match has few occurrences that agree, so
    its tree is one deep path; a short one spreads its few nodes over the frequent branches."""

    def __init__(self, history: AnswerHistory | None = None, max_nodes: int = 32,
                 drafts_per_matched_token: int = 4, min_probability: float = 0.1):
        self.history = history
        self.max_nodes = max_nodes
        self.drafts_per_matched_token = drafts_per_matched_token
        self.min_probability = min_probability
        self.index = SuffixIndex()
        self._indexed: torch.Tensor | None = None  # the ids the index holds, as last seen
        self._state = None  # the DecodeState they came from

    def prepare(self, state) -> None:
        self._sync(state)

    def draft(self, state, seq: torch.Tensor, max_tokens: int) -> Proposal | None:
        """The most frequent continuation of `seq` (the committed text, then any tokens of stages
        above). Its kind: the matched length's power-of-two level, negative for a match in the
        history, so the cost model learns each kind's acceptance apart."""
        self._sync(state)
        match = self._best_match(seq, state)
        path = self._most_frequent_path(match, max_tokens) if match.length and max_tokens > 0 else []
        if not path:
            return None
        tokens = torch.tensor(path, dtype=seq.dtype)
        return Proposal(tokens, None, self._kind(match))

    def propose_tree(self, state, budget: int) -> TreeProposal | None:
        """A deterministic tree (q=None) rooted at the last committed token, at most `budget - 1`
        levels deep so a step never commits more than `budget` tokens."""
        self._sync(state)
        match = self._best_match(state.ids, state)
        if not match.length or budget < 2:
            return None
        drafts = min(self.max_nodes - 1, self.drafts_per_matched_token * match.length)
        parents, tokens = self._grow(match, drafts, budget - 1, int(state.ids[-1]))
        if len(parents) == 1:
            return None
        return TreeProposal(Tree(tuple(parents)), torch.tensor(tokens), None)

    def accept(self, path: list[int]) -> None:
        """The committed tokens are indexed at the next `prepare`: nothing to keep from the tree."""

    def counts(self) -> dict[str, dict[str, int]]:
        return {}

    def _sync(self, state) -> None:
        """Index what the committed text adds to the text indexed. Within one answer commits
        only append; a new state (answer) is compared once, and the index rebuilt when its text
        no longer extends the one indexed (another conversation)."""
        ids, done = state.ids, len(self.index)
        if ids is self._indexed:
            return
        if state is not self._state and not (ids.shape[0] >= done and self._indexed is not None
                                             and torch.equal(ids[:done], self._indexed[:done])):
            self.index = SuffixIndex(ids.tolist())
        else:
            self.index.extend(ids[done:].tolist())
        self._state, self._indexed = state, ids

    def _best_match(self, seq: torch.Tensor, state) -> Match:
        query = seq[-MAX_MATCH:].tolist()
        match = self.index.match(query)
        seeded = state.params.seed is not None and state.params.temperature > 0
        if self.history is not None and not seeded:
            earlier = self.history.match(query)
            if earlier.length > match.length:
                return earlier
        return match

    def _kind(self, match: Match) -> int:
        level = max(level for level in LEVELS if level <= match.length)
        return level if match.index is self.index else -level

    def _most_frequent_path(self, match: Match, max_tokens: int) -> list[int]:
        """Token by token, the continuation most occurrences that agree so far go on with (the
        latest on ties), while its probability stays at least `min_probability`."""
        path, ends, probability = [], match.ends, 1.0
        while len(path) < max_tokens:
            groups = match.index.followers(ends)
            if not groups:
                break
            token, following = max(groups.items(), key=lambda group: len(group[1]))
            probability *= len(following) / len(ends)
            if probability < self.min_probability:
                break
            path.append(token)
            ends = following
        return path

    def _grow(self, match: Match, drafts: int, max_depth: int, root: int) -> tuple[list[int], list[int]]:
        """Best first: the most probable node not yet in the tree joins it, up to `drafts`
        nodes; then breadth-first order (parents before children, siblings most probable
        first). Returns (parents, tokens)."""
        parents, tokens, depths = [-1], [root], [0]
        frontier: list[tuple[float, int, int, int, list[int]]] = []  # (-probability, order, parent, token, ends)
        order = 0

        def offer_children(node: int, ends: list[int], probability: float) -> None:
            nonlocal order
            if depths[node] >= max_depth:
                return
            for token, following in match.index.followers(ends).items():
                child = probability * len(following) / len(ends)
                if child >= self.min_probability:
                    heapq.heappush(frontier, (-child, order, node, token, following))
                    order += 1

        offer_children(0, match.ends, 1.0)
        while frontier and len(parents) <= drafts:
            negative, _, parent, token, following = heapq.heappop(frontier)
            parents.append(parent)
            tokens.append(token)
            depths.append(depths[parent] + 1)
            offer_children(len(parents) - 1, following, -negative)
        return _breadth_first(parents, tokens)


def _breadth_first(parents: list[int], tokens: list[int]) -> tuple[list[int], list[int]]:
    """The same tree renumbered level by level, each node's children in their original order."""
    children: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        children[parents[node]].append(node)
    order, new_index = [0], {0: 0}
    for node in order:  # grows while it is read: a breadth-first walk
        for child in children[node]:
            new_index[child] = len(order)
            order.append(child)
    return ([-1] + [new_index[parents[node]] for node in order[1:]]), [tokens[node] for node in order]
