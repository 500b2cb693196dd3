"""Token trees: shape bookkeeping, tree attention equal to per-path runs, cache compaction."""

import pytest
import torch

from conftest import tiny_llama
from specchat.core.speculative.tree import Tree

#        0
#      / | \
#     1  2  3
#    / \     \
#   4   5     6
#   |
#   7
TREE = Tree((-1, 0, 0, 0, 1, 1, 3, 4))


def test_shape_bookkeeping():
    assert TREE.size == 8 and TREE.depth == 3
    assert TREE.depths == (0, 1, 1, 1, 2, 2, 2, 3)
    assert TREE.children[0] == (1, 2, 3) and TREE.children[1] == (4, 5) and TREE.children[7] == ()
    assert TREE.ranks == (0, 0, 1, 2, 0, 1, 0, 0)
    assert TREE.path_to(7) == [1, 4, 7] and TREE.path_to(0) == []
    assert TREE.positions(10).tolist() == [10, 11, 11, 11, 12, 12, 12, 13]


def test_mask_lets_a_node_see_the_past_itself_and_its_ancestors_only():
    mask = TREE.attention_mask(past=2)
    assert mask.shape == (1, 1, 8, 10)
    allowed = (mask[0, 0] == 0)
    assert allowed[:, :2].all()  # the cached prefix
    assert allowed[7, 2:].nonzero()[:, 0].tolist() == [0, 1, 4, 7]
    assert allowed[6, 2:].nonzero()[:, 0].tolist() == [0, 3, 6]


def test_invalid_trees_are_refused():
    with pytest.raises(ValueError):
        Tree((0, 0))
    with pytest.raises(ValueError):
        Tree((-1, 2, 0))


def test_score_is_expected_accepted_length():
    p = [0.8, 0.5, 0.2]
    # f: root 1; 1: .8, 2: .5, 3: .2; 4: .64, 5: .4, 6: .16; 7: .512
    assert TREE.score(p) == pytest.approx(1 + .8 + .5 + .2 + .64 + .4 + .16 + .512)
    assert Tree.chain(3).score([0.5]) == pytest.approx(1 + .5 + .25 + .125)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_tree_forward_equals_running_each_path(attention):
    """One forward over the whole tree gives every node the logits it gets when its own path
    runs alone. With eager attention this holds only because the mask is additive (float):
    a boolean mask would be added as 0/1 and silently give wrong logits."""
    model = tiny_llama(3)
    model.hf.config._attn_implementation = attention
    prefix = torch.tensor([5, 9, 2, 7, 7, 1])
    tokens = torch.tensor([1, 11, 12, 13, 14, 15, 16, 17])  # tokens[0]: the last committed token
    cache = model.new_cache()
    model.forward(prefix[:-1], torch.arange(5), cache)
    tree_logits = model.forward(tokens, TREE.positions(5), cache, mask=TREE.attention_mask(5))
    for node in range(TREE.size):
        path = torch.cat([prefix[:-1], tokens[[0] + TREE.path_to(node)]])
        alone = model.forward(path, torch.arange(path.shape[0]), model.new_cache())[-1]
        # Eager attention takes its softmax in fp32 even for an fp64 model: rounding ~1e-7;
        # a mask applied wrongly moves logits by ~1e-1.
        assert torch.allclose(tree_logits[node], alone, atol=1e-5), node


def test_keep_compacts_the_accepted_path_after_the_prefix():
    model = tiny_llama(4)
    prefix = torch.tensor([3, 1, 4, 1, 5])
    tokens = torch.tensor([9, 11, 12, 13, 14, 15, 16, 17])
    cache = model.new_cache()
    model.forward(prefix, torch.arange(5), cache)
    model.forward(tokens, TREE.positions(5), cache, mask=TREE.attention_mask(5))
    path = TREE.path_to(7)  # nodes 1, 4, 7
    cache.keep(torch.cat([torch.arange(5), 5 + torch.tensor([0] + path)]))
    assert cache.length == 9
    # The compacted cache continues exactly like a cache built from the path's tokens.
    reference = model.new_cache()
    sequence = torch.cat([prefix, tokens[[0] + path]])
    model.forward(sequence, torch.arange(9), reference)
    after = model.forward(torch.tensor([20]), torch.tensor([9]), cache)
    expected = model.forward(torch.tensor([20]), torch.tensor([9]), reference)
    assert torch.allclose(after, expected, atol=1e-12)
