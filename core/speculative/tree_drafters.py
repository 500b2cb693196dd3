"""Tree drafters: grow a token tree for one target forward to verify (Sequoia).

A `TreeProposal` holds the tree, its tokens (node 0 = the root = the last committed token) and,
per node, the draft distribution Q its children were drawn from without replacement; `q=None`
means the children were chosen deterministically (suffix-tree branches, greedy top-k), which
verification treats as point-mass proposals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.retrieval import RetrievalCache
from ..model import CausalLM
from ..sampling import apply_penalties, sample_without_replacement, warp
from .drafters import QueryBlind
from .tree import Tree


@dataclass(frozen=True)
class TreeProposal:
    tree: Tree
    tokens: torch.Tensor  # [n] token per node; tokens[0] is the root
    q: torch.Tensor | None  # [n, vocab] draft distribution at each node, or None (deterministic)


class ModelTreeDrafter(QueryBlind):
    """A draft model grows the tree level by level following a template shape (the Sequoia
    DP tree): each node's children are drawn without replacement from the draft's warped
    distribution (Gumbel top-k), in the order verification tests them; at temperature 0 they
    are the top-k tokens, chosen deterministically. Repetition penalties apply to each node with
    its own path, as the target's will (better acceptance; exactness does not depend on it). A
    node whose distribution has fewer tokens than the template asks for gets fewer children, so
    the tree never holds a token the draft gave no probability.

    The draft keeps its own KV cache of the committed text; it catches up on tokens it has not
    seen at the start of each proposal, and keeps the accepted path's entries afterwards.
    """

    def __init__(self, model: CausalLM, template: Tree):
        self.model = model
        self.template = template
        self.cache = model.new_cache()
        self._cached_ids: list[int] = []  # the committed tokens whose KV the draft cache holds
        self._slots: dict[int, int] = {}  # tree node -> draft cache position, this proposal
        self._tokens: list[int] = []  # this proposal's token per node
        self.forwards = 0  # draft forwards (one per tree level), for the stats

    def propose_tree(self, state, budget: int) -> TreeProposal | None:
        ids, params = state.ids, state.params
        max_depth = min(self.template.depth, budget - 1)
        if max_depth < 1:
            return None
        self._catch_up(ids)
        parents, tokens, template_of = [-1], [int(ids[-1])], [0]
        q_rows: dict[int, torch.Tensor] = {}
        self._slots = {}
        level = [0]
        for _ in range(max_depth):
            expanding = [node for node in level if self.template.children[template_of[node]]]
            if not expanding:
                break
            tree = Tree(tuple(parents))
            logits = self._forward_level(expanding, tree, tokens)  # [len(expanding), vocab]
            counts = state.tree_counts(torch.tensor(tokens), tree.ancestors[expanding]) if params.penalized else None
            next_level = []
            for index, (node, row) in enumerate(zip(expanding, logits)):
                wanted = len(self.template.children[template_of[node]])
                row_counts = None if counts is None else counts[index]
                if params.greedy:
                    scores = row if row_counts is None else apply_penalties(row.float(), row_counts, params)
                    children = scores.topk(wanted).indices
                else:
                    q_rows[node] = warp(row, params, row_counts)
                    children = sample_without_replacement(q_rows[node], wanted, state.generator)
                for rank, token in enumerate(children.tolist()):
                    parents.append(node)
                    tokens.append(token)
                    template_of.append(self.template.children[template_of[node]][rank])
                    next_level.append(len(parents) - 1)
            level = next_level
        # The template itself when the draft filled it (the usual case), so its ancestor table,
        # depths and children are derived once and reused every step.
        tree = self.template if tuple(parents) == self.template.parents else Tree(tuple(parents))
        self._tokens = tokens
        q = None
        if not params.greedy:
            q = torch.zeros(tree.size, self.model.vocab_size, device=self.model.device)
            for node, row in q_rows.items():
                q[node] = row
        return TreeProposal(tree, torch.tensor(tokens), q)

    def prepare(self, state) -> None:
        """The draft catches up on the committed text in `propose_tree` itself."""

    def counts(self) -> dict[str, dict[str, int]]:
        return {"draft": {"forwards": self.forwards}}

    def accept(self, path: list[int]) -> None:
        """Keep the draft cache's entries for the root and the accepted nodes it computed
        (those form a prefix of the path: leaves are never run); the rest is caught up later."""
        kept = []
        for node in [0] + path:
            if node not in self._slots:
                break
            kept.append(node)
        prefix = len(self._cached_ids)
        self.cache.keep(torch.tensor(list(range(prefix)) + [self._slots[node] for node in kept]))
        self._cached_ids += [self._tokens[node] for node in kept]

    def _catch_up(self, ids: torch.Tensor) -> None:
        """Bring the draft cache to all committed tokens but the last (the tree's root)."""
        target = ids[:-1].tolist()
        common = 0
        for cached, wanted in zip(self._cached_ids, target):
            if cached != wanted:
                break
            common += 1
        if common < self.cache.length:  # the committed text changed under the draft
            self.cache.trim(common)
        missing = ids[common:len(target)]
        if missing.numel():
            self.model.forward(missing, torch.arange(common, len(target)), self.cache, last_only=True)
        self._cached_ids = target

    def _committed_slots(self, committed: int) -> int:
        """Cache slots holding the `committed` tokens' KV (all of them, in a full cache)."""
        return committed

    def _forward_level(self, nodes: list[int], tree: Tree, tokens: list[int]) -> torch.Tensor:
        """Draft logits for `nodes` (one tree level of `tree`, grown so far), each attending to
        the committed prefix and its ancestors among the tree nodes already in the draft cache."""
        self.forwards += 1
        prefix = len(self._cached_ids)
        cached_nodes = sorted(self._slots, key=self._slots.get)
        columns = torch.tensor(cached_nodes + nodes, dtype=torch.long)
        allowed = torch.cat([torch.ones(len(nodes), self._committed_slots(prefix), dtype=torch.bool),
                             tree.ancestors[nodes][:, columns]], dim=1)
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        positions = prefix + torch.tensor([tree.depths[node] for node in nodes])
        logits = self.model.forward(torch.tensor([tokens[node] for node in nodes]), positions,
                                    self.cache, mask=mask[None, None])
        for offset, node in enumerate(nodes):
            self._slots[node] = prefix + len(cached_nodes) + offset
        return logits


class RetrievalTreeDrafter(ModelTreeDrafter):
    """TriForce with a Sequoia tree as the final verification: the target over a retrieval cache
    of its full cache grows the tree. The retrieval cache is rebuilt before every proposal from
    the queries of the last verification (`observe_queries`), the first time with the last
    prompt token's from the prefill (without them the first step is a plain one)."""

    def __init__(self, model: CausalLM, template: Tree, budget: int, chunk_size: int, recent: int):
        super().__init__(model, template)
        self.cache = None
        self.budget, self.chunk_size, self.recent = budget, chunk_size, recent
        self.builds = 0
        self._queries: dict[int, torch.Tensor] | None = None

    wants_queries = True

    def observe_queries(self, queries: dict[int, torch.Tensor]) -> None:
        self._queries = queries

    def prepare(self, state) -> None:
        if self._queries is None:
            return
        full = state.cache
        self.cache = RetrievalCache.from_full(full, self._queries, self.budget, self.chunk_size, self.recent,
                                              self.model.device, self.cache)
        self._cached_ids, self._slots = state.ids[:full.length].tolist(), {}
        self.builds += 1

    def propose_tree(self, state, budget: int) -> TreeProposal | None:
        return None if self.cache is None else super().propose_tree(state, budget)

    def accept(self, path: list[int]) -> None:
        if self.cache is not None:
            super().accept(path)

    def counts(self) -> dict[str, dict[str, int]]:
        return {"retrieval": {"forwards": self.forwards, "builds": self.builds}}

    def _committed_slots(self, committed: int) -> int:
        return self.cache.base_slots + committed - self.cache.base_length
