"""Token trees: the shape that one target forward verifies (Sequoia, algorithms.md section 2).

Node 0 is the root: the last committed token, whose target distribution decides the first level.
Every other node is a draft token. Nodes are in breadth-first order (depth, then parent, then
rank), so drafting level by level appends nodes and a parent always precedes its children.
A tree's attention mask and position ids are derived once and reused every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]  # parents[0] == -1 (root); parents[i] < i

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        if any(not 0 <= parent < node for node, parent in enumerate(self.parents) if node):
            raise ValueError("every node's parent must come before it")

    @classmethod
    def chain(cls, length: int) -> "Tree":
        """A root and `length` draft tokens in a line."""
        return cls(tuple(range(-1, length)))

    @property
    def size(self) -> int:
        """Number of nodes, the root included (= tokens in the verification forward)."""
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths = [0] * self.size
        for node in range(1, self.size):
            depths[node] = depths[self.parents[node]] + 1
        return tuple(depths)

    @property
    def depth(self) -> int:
        """Draft levels below the root (= draft steps needed to grow the tree)."""
        return max(self.depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Each node's children in rank order (the order they were drawn and are verified)."""
        children: list[list[int]] = [[] for _ in range(self.size)]
        for node in range(1, self.size):
            children[self.parents[node]].append(node)
        return tuple(tuple(c) for c in children)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Each node's 0-based rank among its siblings (root: 0)."""
        ranks = [0] * self.size
        for siblings in self.children:
            for rank, node in enumerate(siblings):
                ranks[node] = rank
        return tuple(ranks)

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[size, size] bool: ancestors[i, j] iff j is i or an ancestor of i."""
        table = torch.eye(self.size, dtype=torch.bool)
        for node in range(1, self.size):
            table[node] |= table[self.parents[node]]
        return table

    def positions(self, start: int) -> torch.Tensor:
        """Position ids [size]: the root sits at `start`, each node one past its parent."""
        return start + torch.tensor(self.depths)

    def attention_mask(self, past: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Additive 4-D mask [1, 1, size, past + size]: every node sees the `past` cached
        positions, itself and its ancestors; 0 where allowed, the dtype's minimum elsewhere.
        (A float mask on purpose: eager attention adds a boolean mask as 0/1 instead of
        applying it.)"""
        allowed = torch.cat([torch.ones(self.size, past, dtype=torch.bool), self.ancestors], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def score(self, acceptance: list[float] | torch.Tensor) -> float:
        """Expected tokens per verification F(T) = sum over nodes of the product of p_rank
        along the path (root = 1), for a positional acceptance vector p (p[0] = first child)."""
        f = [1.0] * self.size
        for node in range(1, self.size):
            rank = self.ranks[node]
            f[node] = f[self.parents[node]] * (float(acceptance[rank]) if rank < len(acceptance) else 0.0)
        return sum(f)
