"""Sequoia's tree DP finds the best tree: brute force over every small tree, validity of the trees,
bounded vs unbounded agreement, speed, the disk cache, and the chain baselines."""

import itertools
import json
import math
import time
from collections import deque
from functools import lru_cache

import pytest
import torch

from specchat.core.speculative import tree_dp
from specchat.core.speculative.tree import Tree
from specchat.core.speculative.tree_dp import best_scores, best_tree, cached_best_tree, chain_trees

MAX_NODES = 10
MAX_DEPTH = 4
TOL = 1e-9


def decreasing(seed: int, k: int) -> list[float]:
    """A random non-increasing acceptance vector that sums to at most 1, as measured ones do."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.rand(k, generator=generator, dtype=torch.float64).sort(descending=True).values
    return (values / values.sum() * 0.95).tolist()


VECTORS = {
    "k2": decreasing(0, 2),
    "k3": decreasing(1, 3),
    "k4": decreasing(2, 4),
    "k12": decreasing(3, 12),  # more ranks than any 10-node tree can use
    "non-monotone": [0.25, 0.6, 0.1],
    "zero rank": [0.5, 0.0, 0.4],  # p_b = 0 must not turn -inf into nan
}


@lru_cache(maxsize=None)
def shapes(n: int) -> tuple:
    """Every ordered rooted tree with n nodes, as nested tuples of children."""
    if n == 1:
        return ((),)
    found = []
    for cuts in itertools.product([False, True], repeat=n - 2):  # compositions of n - 1
        sizes, run = [], 1
        for cut in cuts:
            if cut:
                sizes.append(run)
                run = 0
            run += 1
        sizes.append(run)
        found.extend(itertools.product(*(shapes(size) for size in sizes)))
    return tuple(found)


def to_tree(shape: tuple) -> Tree:
    parents, queue = [], deque([(-1, shape)])
    while queue:
        parent, node_shape = queue.popleft()
        parents.append(parent)
        queue.extend((len(parents) - 1, child) for child in node_shape)
    return Tree(tuple(parents))


@lru_cache(maxsize=None)
def all_trees() -> tuple[Tree, ...]:
    return tuple(to_tree(shape) for n in range(1, MAX_NODES + 1) for shape in shapes(n))


def brute_force(acceptance: list[float], max_depth: int | None) -> list[float]:
    """Best Tree.score for each size 0..MAX_NODES (-inf where no tree qualifies)."""
    best = [-math.inf] * (MAX_NODES + 1)
    for tree in all_trees():
        widest = max(len(children) for children in tree.children)
        if widest > len(acceptance) or (max_depth is not None and tree.depth > max_depth):
            continue
        best[tree.size] = max(best[tree.size], tree.score(acceptance))
    return best


def assert_valid(tree: Tree, acceptance, size: int, max_depth: int | None, value: float):
    assert tree.size == size
    assert max_depth is None or tree.depth <= max_depth
    assert max(len(children) for children in tree.children) <= len(acceptance)
    order = [(tree.depths[node], tree.parents[node]) for node in range(1, size)]
    assert order == sorted(order)  # breadth-first: by depth, then parent (then rank, by numbering)
    assert tree.score(acceptance) == pytest.approx(value, abs=TOL)


def test_catalan_enumeration():
    assert [len(shapes(n)) for n in range(1, MAX_NODES + 1)] == [math.comb(2 * n, n) // (n + 1)
                                                                 for n in range(MAX_NODES)]


@pytest.mark.parametrize("name", VECTORS)
@pytest.mark.parametrize("max_depth", [1, 2, 3, MAX_DEPTH, None])
def test_matches_brute_force(name, max_depth):
    acceptance = VECTORS[name]
    expected = brute_force(acceptance, max_depth)
    scores = best_scores(acceptance, MAX_NODES, max_depth)
    assert scores.shape == (MAX_NODES + 1,) and scores.dtype == torch.float64
    assert scores[0] == -math.inf
    for size in range(1, MAX_NODES + 1):
        if expected[size] == -math.inf:
            assert scores[size] == -math.inf
            with pytest.raises(ValueError):
                best_tree(acceptance, size, max_depth)
            continue
        assert float(scores[size]) == pytest.approx(expected[size], abs=TOL)
        assert_valid(best_tree(acceptance, size, max_depth), acceptance, size, max_depth,
                     expected[size])


@pytest.mark.parametrize("acceptance", [decreasing(4, 32), [0.1, 0.5, 0.05, 0.3], [0.9]])
def test_large_depth_bound_equals_unbounded(acceptance):
    size = 80
    unbounded = best_scores(acceptance, size)
    for max_depth in (size - 1, 10 * size):
        assert torch.allclose(best_scores(acceptance, size, max_depth)[1:], unbounded[1:],
                              rtol=0, atol=TOL)
        assert best_tree(acceptance, size, max_depth).score(acceptance) == pytest.approx(
            float(unbounded[size]), abs=TOL)


@pytest.mark.parametrize("max_depth", [3, 8, None])
def test_larger_trees_are_valid(max_depth):
    acceptance = decreasing(5, 16)
    size = 300
    value = float(best_scores(acceptance, size, max_depth)[size])
    assert_valid(best_tree(acceptance, size, max_depth), acceptance, size, max_depth, value)


def test_scores_grow_with_size_and_depth():
    acceptance = decreasing(6, 8)
    shallow, deep = best_scores(acceptance, 100, 4), best_scores(acceptance, 100, 12)
    assert (shallow[2:] >= shallow[1:-1]).all() and (deep >= shallow).all()


def test_root_only_and_infeasible():
    assert best_tree([0.7], 1, 0) == Tree((-1,))
    assert best_tree([0.7], 4, None) == Tree.chain(3)
    with pytest.raises(ValueError):
        best_tree([0.7], 2, 0)  # a second node needs one draft level
    with pytest.raises(ValueError):
        best_tree([0.7, 0.2], 0)
    with pytest.raises(ValueError):
        best_tree([0.7, float("nan")], 5)
    with pytest.raises(ValueError):
        best_tree([], 5)


def test_speed_512_nodes_depth_16():
    acceptance = [0.8] + [0.03 * 0.85**i for i in range(31)]  # deep enough that the bound binds
    start = time.perf_counter()
    tree = best_tree(acceptance, 512, 16)
    elapsed = time.perf_counter() - start
    assert tree.size == 512 and tree.depth == 16
    assert elapsed < 5.0, f"512 nodes, depth 16 took {elapsed:.2f} s"


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    acceptance = [0.61234567891, 0.2, 0.1]
    tree = cached_best_tree(acceptance, 40, 6, tmp_path)
    assert tree == best_tree([0.612346, 0.2, 0.1], 40, 6)
    (path,) = tmp_path.iterdir()
    assert json.loads(path.read_text())["parents"] == list(tree.parents)

    def no_dp(*args):
        raise AssertionError("the cached tree should have been read")

    monkeypatch.setattr(tree_dp, "best_tree", no_dp)
    assert cached_best_tree(acceptance, 40, 6, tmp_path) == tree
    assert cached_best_tree([0.612346, 0.2, 0.1], 40, 6, tmp_path) == tree  # same rounded key


def test_disk_cache_distinguishes_keys(tmp_path):
    cached_best_tree([0.6, 0.2], 30, 5, tmp_path)
    cached_best_tree([0.6, 0.2], 30, None, tmp_path)
    cached_best_tree([0.6, 0.2], 31, 5, tmp_path)
    cached_best_tree([0.6, 0.3], 30, 5, tmp_path)
    assert len(list(tmp_path.iterdir())) == 4


@pytest.mark.parametrize("content", [b"{not json", b'{"key": 1, "parents": [-1]}', b"\xff\xfe\x00",
                                     b"[]", b'{"parents": [-1, 0, 0]}', b""])
def test_disk_cache_recovers_from_a_bad_file(tmp_path, content):
    acceptance = [0.6, 0.2, 0.1]
    expected = cached_best_tree(acceptance, 20, 4, tmp_path)
    (path,) = tmp_path.iterdir()
    path.write_bytes(content)
    assert cached_best_tree(acceptance, 20, 4, tmp_path) == expected
    assert json.loads(path.read_text())["parents"] == list(expected.parents)  # rewritten


def test_disk_cache_rejects_a_tree_of_the_wrong_shape(tmp_path):
    acceptance = [0.6, 0.2, 0.1]
    expected = cached_best_tree(acceptance, 20, 4, tmp_path)
    (path,) = tmp_path.iterdir()
    data = json.loads(path.read_text())
    path.write_text(json.dumps({"key": data["key"], "parents": list(Tree.chain(19).parents)}))
    assert cached_best_tree(acceptance, 20, 4, tmp_path) == expected  # depth 19 > 4: recomputed


def test_disk_cache_default_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    cached_best_tree([0.6, 0.2], 10, 3)
    assert len(list((tmp_path / "trees").iterdir())) == 1


def test_single_chain():
    acceptance = [0.7, 0.2]
    tree = chain_trees(acceptance, 9, 1)
    assert tree == Tree.chain(8)
    assert tree.score(acceptance) == pytest.approx(sum(0.7 ** i for i in range(9)), abs=TOL)


def test_several_chains():
    acceptance = [0.5, 0.2, 0.6]  # rank 3 is the most likely: it gets the longest chain
    tree = chain_trees(acceptance, 12, 3)
    assert tree.size == 12
    assert tree.children[0] == (1, 2, 3)
    assert all(len(children) <= 1 for children in tree.children[1:])
    leaf_rank = {tree.path_to(node)[0]: len(tree.path_to(node))
                 for node in range(1, 12) if not tree.children[node]}
    assert leaf_rank == {1: 4, 2: 3, 3: 4}
    expected = 1 + sum(acceptance[rank - 1] * sum(0.5 ** i for i in range(length))
                       for rank, length in leaf_rank.items())
    assert tree.score(acceptance) == pytest.approx(expected, abs=TOL)
    assert_valid(tree, acceptance, 12, 4, expected)


def test_chain_trees_rejects_impossible_counts():
    with pytest.raises(ValueError):
        chain_trees([0.5, 0.3], 10, 3)  # more chains than ranks
    with pytest.raises(ValueError):
        chain_trees([0.5, 0.3], 2, 2)  # more chains than draft nodes
    with pytest.raises(ValueError):
        chain_trees([0.5, 0.3], 10, 0)
