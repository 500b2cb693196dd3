"""The streaming, retrieval and offloaded caches on tiny random models: each attends exactly the
positions it claims to, and rolls back like the full cache."""

import pytest
import torch

from conftest import needs_cuda, tiny_llama
from test_decoding import prompts, run
from specchat.core.decoding import TriforceSettings, triforce_decoder
from specchat.core.kv.offload import OffloadedCache
from specchat.core.kv.retrieval import RetrievalCache, select_by_chunk_means, select_positions
from specchat.core.kv.streaming import StreamingCache, streaming_positions
from specchat.core.sampling import SamplingParams
from specchat.core.speculative.tree import Tree
from specchat.core.runtime import EngineSettings

PREFILL_CHUNK = EngineSettings().prefill_chunk  # the engine's, where a test builds a decoder itself


def masked_logits(model, ids, visible: torch.Tensor, new: torch.Tensor):
    """Reference: the full model over `ids` then `new`, each new token attending only the
    `visible` positions of `ids` and the new tokens up to itself."""
    cache = model.new_cache()
    model.forward(ids, torch.arange(len(ids)), cache)
    allowed = torch.zeros(len(new), len(ids) + len(new), dtype=torch.bool)
    allowed[:, visible] = True
    allowed[:, len(ids):] = torch.ones(len(new), len(new), dtype=torch.bool).tril()
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    return model.forward(new, torch.arange(len(ids), len(ids) + len(new)), cache, mask=mask[None, None])


def full_cache(model, ids):
    cache = model.new_cache()
    model.forward(ids, torch.arange(len(ids)), cache)
    return cache


def test_streaming_cache_attends_sinks_and_window_only():
    model = tiny_llama(0)
    ids, new = torch.arange(40) % 97, torch.tensor([5, 6, 7])
    cache = StreamingCache.from_cache(model.hf.config, full_cache(model, ids), sinks=3, window=10)
    assert cache.length == 40 and cache.slots == 13
    got = model.forward(new, torch.arange(40, 43), cache)
    torch.testing.assert_close(got, masked_logits(model, ids, streaming_positions(40, 3, 10), new))


def test_a_fitted_streaming_cache_gives_back_a_read_chunks_room_and_attends_the_same():
    model = tiny_llama(2)
    ids = torch.arange(400) % 97
    cache = StreamingCache(model.hf.config, sinks=2, window=6)
    model.forward(ids[:390], torch.arange(390), cache)  # a long prompt chunk
    cache.compact()
    fitted = cache.fitted()
    assert cache.transformers_cache.layers[0]._key_buffer.shape[-2] >= 390
    assert fitted.transformers_cache.layers[0]._key_buffer.shape[-2] == 256  # the smallest a buffer grows by
    assert (fitted.length, fitted.slots) == (390, 8)
    new = ids[390:]
    torch.testing.assert_close(model.forward(new, torch.arange(390, 400), fitted),
                               model.forward(new, torch.arange(390, 400), cache))


def test_streaming_cache_rolls_back_and_compacts():
    model = tiny_llama(1)
    ids = torch.arange(30) % 97
    cache = StreamingCache(model.hf.config, sinks=2, window=6)
    model.forward(ids[:20], torch.arange(20), cache)
    cache.compact()
    assert (cache.length, cache.slots) == (20, 8)
    model.forward(ids[20:25], torch.arange(20, 25), cache)
    cache.trim(22)  # drop three of the new tokens
    assert (cache.length, cache.slots) == (22, 10)
    cache.trim(15)  # into the window: the slots before 15 remain
    assert (cache.length, cache.slots) == (15, 3)  # sinks 0, 1 and position 14
    cache.trim(1)
    assert (cache.length, cache.slots) == (1, 1)


def test_a_compacted_streaming_cache_attends_what_a_fresh_one_holds():
    """Compaction moves the kept slots inside the cache's buffers: the next forwards must see
    the sinks and the window (not stale slots), like a cache built with those positions."""
    model = tiny_llama(1)
    ids = torch.arange(3, 40) % 97
    compacted = StreamingCache(model.hf.config, sinks=2, window=6)
    model.forward(ids[:20], torch.arange(20), compacted)
    compacted.compact()
    fresh = StreamingCache.from_cache(model.hf.config, full_cache(model, ids[:20]), sinks=2, window=6)
    for start, end in ((20, 23), (23, 27)):  # after the compaction, then after a further update
        new, positions = ids[start:end], torch.arange(start, end)
        torch.testing.assert_close(model.forward(new, positions, compacted), model.forward(new, positions, fresh))


