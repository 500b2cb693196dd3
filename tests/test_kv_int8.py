"""The 8-bit KV cache (core/kv/int8.py) on tiny random fp64 models, on the CPU: the model attends
exactly to the dequantized values of each token's int8 codes, the cache trims, keeps, copies,
saves and rolls back like the full cache, and every decoder stays lossless against the model with
that cache."""

import threading

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config
from transformers.cache_utils import DynamicLayer

import test_kv_protocol
from conftest import tiny_llama
from test_decoding import assert_greedy_identity, exact_sequence_probs, run
from test_prefix_reuse import DOCUMENT, UNLIMITED, conversation, engine_with, run as answer
from test_tree_decoding import model_tree_decoder, noisy_copy
from specchat.app.documents import document_tokens, user_turn
from specchat.core.decoding import ChainDecoder, TreeDecoder, TriforceSettings, make_decoder, triforce_decoder
from specchat.core.interrupt import Cancelled, stop_between_layers
from specchat.core.kv.cache import KVCache
from specchat.core.kv.document_store import DocumentStore
from specchat.core.kv.full import FullCache
from specchat.core.kv.int8 import Int8Cache
from specchat.core.kv.int8_rows import dequantize, pack, quantize, unpack
from specchat.core.kv.offload import OffloadedCache
from specchat.core.kv.prefix_store import PrefixStore
from specchat.core.model import TransformersLM
from specchat.core.placement import LoadOptions
from specchat.core.sampling import SamplingParams
from specchat.core.exact_outcomes import chi_square_p_value
from specchat.core.speculative.drafters import PromptLookupDrafter
from specchat.core.speculative.lookahead import FixedLookahead
from specchat.core.speculative.tree import Tree
from specchat.core.speculative.suffix_drafter import SuffixDrafter

IDS = torch.arange(3, 50) % 97


def int8(model: TransformersLM) -> TransformersLM:
    """The same weights, with the 8-bit KV cache."""
    return TransformersLM(model.hf, kv_dtype="int8")


def reference_round(x: torch.Tensor) -> torch.Tensor:
    """What the 8-bit cache must hand attention, computed apart from it (numpy, float64): per row,
    scale = float32(absmax / 127), each value rounded to the nearest of -127..127 steps of it."""
    a = x.double().numpy()
    scale = (np.abs(a).max(-1, keepdims=True) / 127).astype(np.float32).astype(np.float64)
    return torch.from_numpy(np.clip(np.round(a / np.where(scale > 0, scale, 1)), -127, 127) * scale).to(x.dtype)


class RoundedLayer(DynamicLayer):
    """A plain layer that stores (and attends to) `reference_round` of what it is given."""

    def update(self, keys, values, *args, **kwargs):
        return super().update(reference_round(keys), reference_round(values))


def reference_cache(model) -> FullCache:
    cache = FullCache(model.config)
    cache.transformers_cache.layers = [RoundedLayer() for _ in cache.transformers_cache.layers]
    return cache


def filled(model, length: int = 40):
    cache = model.new_cache()
    model.forward(IDS[:length], torch.arange(length), cache)
    return cache


