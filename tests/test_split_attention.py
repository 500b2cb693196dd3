"""Attention split over two key sets and merged by log-sum-exp equals attention over all keys."""

import pytest
import torch

from specchat.core.kv.split_attention import attention_with_lse, merge


def test_two_parts_merge_into_full_attention_with_grouped_heads_and_a_causal_tail():
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, n, prefix, dim = 8, 2, 5, 37, 16
    queries = torch.randn(heads, n, dim, generator=generator, dtype=torch.float64)
    keys = torch.randn(kv_heads, prefix + n, dim, generator=generator, dtype=torch.float64)
    values = torch.randn(kv_heads, prefix + n, dim, generator=generator, dtype=torch.float64)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    allowed = torch.cat([torch.ones(n, prefix, dtype=torch.bool), causal], dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        queries[None], keys[None], values[None], attn_mask=allowed, scale=dim ** -0.5, enable_gqa=True)[0]
    cpu_part = attention_with_lse(queries, keys[:, :prefix], values[:, :prefix], dim ** -0.5)
    new_part = attention_with_lse(queries, keys[:, prefix:], values[:, prefix:], dim ** -0.5, causal)
    torch.testing.assert_close(merge(*cpu_part, *new_part), expected.float(), rtol=1e-5, atol=1e-5)


def test_a_part_no_query_sees_contributes_nothing():
    queries, keys, values = torch.randn(2, 3, 4), torch.randn(1, 6, 4), torch.randn(1, 6, 4)
    hidden = attention_with_lse(queries, keys, values, 0.5, torch.zeros(3, 6, dtype=torch.bool))
    visible = attention_with_lse(queries, keys, values, 0.5)
    assert torch.isneginf(hidden[1]).all()
    torch.testing.assert_close(merge(*visible, *hidden), visible[0])


@pytest.mark.parametrize("tree", [False, True])
def test_verification_attention_folds_grouped_heads_without_changing_a_score(tree):
    """Several queries under a mask with grouped KV heads: folding the group into the query
    length instead of copying keys and values gives transformers' SDPA's output."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specchat.core.kv.queries import _grouped_attention

    generator = torch.Generator().manual_seed(3)
    past, n, kv_heads, groups, dim = 40, 6, 2, 4, 16
    query = torch.randn(1, kv_heads * groups, n, dim, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(1, kv_heads, past + n, dim, generator=generator, dtype=torch.float64) for _ in "kv")
    allowed = torch.ones(n, past + n, dtype=torch.bool)
    allowed[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
    if tree:  # node 3 hangs off node 1, not node 2
        allowed[3, past + 2] = False
    module = SimpleNamespace(num_key_value_groups=groups, layer_idx=0, is_causal=True)
    mask = allowed[None, None]
    folded = _grouped_attention(module, query, key, value, mask, 0.25)  # used on CUDA (kv/queries.py)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert folded.shape == reference.shape == (1, n, kv_heads * groups, dim)
    torch.testing.assert_close(folded, reference, rtol=1e-12, atol=1e-12)
