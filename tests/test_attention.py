"""specchat's attention (kv/queries.py, kv/past_attention.py) equals transformers' SDPA: grouped heads
folded instead of copied, and the past attended without a mask and merged with the new tokens'."""

import pytest
import torch
from conftest import CUDA, needs_cuda


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


def test_a_decode_step_folds_grouped_heads_on_the_cpu_without_changing_a_score(monkeypatch):
    """One query, grouped KV heads, on the CPU: the heads of a group as one KV head's query
    rows give transformers' SDPA's output, and a one-token model forward takes that path."""
    from types import SimpleNamespace

    from conftest import tiny_llama
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specchat.core.kv import queries

    generator = torch.Generator().manual_seed(4)
    past, kv_heads, groups, dim = 40, 2, 4, 16
    query = torch.randn(1, kv_heads * groups, 1, dim, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(1, kv_heads, past + 1, dim, generator=generator, dtype=torch.float64) for _ in "kv")
    module = SimpleNamespace(num_key_value_groups=groups, layer_idx=0, is_causal=True)
    assert queries._foldable(module, query, None)
    folded = queries._grouped_attention(module, query, key, value, None, 0.25)
    reference, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.25)
    assert folded.shape == reference.shape == (1, 1, kv_heads * groups, dim)
    torch.testing.assert_close(folded, reference, rtol=1e-12, atol=1e-12)

    model = tiny_llama(5, dtype=torch.float64)
    ids = torch.arange(3, 34) % 97

    def step(fold):
        monkeypatch.setattr(queries, "_foldable", fold)
        cache = model.new_cache()
        model.forward(ids[:30], torch.arange(30), cache)
        return model.forward(ids[30:31], torch.tensor([30]), cache)

    folds, taken = queries._foldable, []

    def counted(*args):
        taken.extend([args[1].shape[2]] if folds(*args) else [])
        return folds(*args)

    expected = step(lambda *args: False)
    torch.testing.assert_close(step(counted), expected, rtol=1e-10, atol=1e-10)
    assert taken == [1, 1]  # the step's 2 layers, never the prefill


def _attention_case(device, dtype, n, past, shape, seed):
    """A query, keys and values with grouped heads, and the new tokens' mask among themselves."""
    generator = torch.Generator(device).manual_seed(seed)
    kv_heads, groups, dim = 2, 4, 16
    query = torch.randn(1, kv_heads * groups, n, dim, generator=generator, device=device, dtype=dtype)
    key, value = (torch.randn(1, kv_heads, past + n, dim, generator=generator, device=device, dtype=dtype)
                  for _ in "kv")
    among_new = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if shape == "tree":  # node 3 hangs off node 1, node 4 off node 3
        among_new[3, 2] = among_new[4, 2] = False
    allowed = torch.cat([torch.ones(n, past, dtype=torch.bool, device=device), among_new], dim=1)
    return query, key, value, among_new if shape == "tree" else None, allowed