def test_selection_keeps_sink_recent_and_each_kv_heads_own_chunks():
    kv_heads, length, head_dim = 2, 64, 4
    keys = torch.zeros(kv_heads, length, head_dim)
    keys[0, 16:20, 0] = 5.0  # KV head 0: chunk 4 (positions 16-19) answers direction 0
    keys[1, 40:44, 1] = 5.0  # KV head 1: chunk 10 answers direction 1
    queries = torch.zeros(4, head_dim)  # two query heads per KV head (grouped-query attention)
    queries[0:2, 0] = 3.0
    queries[2:4, 1] = 3.0
    kept = select_positions(queries, keys, budget=16, chunk_size=4, recent=8)  # one chunk each
    assert kept.shape == (2, 16)
    for head, chunk in ((0, range(16, 20)), (1, range(40, 44))):
        row = kept[head].tolist()
        assert row == sorted(row)
        assert set(range(4)) <= set(row) and set(range(56, 64)) <= set(row)  # sink and recent
        assert set(chunk) <= set(row)
    assert not set(range(40, 44)) <= set(kept[0].tolist())  # head 0 did not take head 1's chunk
    assert torch.equal(select_positions(queries, keys, budget=64, chunk_size=4, recent=8),
                       torch.arange(64).expand(2, 64))


def test_chunk_means_choose_each_kv_heads_own_chunks_too():
    """TriForce's proxy over the same keys: the planted chunks stand out in their mean keys."""
    kv_heads, length, head_dim = 2, 64, 4
    keys = torch.zeros(kv_heads, length, head_dim)
    keys[0, 16:20, 0] = 5.0
    keys[1, 40:44, 1] = 5.0
    queries = torch.zeros(4, head_dim)
    queries[0:2, 0] = 3.0
    queries[2:4, 1] = 3.0
    means = keys.reshape(kv_heads, 16, 4, head_dim).mean(2)
    kept = select_by_chunk_means(queries, means, length, budget=16, chunk_size=4, recent=8)
    assert torch.equal(kept, select_positions(queries, keys, budget=16, chunk_size=4, recent=8))
    assert torch.equal(select_by_chunk_means(queries, means, length, budget=64, chunk_size=4, recent=8),
                       torch.arange(64).expand(2, 64))


