"""The 8-bit KV offloaded to (pinned) CPU memory (core/kv/offload.py with `int8`) on tiny random
fp64 models, on the CPU: it holds exactly the rows the on-chip 8-bit cache holds, the model attends
exactly to their dequantized values, the retrieval stage scores and gathers them dequantized, a
saved document moves between the two bit for bit, and every decoder stays lossless against the
model with that KV (its sampled chain's chi-square, a stopped forward's rollback and a token
stored alike alone or in a batch: tests/test_kv_int8.py)."""

import pytest
import torch

import test_kv_protocol
from conftest import needs_cuda, tiny_llama
from test_decoding import assert_greedy_identity, run
from test_kv_int8 import IDS, SMALL, each_forward, reference_cache
from test_kv_caches import PREFILL_CHUNK, prompts
from specchat.core.decoding import TreeDecoder, TriforceSettings, make_decoder, triforce_decoder
from specchat.core.kv.document_store import DocumentStore
from specchat.core.kv import int8 as int8_module, offload as offload_module
from specchat.core.kv.full import FullCache
from specchat.core.kv.int8 import Int8Cache
from specchat.core.kv.int8_rows import unpack
from specchat.core.kv.offload import OffloadedCache
from specchat.core.kv.retrieval import RetrievalCache
from specchat.core.kv.streaming import StreamingCache
from specchat.core.model import TransformersLM
from specchat.core.sampling import SamplingParams
from specchat.core.speculative.suffix_drafter import SuffixDrafter
from specchat.core.speculative.tree import Tree

CAPACITY = 160


def offloaded(model: TransformersLM) -> TransformersLM:
    """The same weights, with an 8-bit KV of CAPACITY positions in CPU memory."""
    return TransformersLM(model.hf, offload_capacity=CAPACITY, kv_dtype="int8")


def on_chip(model: TransformersLM) -> TransformersLM:
    return TransformersLM(model.hf, kv_dtype="int8")


def filled(model, length: int = 40):
    cache = model.new_cache()
    model.forward(IDS[:length], torch.arange(length), cache)
    return cache


def test_the_model_attends_exactly_to_the_dequantized_values_and_holds_the_on_chip_rows():
    """Prefill, a verification, a rollback, a tree and its accepted path, a decode step: the logits
    equal those over float64 values rounded to the int8 steps and the on-chip 8-bit cache's, and
    after each the stored rows are the on-chip cache's, bit for bit."""
    plain = tiny_llama(3)
    caches = {"offloaded": offloaded(plain).new_cache(), "on-chip": on_chip(plain).new_cache(),
              "reference": reference_cache(plain)}
    assert isinstance(caches["offloaded"], OffloadedCache) and caches["offloaded"].int8

    def step(ids, positions, mask=None):
        logits = {name: plain.forward(ids, positions, cache, mask) for name, cache in caches.items()}
        torch.testing.assert_close(logits["offloaded"], logits["reference"], rtol=0, atol=1e-12)
        assert torch.equal(logits["offloaded"], logits["on-chip"])
        for (keys, values), (chip_keys, chip_values) in zip(caches["offloaded"].stored_layers(),
                                                            caches["on-chip"].stored_layers(), strict=True):
            assert torch.equal(keys, chip_keys) and torch.equal(values, chip_values)

    each_forward(step, caches.values())
    cache = caches["offloaded"]
    assert all(keys.dtype == values.dtype == torch.int8 for keys, values in cache._rows)
    assert cache.nbytes == caches["on-chip"].nbytes == 2 * 2 * (2 * 37 * (8 + 4))
    assert all(keys.dtype == torch.float64 and keys.shape == (1, 2, 37, 8) for keys, _ in cache.layers())


def test_the_retrieval_stage_scores_and_gathers_dequantized_keys():
    """Chunk means over the stored rows are the means of the dequantized keys, and the retrieval
    cache built over the offloaded KV holds the dequantized rows it selected: that of the on-chip
    cache's layers with every position kept."""
    plain = tiny_llama(2)
    ids = torch.arange(3, 60) % 97
    cache = offloaded(plain).new_cache()
    _, queries = plain.forward_with_queries(ids, torch.arange(len(ids)), cache)
    queries = {layer: q[0, :, -1] for layer, q in queries.items()}
    for means, (keys, _) in zip(cache.chunk_means(4, "cpu"), cache.stored_layers(), strict=True):
        seen = unpack(keys[0], torch.float32)[:, :56]
        torch.testing.assert_close(means, seen.reshape(2, 14, 4, 8).mean(2).to(torch.float64), rtol=0, atol=1e-12)
    whole = RetrievalCache.from_full(cache, queries, budget=64, chunk_size=4, recent=8, device=torch.device("cpu"))
    for (kept, _), (keys, _) in zip(whole.layers(), cache.layers(), strict=True):
        assert kept.dtype == torch.float64 and torch.equal(kept[:, :, :len(ids)], keys)


def test_greedy_chain_and_trees_equal_greedy_plain():
    models = [(seed, offloaded(tiny_llama(seed))) for seed in range(2)]
    assert_greedy_identity(models, lambda seed, model: make_decoder("chain"), 30)
    assert_greedy_identity(models, lambda seed, model: TreeDecoder(SuffixDrafter()), 24)