def tree_mask(past: int) -> torch.Tensor:
    """Additive [1, 1, 4, past + 4]: a root with two children, the first with one child."""
    allowed = torch.ones(4, past + 4, dtype=torch.bool)
    allowed[:, past:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    bias = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    return bias[None, None]


def each_forward(step, caches) -> None:
    """`step(ids, positions, mask=None)` at a prefill, a verification, a rollback, a tree and its
    accepted path, and a decode step, the caches trimmed and kept alike between them."""
    step(IDS[:30], torch.arange(30))
    step(IDS[30:36], torch.arange(30, 36))
    for cache in caches:
        cache.trim(33)
    step(IDS[40:44], torch.tensor([33, 34, 34, 35]), tree_mask(33))
    for cache in caches:
        cache.keep(torch.tensor([*range(35), 36]))  # the path root, first child, its child
    step(IDS[45:46], torch.tensor([36]))


def test_the_model_attends_exactly_to_the_dequantized_values():
    """Prefill, a verification, a rollback, a tree and its accepted path, a decode step: at each,
    the logits with the 8-bit cache are those of attention over float64 values rounded to the
    int8 steps (new tokens included), and not those of the unquantized cache."""
    plain = tiny_llama(3)
    model = int8(plain)
    caches = {"int8": model.new_cache(), "reference": reference_cache(plain), "unquantized": plain.new_cache()}

    def step(ids, positions, mask=None):
        logits = {name: plain.forward(ids, positions, cache, mask) for name, cache in caches.items()}
        torch.testing.assert_close(logits["int8"], logits["reference"], rtol=0, atol=1e-12)
        assert (logits["int8"] - logits["unquantized"]).abs().max() > 1e-5  # quantization shows

    each_forward(step, caches.values())
    # Between forwards the cache keeps int8 only: no dequantized copy survives a forward.
    held = [t for layer in caches["int8"].transformers_cache.layers for t in vars(layer).values()
            if isinstance(t, torch.Tensor)]
    assert held and all(t.dtype == torch.int8 for t in held)


@pytest.mark.parametrize("offload_capacity", [None, 64], ids=["on-chip", "offloaded"])
def test_a_token_is_stored_alike_alone_or_in_a_batch(offload_capacity):
    """Plain decoding (one token a forward) and a verification (many) store the same codes and
    scales: a row depends only on its own keys and values."""
    model = TransformersLM(tiny_llama(4).hf, offload_capacity=offload_capacity, kv_dtype="int8")
    batched, alone = filled(model, 30), model.new_cache()
    for position in range(30):
        model.forward(IDS[position:position + 1], torch.tensor([position]), alone)
    for one, other in zip(batched.stored_layers(), alone.stored_layers(), strict=True):
        assert torch.equal(one[0], other[0]) and torch.equal(one[1], other[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_quantization_errs_by_at_most_half_a_step(dtype):
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-6, 4, 50, dtype=torch.float64)[:, None]  # a row's scale spans 10 decades
    x = (torch.randn(3, 2, 50, 16, generator=generator, dtype=torch.float64) * magnitudes).to(dtype)
    codes, scale = quantize(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3, 2, 50, 1)
    assert (codes.abs().amax(-1) == 127).all()  # each row's largest value uses the whole range
    error = (x.double() - dequantize(codes, scale, torch.float64)).abs()
    assert (error <= scale.double() * (0.5 + 1e-5)).all()  # the slack: x / scale computed in float32
    assert torch.equal(unpack(pack(x), dtype), dequantize(codes, scale, dtype))


def test_an_all_zero_row_has_scale_zero_and_dequantizes_to_zeros():
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    x[0, 2] = 0.0
    codes, scale = quantize(x)
    assert scale[0, 2].item() == 0.0 and not codes[0, 2].any()
    back = unpack(pack(x), torch.float64)
    assert torch.isfinite(back).all() and not back[0, 2].any() and (scale[1] > 0).all()


def test_greedy_chain_with_an_8bit_kv_equals_greedy_plain():
    assert_greedy_identity([(seed, int8(tiny_llama(seed))) for seed in range(2)],
                           lambda seed, model: make_decoder("chain"), 30)


def test_greedy_tree_with_an_8bit_kv_equals_greedy_plain_with_a_draft_model():
    assert_greedy_identity([(seed, int8(tiny_llama(seed, weight_scale=8.0))) for seed in range(2)],
                           lambda seed, model: model_tree_decoder(noisy_copy(seed, 0.3, weight_scale=8.0)), 24)


def test_greedy_tree_with_an_8bit_kv_equals_greedy_plain_with_prompt_lookup_branches():
    assert_greedy_identity(
        [(seed, int8(tiny_llama(seed))) for seed in range(2)],
        lambda seed, model: TreeDecoder(SuffixDrafter()),
        24)


# TriForce's middle stage reads a 24-position retrieval cache built from the 8-bit cache's
# dequantized layers; its first stage is a layer-skip draft over a streaming view of them.
SMALL = dict(budget=24, chunk_size=4, recent=8, stride=8, sinks=2, window=16)


@pytest.mark.parametrize("settings", [TriforceSettings(draft="skip1", **SMALL),
                                      TriforceSettings(tree=Tree((-1, 0, 0, 0, 1, 1, 2, 4)), **SMALL)],
                         ids=["chain", "final-tree"])
def test_greedy_triforce_with_an_8bit_kv_equals_greedy_plain(settings):
    assert_greedy_identity([(seed, int8(tiny_llama(seed, weight_scale=8.0))) for seed in range(2)],
                           lambda seed, model: triforce_decoder(model, settings, prefill_chunk=16), 24)


@pytest.mark.slow
@pytest.mark.parametrize("offload_capacity, resident_layers", [(None, 0), (64, 0), (64, 1)],
                         ids=["on-chip", "offloaded", "partly-offloaded"])
def test_sampled_chain_speculation_samples_from_the_8bit_target(offload_capacity, resident_layers):
    """The first three tokens of sampled chain decoding (prompt lookup drafts, accepted and
    rejected) follow the exact sequence distribution of the model with the 8-bit cache, on the
    device, offloaded or partly offloaded (kv/offload.py)."""
    model = TransformersLM(tiny_llama(7, vocab_size=5, weight_scale=20.0).hf, offload_capacity=offload_capacity,
                           kv_dtype="int8", resident_layers=resident_layers)
    prompt, params = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1], SamplingParams(temperature=1.0)
    exact = exact_sequence_probs(model, prompt, params, 3)
    counts = torch.zeros_like(exact)
    drafted = accepted = 0
    for sample in range(1000):
        decoder = ChainDecoder(PromptLookupDrafter(max_ngram=2, min_ngram=1), FixedLookahead(3))
        tokens, steps = run(model, prompt, "chain", SamplingParams(1.0, seed=sample), 3, decoder)
        counts[tuple(tokens)] += 1
        drafted += sum(s.drafted for s in steps)
        accepted += sum(s.accepted for s in steps)
    assert 0.1 * drafted < accepted < 0.9 * drafted
    assert chi_square_p_value(counts, exact) > 1e-3


def test_it_has_every_protocol_member_as_declared(monkeypatch):
    """The protocol tests of every cache (tests/test_kv_protocol.py), on this one."""
    monkeypatch.setattr(test_kv_protocol, "built", lambda kind: (model := int8(tiny_llama(5)), filled(model, 44)))
    test_kv_protocol.test_every_cache_has_every_member_as_declared("int8")
    test_kv_protocol.test_trim_and_keep_change_length_as_declared("int8")


def test_it_is_a_kv_cache_that_trims_and_keeps_codes_with_their_scales():
    model = int8(tiny_llama(5))
    cache = filled(model, 44)
    assert isinstance(cache, KVCache) and isinstance(cache, FullCache)
    layers = cache.layers()
    assert len(layers) == 2 and all(k.shape == v.shape == (1, 2, 44, 8) and k.dtype == torch.float64
                                    for k, v in layers)
    before = [(k.clone(), v.clone()) for k, v in cache.stored_layers()]
    cache.trim(43)
    cache.keep(torch.tensor([*range(40), 41, 42]))  # drop position 40
    assert cache.length == 42
    for (keys, values), (old_keys, old_values) in zip(cache.stored_layers(), before, strict=True):
        for new, old in ((keys, old_keys), (values, old_values)):
            assert torch.equal(new[:, :, :40], old[:, :, :40]) and torch.equal(new[:, :, 40:], old[:, :, 41:43])
    assert cache.nbytes == 2 * 2 * (1 * 2 * 42 * (8 + 4))  # layers, keys and values, each [1, 2, 42, 8 + 4]
    with pytest.raises(ValueError):
        cache.trim(43)


def test_it_holds_about_half_the_bytes_of_a_bf16_cache():
    """At Llama's head_dim of 128: 128 codes and a 4-byte scale per row against 256 bytes."""
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                         num_hidden_layers=2, max_position_embeddings=512)
    layers = [(torch.randn(1, 1, 300, 128, dtype=torch.bfloat16), torch.randn(1, 1, 300, 128, dtype=torch.bfloat16))
              for _ in range(2)]
    full, quantized = FullCache.from_layers(config, layers), Int8Cache.from_layers(config, layers)
    assert quantized.nbytes == 2 * 2 * 300 * (128 + 4)
    assert quantized.nbytes / full.nbytes == pytest.approx(0.516, abs=1e-3)
    assert quantized.layers()[0][0].dtype == torch.bfloat16


