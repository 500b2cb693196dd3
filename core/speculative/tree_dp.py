"""Sequoia tree construction by dynamic programming (algorithms.md section 3; seed 000, section 3.1
and appendix C.2).

Vocabulary: the positional acceptance vector p_1..p_k (p_b = probability that the verifier accepts
the b-th child of an accepted node; a node has at most k children).
The score of a node is the product of p_rank along its path (root = 1) and
F(T) = sum of the scores = expected tokens per verification.

- Unbounded depth: c(n) = best F over trees of n nodes, through c_b(n) = best F with exactly b
  root children: c_0(1) = 1, c_b(n) = max_x c_{b-1}(x) + p_b c(n - x), c(n) = max_b c_b(n).
- Depth-bounded (Algorithm 5): T(m, l, b) = best F with m nodes, depth <= l, b root children:
  T(1, l, 0) = 1, T(m, l, b) = max_y T(y, l, b-1) + p_b max_j T(m-y, l-1, j); infeasible = -inf.
  Here l counts draft levels below the root (the paper counts the root as level 1), and the max
  over y is a max-plus convolution done for all m at once.

Both keep the value tables; the arg-max choices (how many root children, how big each subtree)
are recovered along the best tree's path only, rebuilding it top-down in breadth-first order.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from hashlib import sha256
from pathlib import Path

import torch

from ..embedded import cache_root
from ..files import write_atomically
from .tree import Tree

CACHE_VERSION = 1  # bump when the DP or the file format changes: old cache files stop matching
NEG_INF = float("-inf")
# torch's intra-op grain size: an op on fewer elements runs in the calling thread. The DP keeps
# every op below it because on a busy CPU each op handed to a second thread waits for a scheduler
# slice: a loaded 2-core box ran 512 nodes / depth 16 in 1.7 s with 2 threads vs 0.12 s with 1.
SERIAL_ELEMENTS = 32768


def best_tree(acceptance: list[float] | torch.Tensor, size: int,
              max_depth: int | None = None) -> Tree:
    """The tree T of exactly `size` nodes (root included), at most k = len(acceptance) children
    per node and depth <= max_depth (None: unbounded), maximizing F(T). Breadth-first, children
    in rank order, so `best_tree(p, n, d).score(p) == best_scores(p, n, d)[n]`."""
    p = _as_vector(acceptance)
    best, by_branches, top, descend = _tables(p, size, max_depth)
    if best[top, size] == NEG_INF:
        raise ValueError(f"no tree of {size} nodes has depth <= {max_depth} with at most "
                         f"{p.shape[0]} children per node")
    return _rebuild(p[: size - 1], best, by_branches, size, top, descend)


def best_scores(acceptance: list[float] | torch.Tensor, size: int,
                max_depth: int | None = None) -> torch.Tensor:
    """[size + 1] float64: entry m = best F(T) over trees of exactly m nodes and depth <= max_depth
    (the planner's G(m, d)). Entry 0 (no tree is empty) and infeasible sizes are -inf."""
    best, _, top, _ = _tables(_as_vector(acceptance), size, max_depth)
    return best[top]


def cached_best_tree(acceptance: list[float] | torch.Tensor, size: int, max_depth: int | None,
                     cache_dir: Path | None = None) -> Tree:
    """best_tree for the acceptance vector rounded to 6 decimals, kept as JSON in `cache_dir`
    (default: cache_root() / "trees"). The tree is computed from the rounded vector, so a cache
    file depends on its key alone. An unreadable or mismatching file is recomputed and rewritten."""
    cache_dir = cache_root() / "trees" if cache_dir is None else cache_dir
    rounded = [round(float(p), 6) for p in _as_vector(acceptance)]
    key = [CACHE_VERSION, rounded, size, max_depth]
    path = cache_dir / f"{sha256(json.dumps(key).encode()).hexdigest()[:32]}.json"
    tree = _read_cached(path, key)
    if tree is None:
        tree = best_tree(rounded, size, max_depth)
        write_atomically(path, json.dumps({"key": key, "parents": list(tree.parents)}))
    return tree


def chain_trees(acceptance: list[float] | torch.Tensor, size: int, chains: int) -> Tree:
    """`chains` independent chains under the root (root children of ranks 1..chains, then rank-1
    children only), `size` nodes in all, lengths as even as possible. The longer chains go to the
    ranks with the higher acceptance (ties: lower rank), which scores best among even splits."""
    p = _as_vector(acceptance)
    if not 1 <= chains <= min(size - 1, p.shape[0]):
        raise ValueError(f"{chains} chains need 1 <= chains <= min(size - 1, len(acceptance))")
    base, extra = divmod(size - 1, chains)
    by_acceptance = sorted(range(chains), key=lambda rank: -float(p[rank]))  # stable: ties by rank
    lengths = [base] * chains
    for rank in by_acceptance[:extra]:
        lengths[rank] += 1

    def children(length: int | None) -> list[int]:
        if length is None:  # the root
            return lengths
        return [length - 1] if length > 1 else []

    return _breadth_first(None, children)


def _as_vector(acceptance: list[float] | torch.Tensor) -> torch.Tensor:
    """p_1..p_k as a float64 tensor [k], checked: non-empty, finite, non-negative."""
    p = torch.as_tensor(acceptance, dtype=torch.float64).flatten()
    if p.numel() == 0 or not torch.isfinite(p).all() or (p < 0).any():
        raise ValueError("acceptance must be a non-empty vector of finite probabilities >= 0")
    return p


def _tables(p: torch.Tensor, size: int,
            max_depth: int | None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """DP value tables for up to `size` nodes: (best [levels, size + 1],
    by_branches [levels, k + 1, size + 1], top level, levels a child goes down).

    best[l, m] = best F with m nodes within level budget l; by_branches[l, b, m] = the same with
    exactly b root children. Unbounded: a single level that children keep (step 0)."""
    if size < 1:
        raise ValueError("a tree has at least one node (the root)")
    if max_depth is not None and max_depth < 0:
        raise ValueError("max_depth must be >= 0 or None")
    p = p[: size - 1]  # no node of an n-node tree has more than n - 1 children
    if max_depth is None:
        best, by_branches = _unbounded(p, size)
        return best[None], by_branches[None], 0, 0
    depth = min(max_depth, size - 1)  # a deeper bound cannot bind
    best, by_branches = _bounded(p, size, depth)
    return best, by_branches, depth, 1


def _unbounded(p: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """c(n) [size + 1] and c_b(n) [k + 1, size + 1] for n = 0..size, b = 0..k."""
    k = p.shape[0]
    c = torch.full((size + 1,), NEG_INF, dtype=torch.float64)
    c[1] = 1.0
    by_branches = torch.full((k + 1, size + 1), NEG_INF, dtype=torch.float64)
    by_branches[0, 1] = 1.0
    for n in range(2, size + 1):
        # All b at once: x = 1..n-1 nodes for the root and its first b-1 subtrees, n-x for the last.
        rest = by_branches[:k, 1:n]  # [k, n-1]: c_{b-1}(x)
        last = c[1:n].flip(0)  # [n-1]: c(n - x), all finite

        def sums(rows: slice) -> torch.Tensor:  # [rows of b, n-1]: c_{b-1}(x) + p_b c(n - x)
            return rest[rows] + p[rows, None] * last

        by_branches[1:, n] = _blockwise_max(sums, k, n - 1)
        c[n] = by_branches[:, n].max()
    return c, by_branches


def _bounded(p: torch.Tensor, size: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """max_b T(m, l, b) [depth + 1, size + 1] and T(m, l, b) [depth + 1, k + 1, size + 1] for
    l = 0..depth draft levels, b = 0..k root children, m = 0..size nodes."""
    k = p.shape[0]
    by_branches = torch.full((depth + 1, k + 1, size + 1), NEG_INF, dtype=torch.float64)
    by_branches[:, 0, 1] = 1.0  # T(1, l, 0): the root alone
    best = by_branches[:, 0].clone()
    # With p non-increasing, swapping subtrees shows some best tree has child sizes a_1 >= .. >= a_b
    # (best F grows with size), so the rank-b subtree has at most (m - 1) / b nodes: the
    # convolution for rank b needs that many columns (total work ~ size^2 ln k, not size^2 k).
    sorted_p = bool((p[:-1] >= p[1:]).all())
    for level in range(1, depth + 1):
        below = best[level - 1]  # max_j T(., l-1, j)
        reachable = int(torch.isfinite(below).sum())  # sizes 1..reachable fit in depth l-1
        for b in range(1, k + 1):
            width = min(reachable, (size - 1) // b if sorted_p else size - 1)
            last = _weighted(p[b - 1], below)  # [size + 1]: p_b max_j T(., l-1, j)
            by_branches[level, b] = _max_plus(by_branches[level, b - 1], last, width)
            best[level] = torch.maximum(best[level], by_branches[level, b])
        if torch.equal(best[level], below):
            # The bound binds for no size any more, so every deeper level repeats this one exactly.
            by_branches[level + 1 :] = by_branches[level]
            best[level + 1 :] = best[level]
            break
    return best, by_branches


def _weighted(p_b: torch.Tensor, below: torch.Tensor) -> torch.Tensor:
    """p_b * below, keeping infeasible (-inf) entries at -inf: 0 * -inf would be nan."""
    return torch.where(torch.isfinite(below), p_b * below, NEG_INF)


def _max_plus(rest: torch.Tensor, last: torch.Tensor, width: int) -> torch.Tensor:
    """out[m] = max_{1 <= s <= width} rest[m - s] + last[s] for every m; rest, last [n] -> [n].

    Indices below 0 count as -inf. Only values: torch's max-with-indices is several times slower
    than amax, so the arg-max is recovered on the best tree's path alone (see _rebuild)."""
    padded = torch.cat([torch.full((width,), NEG_INF, dtype=rest.dtype), rest])  # [width + n]
    # A view [n, width]: windows[m, t] = padded[m + t] = rest[m - (width - t)].
    windows = padded[:-1].unfold(0, width, 1)
    kids = last[1 : width + 1].flip(0)  # [width]: column t holds s = width - t
    return _blockwise_max(lambda rows: windows[rows] + kids, rest.shape[0], width)


def _blockwise_max(block: Callable[[slice], torch.Tensor], rows: int, width: int) -> torch.Tensor:
    """[rows]: the row maxima of the [rows, width] matrix that block(row slice) yields, built
    in row blocks of fewer than SERIAL_ELEMENTS elements (see there why)."""
    step = max(1, (SERIAL_ELEMENTS - 1) // width)
    return torch.cat([block(slice(start, min(start + step, rows))).amax(dim=1)
                      for start in range(0, rows, step)])


def _rebuild(p: torch.Tensor, best: torch.Tensor, by_branches: torch.Tensor, size: int, top: int,
             descend: int) -> Tree:
    """Rebuild the best tree top-down from the value tables: at each node, the arg-max b over
    by_branches, then peel off the rank-b, b-1, .. subtrees by the arg-max of the recurrence
    (the same sums the DP maximized, so the tree's F equals the DP value)."""

    def children(state: tuple[int, int]) -> list[tuple[int, int]]:
        m, level = state
        sizes = []
        for b in range(int(by_branches[level, :, m].argmax()), 0, -1):
            rest = by_branches[level, b - 1, 1:m].flip(0)  # [m-1]: T(m - s, l, b-1) for s = 1..m-1
            last = _weighted(p[b - 1], best[level - descend, 1:m])  # [m-1]: p_b max_j T(s, l-1, j)
            sizes.append(int((rest + last).argmax()) + 1)
            m -= sizes[-1]
        return [(s, level - descend) for s in reversed(sizes)]

    return _breadth_first((size, top), children)


def _breadth_first(root: object, children: Callable[[object], list]) -> Tree:
    """The Tree grown from `root` by `children(state) -> child states in rank order`, numbered
    breadth-first (a FIFO queue gives depth, then parent, then rank order)."""
    parents: list[int] = []
    queue = deque([(-1, root)])
    while queue:
        parent, state = queue.popleft()
        node = len(parents)
        parents.append(parent)
        queue.extend((node, kid) for kid in children(state))
    return Tree(tuple(parents))


def _read_cached(path: Path, key: list) -> Tree | None:
    """The cached tree for `key`, or None if the file is missing, corrupt or for another key."""
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return None
        tree = Tree(tuple(int(parent) for parent in data["parents"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    size, max_depth = key[2], key[3]
    if tree.size != size or (max_depth is not None and tree.depth > max_depth):
        return None
    return tree