@pytest.mark.parametrize("settings", [TriforceSettings(draft="skip1", **SMALL),
                                      TriforceSettings(tree=Tree((-1, 0, 0, 0, 1, 1, 2, 4)), **SMALL)],
                         ids=["chain", "final-tree"])
def test_greedy_triforce_equals_greedy_plain_with_chunk_means(settings, monkeypatch):
    """The retrieval stage over the offloaded 8-bit KV chooses its chunks by their mean keys."""
    asked = []
    means = OffloadedCache.chunk_means
    monkeypatch.setattr(OffloadedCache, "chunk_means", lambda *args: asked.append(1) or means(*args))
    model = offloaded(tiny_llama(4, weight_scale=8.0))
    prompt = prompts(4)["n-gram hits"]
    plain, _ = run(model, prompt, "plain", SamplingParams(), 30)
    speculative, _ = run(model, prompt, "triforce", SamplingParams(), 30,
                         triforce_decoder(model, settings, prefill_chunk=PREFILL_CHUNK))
    assert speculative == plain and asked


def test_a_saved_document_moves_between_offloaded_and_on_chip_bit_for_bit(tmp_path):
    """Both keep the same rows (codes, then scale) under the same key: a document saved from one
    loads into the other, and the next forward's logits are those of the cache it was saved from."""
    plain = tiny_llama(2)
    ids, new, positions = IDS[:40].tolist(), torch.tensor([7, 8]), torch.arange(40, 42)
    for saved_from, loaded_into in ((offloaded(plain), on_chip(plain)), (on_chip(plain), offloaded(plain))):
        store = DocumentStore(tmp_path / type(saved_from.new_cache()).__name__, "tiny:float64:kv-int8", 10**9)
        cache = filled(saved_from, 40)
        store.save(ids, cache)
        loaded = store.load(ids + [7, 8], loaded_into.new_cache, at_least=0)
        assert loaded is not None and loaded.length == 40 and store.take_problems() == []
        assert isinstance(loaded.cache, Int8Cache if loaded_into.offload_capacity is None else OffloadedCache)
        for one, other in zip(loaded.cache.stored_layers(), cache.stored_layers(), strict=True):
            assert torch.equal(one[0], other[0]) and torch.equal(one[1], other[1])
        assert torch.equal(plain.forward(new, positions, loaded.cache), plain.forward(new, positions, cache))


def test_it_has_every_protocol_member_as_declared(monkeypatch):
    monkeypatch.setattr(test_kv_protocol, "built", lambda kind: (model := offloaded(tiny_llama(5)), filled(model, 44)))
    test_kv_protocol.test_every_cache_has_every_member_as_declared("offloaded")
    test_kv_protocol.test_trim_and_keep_change_length_as_declared("offloaded")


@needs_cuda
def test_on_cuda_it_streams_the_on_chip_rows_from_pinned_memory():
    """On a GPU the rows stream from pinned memory through the double buffers; a prefill, a
    verification and a step give the on-chip 8-bit cache's logits, holding its rows."""
    plain = tiny_llama(3, dtype=torch.float32)
    plain.to("cuda")
    streamed, chip = offloaded(plain).new_cache(), on_chip(plain).new_cache()
    for ids, positions in ((IDS[:30], torch.arange(30)), (IDS[30:36], torch.arange(30, 36)), (IDS[36:37], [36])):
        positions = torch.as_tensor(positions)
        torch.testing.assert_close(plain.forward(ids, positions, streamed), plain.forward(ids, positions, chip),
                                   rtol=0, atol=0)
    assert streamed._rows[0][0].is_pinned() and streamed.fetched_bytes > 0
    for (keys, _), (chip_keys, _) in zip(streamed.stored_layers(), chip.stored_layers(), strict=True):
        assert torch.equal(keys, chip_keys.cpu())


@pytest.mark.parametrize("where", ["on-chip", "offloaded"])
def test_a_layer_skip_drafts_view_dequantizes_only_the_rows_it_keeps(where, monkeypatch):
    """A layer-skip draft's StreamingLLM view of the target's first layers reads the sinks and
    the window alone (at 128K, dequantizing every layer first would take the whole bf16 KV's
    memory), and attends as one built from the dequantized layers."""
    plain = tiny_llama(2)
    cache = filled(offloaded(plain) if where == "offloaded" else on_chip(plain), 40)
    copied = FullCache.from_layers(plain.config, cache.layers())
    rows = []
    for module in (int8_module, offload_module):
        monkeypatch.setattr(module, "unpack", lambda packed, dtype, inner=unpack: rows.append(packed.shape[-2]) or
                            inner(packed, dtype))
    view = StreamingCache.from_cache(plain.config, cache, sinks=2, window=6, count=1)
    assert rows == [8, 8]  # one layer's keys and values, 2 sinks + 6 recent positions each
    expected = StreamingCache.from_cache(plain.config, copied, sinks=2, window=6, count=1)
    for (keys, values), (want_keys, want_values) in zip(view.layers()[:1], expected.layers()[:1], strict=True):
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