def test_a_prefix_copy_is_independent_and_the_prefix_store_hands_out_8bit_caches():
    model = int8(tiny_llama(6))
    cache = filled(model, 40)
    copy = cache.clone_prefix(30)
    assert isinstance(copy, Int8Cache) and copy.length == 30 and copy.nbytes == cache.nbytes * 30 // 40
    cache.trim(30)
    model.forward(IDS[41:45], torch.arange(30, 34), cache)  # overwrites slots 30-33 of the original
    for (keys, _), (original, _) in zip(copy.stored_layers(), cache.stored_layers(30), strict=True):
        assert torch.equal(keys, original)
    store = PrefixStore(10**9)
    store.put(IDS[:30].tolist() + IDS[41:45].tolist(), cache)
    taken, length = store.take(IDS[:32].tolist())
    assert isinstance(taken, Int8Cache) and length == 30 and taken is not cache


def test_a_saved_document_reloads_bit_for_bit(tmp_path):
    model = int8(tiny_llama(2))
    cache, ids = filled(model, 40), IDS[:40].tolist()
    store = DocumentStore(tmp_path, "tiny:float64:kv-int8", 10**9)
    store.save(ids, cache)
    loaded = store.load(ids + [7, 8], model.new_cache, at_least=0)
    assert loaded is not None and loaded.length == 40 and isinstance(loaded.cache, Int8Cache)
    for one, other in zip(loaded.cache.stored_layers(), cache.stored_layers(), strict=True):
        assert torch.equal(one[0], other[0]) and torch.equal(one[1], other[1])
    new, positions = torch.tensor([7, 8]), torch.arange(40, 42)
    assert torch.equal(model.forward(new, positions, loaded.cache), model.forward(new, positions, cache))
    # The same file offered to an unquantized model's cache does not fit its shapes: rejected.
    assert store.load(ids + [7], tiny_llama(2).new_cache, at_least=0) is None
    assert "shapes do not match" in store.take_problems()[0]