@pytest.mark.parametrize("span_positions", [8192, 8])  # 8: two chunks read at a time
def test_an_offloaded_cache_s_chunk_means_follow_every_change_and_recompute_only_those(span_positions, monkeypatch):
    from specchat.core.kv import chunk_means

    monkeypatch.setattr(chunk_means, "SPAN_POSITIONS", span_positions)
    model = tiny_llama(3)
    cache = OffloadedCache(model.config, 64, "cpu", model.dtype)
    ids = torch.arange(3, 63) % 97

    def expected(length):
        return [keys[0, :, :length // 4 * 4].reshape(keys.shape[1], -1, 4, keys.shape[-1]).mean(2)
                for keys, _ in cache.layers()]

    def check():
        for got, want in zip(cache.chunk_means(4, "cpu"), expected(cache.length), strict=True):
            torch.testing.assert_close(got, want.to(got.dtype))

    model.forward(ids[:30], torch.arange(30), cache)
    check()
    assert cache._chunk_means.valid == 7  # 30 positions: 7 complete chunks
    model.forward(ids[30:41], torch.arange(30, 41), cache)  # a verification...
    cache.trim(33)  # ...of which 3 were accepted
    assert cache._chunk_means.valid == 7  # chunk 7 (28-31) was still incomplete: nothing to redo
    check()
    cache.trim(10)  # another conversation shares the first 10 positions
    model.forward(ids[40:60], torch.arange(10, 30), cache)
    assert cache._chunk_means.valid == 2
    check()
    cache.keep(torch.tensor([*range(20), 25, 26, 27]))  # a tree's accepted path
    assert cache._chunk_means.valid == 5
    check()


@pytest.mark.parametrize("tree", [None, Tree((-1, 0, 0, 1, 1, 3))])
def test_greedy_triforce_over_an_offloaded_cache_equals_plain_with_chunk_means(tree, monkeypatch):
    """On the CPU as on a GPU (the CUDA test below): the retrieval stage over an offloaded KV chooses
    its chunks by their mean keys; only its proposals change."""
    model = tiny_llama(4, dtype=torch.float64, weight_scale=8.0)
    prompt = prompts(4)["n-gram hits"]
    plain, _ = run(model, prompt, "plain", SamplingParams(), 30)
    model.offload_capacity = 128
    asked = []
    means = OffloadedCache.chunk_means
    monkeypatch.setattr(OffloadedCache, "chunk_means", lambda *args: asked.append(1) or means(*args))
    settings = TriforceSettings(draft="skip1", budget=24, chunk_size=4, recent=8, stride=8, sinks=2, window=16,
                                tree=tree)
    speculative, _ = run(model, prompt, "triforce", SamplingParams(), 30,
                         triforce_decoder(model, settings, prefill_chunk=PREFILL_CHUNK))
    assert speculative == plain and asked  # len(prompt) = 70: more than the budget


def test_retrieval_cache_attends_its_selection_and_rolls_back_to_its_build():
    model = tiny_llama(2)
    ids, new = torch.arange(3, 60) % 97, torch.tensor([1, 2, 3, 4])
    cache = model.new_cache()
    _, queries = model.forward_with_queries(ids, torch.arange(len(ids)), cache)
    queries = {layer: q[0, :, -1] for layer, q in queries.items()}
    retrieval = RetrievalCache.build(model.hf.config, cache.layers(), queries, budget=24, chunk_size=4, recent=8)
    assert retrieval.length == len(ids) and 16 < retrieval.base_slots <= 24
    got = model.forward(new, torch.arange(len(ids), len(ids) + 4), retrieval)
    # Per layer and KV head the selections differ, so compare with a budget that keeps everything:
    whole = RetrievalCache.build(model.hf.config, cache.layers(), queries, budget=64, chunk_size=4, recent=8)
    torch.testing.assert_close(model.forward(new, torch.arange(len(ids), len(ids) + 4), whole),
                               masked_logits(model, ids, torch.arange(len(ids)), new))
    assert not torch.allclose(got, masked_logits(model, ids, torch.arange(len(ids)), new))
    retrieval.trim(len(ids) + 1)
    assert retrieval.length == len(ids) + 1
    with pytest.raises(ValueError):
        retrieval.trim(len(ids) - 1)


def test_a_rebuilt_retrieval_cache_refills_its_own_buffers_and_attends_as_a_new_one():
    """TriForce rebuilds its retrieval cache every few verifications: into the same buffers, so
    that the step graphs captured over them (keyed by cache and buffers) keep replaying. The
    refilled cache attends exactly as one built afresh; one that does not fit is made anew."""
    model = tiny_llama(2)
    ids = torch.arange(3, 90) % 97
    full = model.new_cache()
    _, recorded = model.forward_with_queries(ids[:60], torch.arange(60), full)
    first = RetrievalCache.build(model.hf.config, full.layers(), {k: q[0, :, -1] for k, q in recorded.items()},
                                 budget=24, chunk_size=4, recent=8)
    model.forward(torch.tensor([5, 6]), torch.arange(60, 62), first)  # drafted and verified since the build
    buffers = [t.data_ptr() for layer in first.transformers_cache.layers for t in layer.buffers]
    _, recorded = model.forward_with_queries(ids[60:], torch.arange(60, len(ids)), full)
    queries = {k: q[0, :, -1] for k, q in recorded.items()}
    rebuilt = RetrievalCache.build(model.hf.config, full.layers(), queries, budget=24, chunk_size=4, recent=8,
                                   reuse=first)
    fresh = RetrievalCache.build(model.hf.config, full.layers(), queries, budget=24, chunk_size=4, recent=8)
    assert rebuilt is first and [t.data_ptr() for layer in first.transformers_cache.layers for t in layer.buffers] == buffers
    assert (rebuilt.length, rebuilt.base_length, rebuilt.base_slots) == (fresh.length, fresh.base_length, fresh.base_slots)
    assert all(torch.equal(a, b) for got, want in zip(rebuilt.layers(), fresh.layers()) for a, b in zip(got, want))
    new, positions = torch.tensor([1, 2, 3]), torch.arange(len(ids), len(ids) + 3)
    assert torch.equal(model.forward(new, positions, rebuilt), model.forward(new, positions, fresh))
    layer = rebuilt.transformers_cache.layers[0]
    capacity, held = layer.buffers[0].shape[2], layer.keys.clone()
    too_long = torch.zeros(1, held.shape[1], capacity + 1, held.shape[3], dtype=held.dtype)
    assert not layer.refill(too_long, too_long) and torch.equal(layer.keys, held)  # unchanged: made anew


def test_a_retrieval_cache_after_keep_attends_like_a_full_cache_after_keep():
    """A tree's accepted path kept in a retrieval cache (holding everything, so it must equal
    the full cache): the following forwards see the kept slots, not stale ones."""
    model = tiny_llama(2)
    ids, tree = torch.arange(3, 40) % 97, torch.tensor([7, 8, 9, 10])
    full = model.new_cache()
    _, queries = model.forward_with_queries(ids, torch.arange(len(ids)), full)
    queries = {layer: q[0, :, -1] for layer, q in queries.items()}
    retrieval = RetrievalCache.build(model.hf.config, full.layers(), queries, budget=64, chunk_size=4, recent=8)
    path = torch.tensor(list(range(len(ids))) + [len(ids), len(ids) + 2])  # drop the tree's second node
    for cache in (full, retrieval):
        model.forward(tree, torch.arange(len(ids), len(ids) + 4), cache)
        cache.keep(path)
    for start in (len(ids) + 2, len(ids) + 5):  # after the keep, then after a further update
        new, positions = torch.tensor([11, 12, 13]), torch.arange(start, start + 3)
        torch.testing.assert_close(model.forward(new, positions, retrieval), model.forward(new, positions, full))


def offloaded_like_full(model, device):
    ids = (torch.arange(50) * 7 % 97).to(torch.long)
    full = model.new_cache()
    offloaded = OffloadedCache(model.config, 64, device, model.dtype)
    for cache in (full, offloaded):
        model.forward(ids[:30], torch.arange(30), cache)
    steps = [(ids[30:33], None), (ids[33:34], None)]
    for new, _ in steps:
        start = full.length
        expected = model.forward(new, torch.arange(start, start + len(new)), full)
        got = model.forward(new, torch.arange(start, start + len(new)), offloaded)
        torch.testing.assert_close(got, expected)
    for cache in (full, offloaded):
        cache.trim(31)
        cache.keep(torch.tensor(list(range(29)) + [30]))  # drop position 29, as a tree path would
    assert offloaded.length == full.length == 30
    new = ids[40:45]
    torch.testing.assert_close(model.forward(new, torch.arange(30, 35), offloaded),
                               model.forward(new, torch.arange(30, 35), full))
    for (k1, v1), (k2, v2) in zip(full.layers(), offloaded.layers()):
        torch.testing.assert_close(k1.cpu(), k2.cpu())
        torch.testing.assert_close(v1.cpu(), v2.cpu())
    return offloaded


def test_offloaded_cache_matches_the_full_cache_on_cpu():
    offloaded_like_full(tiny_llama(3), "cpu")


@needs_cuda
def test_offloaded_cache_matches_the_full_cache_on_cuda():
    model = tiny_llama(3, dtype=torch.float32)
    model.to("cuda")
    offloaded = offloaded_like_full(model, "cuda")
    assert offloaded._rows[0][0].is_pinned()
    assert offloaded.fetched_bytes > 0


@needs_cuda
def test_an_offloaded_gather_reaches_the_gpu_through_two_staging_slots():
    """A rebuild's rows cross from pinned host memory through two page-locked slots used in turn
    (more layers than slots, then more rows than the slots hold): the rows that arrive are the
    host's, whatever slot carried them."""
    model = tiny_llama(3, dtype=torch.float32, layers=5)
    model.to("cuda")
    cache = OffloadedCache(model.hf.config, 64, "cuda", torch.float32)
    model.forward(torch.arange(3, 50) % 97, torch.arange(47), cache)
    generator = torch.Generator().manual_seed(0)
    for kept in (6, 6, 11):
        positions = torch.sort(torch.stack([torch.stack([torch.randperm(47, generator=generator)[:kept]
                                                         for _ in range(2)]) for _ in range(5)])).values
        gathered = cache.gather(positions, "cuda")
        torch.cuda.synchronize()
        for (keys, values), (stored_k, stored_v), at in zip(gathered, cache._rows, positions, strict=True):
            assert keys.device.type == "cuda"
            assert torch.equal(keys[0].cpu(), stored_k.gather(1, at[..., None].expand(-1, -1, 8)))
            assert torch.equal(values[0].cpu(), stored_v.gather(1, at[..., None].expand(-1, -1, 8)))
    assert len(cache._staging._slots) == 2 and cache._staging._slots[0][0].shape[0] == 22
    # The chunk means the rebuild scores with, read from pinned memory a head at a time.
    for means, (keys, _) in zip(cache.chunk_means(4, "cuda"), cache.layers(), strict=True):
        expected = keys[0, :, :44].reshape(2, 11, 4, 8).mean(2)
        torch.testing.assert_close(means.cpu(), expected.cpu())


@needs_cuda
@pytest.mark.parametrize("tree", [None, Tree((-1, 0, 0, 1, 1, 3))])
def test_greedy_triforce_over_an_offloaded_cache_equals_plain_on_cuda(tree):
    model = tiny_llama(4, dtype=torch.float32, weight_scale=8.0)
    model.hf.to("cuda")
    prompt = prompts(4)["n-gram hits"]
    plain, _ = run(model, prompt, "plain", SamplingParams(), 30)
    model.offload_capacity = 128
    settings = TriforceSettings(draft="skip1", budget=24, chunk_size=4, recent=8, stride=8, sinks=2, window=16,
                                tree=tree)
    speculative, _ = run(model, prompt, "triforce", SamplingParams(), 30, triforce_decoder(model, settings, prefill_chunk=PREFILL_CHUNK))
    assert speculative == plain


@pytest.mark.parametrize("kind", ["full", "int8"])
def test_a_growing_cache_reserves_no_room_past_the_plans_context(kind):
    """A plan at 300 positions on a model of 512: growing in 25% steps the KV used to reserve up
    to the config's positions. A verification's nodes past the plan's context still fit."""
    from specchat.core.kv.full import FullCache
    from specchat.core.kv.int8 import Int8Cache
    from specchat.core.model import TransformersLM

    lm = TransformersLM(tiny_llama(0, dtype=torch.float32).hf, kv_dtype="int8" if kind == "int8" else None,
                        cache_positions=300)
    cache = lm.new_cache()
    assert isinstance(cache, Int8Cache if kind == "int8" else FullCache) and cache.max_positions == 300
    ids = torch.randint(0, 97, (310,))
    lm.forward(ids[:280], torch.arange(280), cache)
    layer = cache.transformers_cache.layers[0]
    lm.forward(ids[280:290], torch.arange(280, 290), cache)  # 1.25 x 280 = 350 would pass the plan's 300
    assert layer._key_buffer.shape[-2] == 300
    lm.forward(ids[290:310], torch.arange(290, 310), cache)
    assert layer._key_buffer.shape[-2] == 310 and cache.length == 310
    assert cache.clone_prefix(200).max_positions == 300



@pytest.mark.parametrize("layout", ["contiguous", "a growing buffer's view", "8-bit rows", "offset in its storage",
                                    "one head", "transposed"])
def test_head_rows_copies_each_heads_kept_rows_as_gather_would(layout):
    """Retrieval rebuilds copy whole rows (`head_rows`) where gather read an index per element."""
    from specchat.core.kv.cache import head_rows

    generator = torch.Generator().manual_seed(3)
    buffer = torch.randn(3, 50, 16, generator=generator)
    stored = {"contiguous": buffer[:, :40], "a growing buffer's view": buffer[:, :37],
              "8-bit rows": torch.randint(-128, 127, (3, 40, 20), dtype=torch.int8, generator=generator),
              "offset in its storage": buffer[:, 7:47],  # a slab's tensor, a window of a buffer
              "one head": buffer[1:2].expand(3, -1, -1)[:1, :40],
              "transposed": torch.randn(40, 3, 16, generator=generator).transpose(0, 1)}[layout]  # by gather
    heads = stored.shape[0]
    kept = torch.sort(torch.stack([torch.randperm(stored.shape[1], generator=generator)[:9]
                                   for _ in range(heads)])).values
    expected = stored.gather(1, kept[..., None].expand(-1, -1, stored.shape[-1]))
    assert torch.equal(head_rows(stored, kept), expected)
    out = torch.empty(heads * 9, stored.shape[-1], dtype=stored.dtype)
    assert torch.equal(head_rows(stored, kept, out), expected) and torch.equal(out.view(heads, 9, -1), expected)