def _sdpa_reference(query, key, value, allowed, scale):
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = SimpleNamespace(num_key_value_groups=query.shape[1] // key.shape[1], layer_idx=0, is_causal=True)
    return sdpa_attention_forward(module, query, key, value, allowed[None, None], scaling=scale)[0]


@pytest.mark.parametrize("shape, n", [("chain", 8), ("tree", 6), ("prefill chunk", 48), ("long prefill chunk", 300)])
def test_past_unmasked_and_new_masked_merge_into_sdpa_exactly(shape, n):
    from specchat.core.kv.past_attention import CAUSAL_KERNEL_FROM, NewTokenMask, past_and_new_attention

    query, key, value, among_new, allowed = _attention_case("cpu", torch.float64, n, 40, shape, seed=n)
    mask = NewTokenMask(among_new, n)
    got = past_and_new_attention(query, key, value, 0.25, mask)
    assert got is not None, "the CPU's fused attention with log-sum-exp is missing"
    torch.testing.assert_close(got, _sdpa_reference(query, key, value, allowed, 0.25), rtol=1e-12, atol=1e-12)
    # A long causal block takes the kernel's causal mode: no [groups * n, n] bias is built.
    assert bool(mask._biases) == (shape == "tree" or n < CAUSAL_KERNEL_FROM)




@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("mask", ["chain", "tree", "hidden past"])
def test_a_model_forward_with_the_past_unmasked_equals_plain_sdpa(mask, device, monkeypatch):
    """Through the model (the mask checked, split per layer): the same logits as without the split,
    for a chain, a tree, and a mask hiding a past position (which must not split)."""
    from conftest import tiny_llama
    from specchat.core.kv import queries

    model = tiny_llama(5, dtype=torch.float64 if device == "cpu" else torch.float32)
    model.hf.to(device)
    tolerance = 1e-10 if device == "cpu" else 1e-4
    ids = torch.arange(3, 63) % 97
    allowed = torch.ones(6, 60, dtype=torch.bool)
    allowed[:, 54:] = torch.ones(6, 6, dtype=torch.bool).tril()
    if mask == "tree":
        allowed[3, 55] = False
    if mask == "hidden past":
        allowed[2, 10] = False
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    calls = []

    def run(devices):
        monkeypatch.setattr(queries, "SPLIT_DEVICES", devices)  # the split is on for `devices` only
        cache = model.new_cache()
        model.forward(ids[:30], torch.arange(30), cache)  # a prefill chunk after...
        model.forward(ids[30:54], torch.arange(30, 54), cache)  # ...the next one: split when enabled
        return model.forward(ids[54:], torch.arange(54, 60), cache,
                             mask=None if mask == "chain" else additive[None, None])

    expected = run(set())
    counted = queries.past_and_new_attention
    monkeypatch.setattr(queries, "past_and_new_attention", lambda *a: calls.append(a) or counted(*a))
    torch.testing.assert_close(run({device}), expected, rtol=tolerance, atol=tolerance)
    assert len(calls) == (2 if mask == "hidden past" else 4)  # 2 layers per split forward


def test_without_a_fused_kernel_the_forward_keeps_plain_sdpa(monkeypatch):
    """Where the private fused op is missing (another torch, another device), nothing changes."""
    from conftest import tiny_llama
    from specchat.core.kv import past_attention, queries

    model, ids, tree = tiny_llama(6), torch.arange(3, 43) % 97, torch.ones(4, 4, dtype=torch.bool).tril()
    tree[3, 2] = False
    mask = torch.zeros(4, 40).masked_fill(~torch.cat([torch.ones(4, 36, dtype=torch.bool), tree], 1), float("-inf"))

    def verify():
        cache = model.new_cache()
        model.forward(ids[:36], torch.arange(36), cache)
        return model.forward(ids[36:], torch.tensor([36, 37, 38, 38]), cache, mask=mask[None, None])

    monkeypatch.setattr(queries, "SPLIT_DEVICES", set())
    expected = verify()
    monkeypatch.setattr(queries, "SPLIT_DEVICES", {"cpu"})
    monkeypatch.setattr(past_attention, "_unavailable", {("cpu", torch.float64, False)})
    assert past_attention.past_and_new_attention(*_attention_case("cpu", torch.float64, 4, 8, "chain", 0)[:3], 0.25,
                                                 past_attention.NewTokenMask(None, 4)) is None
    torch.testing.assert_close(verify(), expected, rtol=1e-12, atol=1e-12)


@needs_cuda
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape, n", [("chain", 8), ("tree", 6), ("prefill chunk", 48), ("long prefill chunk", 300)])
def test_past_unmasked_and_new_masked_on_cuda(shape, n, dtype, tolerance):
    from specchat.core.kv.past_attention import NewTokenMask, past_and_new_attention

    query, key, value, among_new, allowed = _attention_case("cuda", dtype, n, 1000, shape, seed=n)
    got = past_and_new_attention(query, key, value, 0.25, NewTokenMask(among_new, n))
    assert got is not None, f"no fused attention with log-sum-exp for {dtype} on this GPU"
    reference = _sdpa_reference(*(t.double() for t in (query, key, value)), allowed, 0.25)
    torch.testing.assert_close(got.double(), reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_prefill_chunk_after_the_past_builds_no_chunk_by_context_mask(dtype, monkeypatch):
    """Issue 38: for each prefill chunk after the first, transformers builds a [chunk x past +
    chunk] mask (1 GB of booleans for an 8,192-token chunk at 128K) that no layer reads once the
    past is attended unmasked. specchat's mask builder answers None there; the logits stay
    transformers' own. The reference run shows the check sees a mask when one is built; the
    last run, a split that fails on its first use, builds the causal mask in the layer instead."""
    from conftest import tiny_llama
    from specchat.core.kv import queries

    model, ids = tiny_llama(5, dtype=dtype), torch.arange(3, 63) % 97
    real, built = queries.sdpa_mask, []

    def recording(*args, **kwargs):
        mask = real(*args, **kwargs)
        built.append(None if mask is None else tuple(mask.shape[-2:]))
        return mask

    monkeypatch.setattr(queries, "sdpa_mask", recording)

    def second_chunk(devices):
        monkeypatch.setattr(queries, "SPLIT_DEVICES", devices)
        built.clear()
        cache = model.new_cache()
        model.forward(ids[:30], torch.arange(30), cache)
        return model.forward(ids[30:], torch.arange(30, 60), cache)

    expected = second_chunk(set())
    assert (30, 60) in built  # transformers' path: the chunk's mask over the whole context
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(second_chunk({"cpu"}), expected, rtol=tolerance, atol=tolerance)
    assert (30, 60) not in built
    monkeypatch.setattr(queries, "past_and_new_attention", lambda *args: None)  # no fused kernel, found out now
    torch.testing.assert_close(second_chunk({"cpu"}), expected, rtol=tolerance, atol=tolerance)
    assert (30, 60) not in built


@needs_cuda
def test_a_long_prefill_chunk_s_attention_stays_within_what_the_plan_budgets():
    """An 8,192-token chunk of Llama-3.1-8B's shape in one layer: the attention's temporaries stay
    within `planning.memory.attention_bytes` (with the folded bias they would exceed it)."""
    from types import SimpleNamespace

    from specchat.core.kv.past_attention import NewTokenMask, past_and_new_attention
    from specchat.core.planning.memory import attention_bytes

    n, past, heads, kv_heads, dim = 8192, 8192, 32, 8, 128
    generator = torch.Generator("cuda").manual_seed(0)
    query = torch.randn(1, heads, n, dim, generator=generator, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, past + n, dim, generator=generator, device="cuda", dtype=torch.bfloat16)
                  for _ in "kv")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert past_and_new_attention(query, key, value, dim ** -0.5, NewTokenMask(None, n)) is not None
    torch.cuda.synchronize()
    spec = SimpleNamespace(hidden_size=heads * dim, attention_heads=heads, kv_heads=kv_heads, head_dim=dim)
    assert torch.cuda.max_memory_allocated() - before <= attention_bytes(spec, n, 2)