@pytest.mark.parametrize("offload_capacity", [None, 64], ids=["on-chip", "offloaded"])
def test_a_forward_stopped_between_layers_is_rolled_back(offload_capacity):
    model = TransformersLM(tiny_llama(1).hf, offload_capacity=offload_capacity, kv_dtype="int8")
    cache, flag = filled(model, 20), threading.Event()
    hook = model.hf.base_model.layers[0].register_forward_hook(lambda *_: flag.set())
    try:
        with pytest.raises(Cancelled), stop_between_layers(model, cache, flag):
            model.forward(IDS[20:30], torch.arange(20, 30), cache)
    finally:
        hook.remove()
    assert cache.length == 20 and [layer.get_seq_length() for layer in cache.transformers_cache.layers] == [20, 20]
    torch.testing.assert_close(model.forward(IDS[20:30], torch.arange(20, 30), cache),
                               model.forward(IDS[:30], torch.arange(30), model.new_cache())[20:], rtol=0, atol=1e-12)


def test_load_options_ask_for_it(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = TransformersLM.from_pretrained(tmp_path, LoadOptions("float32", "cpu", None, None, kv_dtype="int8"))
    cache = model.new_cache()
    assert isinstance(cache, Int8Cache) and cache.dtype == torch.float32
    assert type(TransformersLM.from_pretrained(tmp_path, LoadOptions("float32", "cpu", None, None)).new_cache()) \
        is FullCache
    offloaded = TransformersLM(model.hf, offload_capacity=64, kv_dtype="int8").new_cache()
    assert isinstance(offloaded, OffloadedCache) and offloaded.int8 and offloaded.capacity == 64
    with pytest.raises(ValueError, match="kv_dtype"):
        TransformersLM(model.hf, kv_dtype="int4")
    sliding = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                          sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        Int8Cache(sliding, torch.float32)


def test_an_engine_reuses_8bit_caches_from_memory_and_from_disk(tiny_model_dir, tmp_path):
    """Asked for through `LoadOptions`: a follow-up reuses the answer's 8-bit cache, a saved
    document reloads in a new engine, and both answer as from scratch."""
    model = TransformersLM.from_pretrained(tiny_model_dir, LoadOptions("float64", "cpu", None, None, kv_dtype="int8"))
    parts = (model, AutoTokenizer.from_pretrained(tiny_model_dir))

    def store():
        return DocumentStore(tmp_path, "tiny@1:float64:kv-int8", UNLIMITED)

    engine = engine_with(parts, documents=store())
    saved = document_tokens(engine, [], DOCUMENT)
    first, _ = answer(engine, conversation("")[:1], "chain", document_tokens=saved)
    messages = conversation(first.text)
    follow_up, _ = answer(engine, messages, "chain")
    assert follow_up.stats.reused_from == "memory"
    assert isinstance(engine.prefixes.take(engine.chat_ids(messages))[0], Int8Cache)  # what it kept
    assert follow_up.token_ids == answer(engine_with(parts), messages, "chain")[0].token_ids
    question = [{"role": "user", "content": user_turn("Which line comes last?", DOCUMENT)}]
    restarted, notices = answer(engine_with(parts, documents=store()), question, "tree")
    assert restarted.stats.reused_from == "disk" and restarted.stats.reused_prompt_tokens == saved and notices == []
    assert restarted.token_ids == answer(engine_with(parts), question, "tree")[0].token_ids


def test_a_retrieval_rebuild_dequantizes_the_8bit_kv_a_layer_at_a_time(monkeypatch):
    """Over an 8-bit KV on the GPU, the whole KV in the model's dtype would be twice its codes:
    the rebuild holds one layer's dequantized keys and values (and the last layer's) at a time,
    and selects what a build over the dequantized layers selects."""
    import weakref

    from specchat.core.kv.retrieval import RetrievalCache

    model = int8(tiny_llama(7, layers=6))
    cache = filled(model, 40)
    queries = {layer: torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(layer))
               for layer in range(6)}
    expected = RetrievalCache.build(model.hf.config, cache.layers(), queries, budget=24, chunk_size=4, recent=8)
    seen, most_alive = Int8Cache._seen, []
    made: list[weakref.ref] = []

    def counted(self, rows):
        dequantized = seen(self, rows)
        made.append(weakref.ref(dequantized))
        most_alive.append(sum(ref() is not None for ref in made))
        return dequantized
    monkeypatch.setattr(Int8Cache, "_seen", counted)
    built = RetrievalCache.from_full(cache, queries, budget=24, chunk_size=4, recent=8, device=torch.device("cpu"))
    assert len(made) == 12 and max(most_alive) <= 4  # the whole list: 12
    for (keys, values), (expected_keys, expected_values) in zip(built.layers(), expected.layers(), strict=True):
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
