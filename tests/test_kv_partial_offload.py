"""A partial offload (core/kv/offload.py with `resident_layers`): the layers whose KV fits keep it
on the GPU, the others' is streamed. On the CPU every layer lies in place, so these tests hold the
bookkeeping (which layers stream, what each prefetches, the plan's count reaching the cache) and
every decoder's losslessness over such a cache, in the compute dtype and in 8 bits; the CUDA tests
check the streaming itself (the resident layers never cross the link)."""

import pytest
import torch

from conftest import needs_cuda, tiny_llama
from test_decoding import assert_greedy_identity, run
from test_kv_caches import PREFILL_CHUNK, prompts
from test_kv_int8 import IDS, SMALL, each_forward
from test_plan import PROFILES, REGISTRY
from specchat.core.decoding import TreeDecoder, TriforceSettings, make_decoder, triforce_decoder
from specchat.core.kv.full import FullCache
from specchat.core.kv.int8 import Int8Cache
from specchat.core.kv.offload import OffloadedCache, following_fetch, streamed_layers
from specchat.core.model import TransformersLM
from specchat.core.placement import target_options
from specchat.core.planning import Overrides, make_plan
from specchat.core.sampling import SamplingParams
from specchat.core.speculative.suffix_drafter import SuffixDrafter
from specchat.core.speculative.tree import Tree

CAPACITY = 160


def partly_offloaded(model: TransformersLM, resident: int, int8: bool = False) -> TransformersLM:
    """The same weights, `resident` layers' KV kept where the model computes, the others' offloaded."""
    return TransformersLM(model.hf, offload_capacity=CAPACITY, kv_dtype="int8" if int8 else None,
                          resident_layers=resident)


def test_the_streamed_layers_are_spread_evenly_the_last_among_them():
    assert streamed_layers(4, 0) == (0, 1, 2, 3)
    assert streamed_layers(4, 4) == ()
    assert streamed_layers(32, 24) == (3, 7, 11, 15, 19, 23, 27, 31)
    assert streamed_layers(32, 31) == (31,)
    spread = streamed_layers(32, 13)
    assert len(spread) == 19 and spread[-1] == 31
    assert {b - a for a, b in zip(spread, spread[1:])} == {1, 2}  # never two resident layers in a row
    with pytest.raises(ValueError, match="5 resident layers of 4"):
        streamed_layers(4, 5)


def test_each_streamed_layer_prefetches_the_next_and_the_last_the_first_of_the_next_forward():
    """A forward stores positions 10..12: the next streamed layer in it sees 10 positions before
    them; the first streamed layer of the next forward sees 12."""
    assert following_fetch((0, 1, 2), 0, 10, 12) == (1, 10)  # every layer streamed, as before
    assert following_fetch((0, 1, 2), 2, 10, 12) == (0, 12)
    assert following_fetch((1, 3), 1, 10, 12) == (3, 10)
    assert following_fetch((1, 3), 3, 10, 12) == (1, 12)
    assert following_fetch((3,), 3, 10, 12) == (3, 12)


@pytest.mark.parametrize("int8", [False, True], ids=["compute-dtype", "8-bit"])
@pytest.mark.parametrize("resident", [1, 2])
def test_it_attends_to_and_holds_what_the_on_chip_cache_does(resident, int8):
    """Prefill, a verification, a rollback, a tree and its accepted path, a decode step: the logits
    and the stored rows are those of the cache on the device (bit for bit)."""
    plain = tiny_llama(3, layers=3)
    model = partly_offloaded(plain, resident, int8)
    caches = {"partial": model.new_cache(),
              "on-chip": Int8Cache(plain.config, plain.dtype) if int8 else FullCache(plain.config)}
    assert isinstance(caches["partial"], OffloadedCache)
    assert caches["partial"].streamed == streamed_layers(3, resident)

    def step(ids, positions, mask=None):
        logits = {name: plain.forward(ids, positions, cache, mask) for name, cache in caches.items()}
        assert torch.equal(logits["partial"], logits["on-chip"])
        for (keys, values), (chip_keys, chip_values) in zip(caches["partial"].stored_layers(),
                                                            caches["on-chip"].stored_layers(), strict=True):
            assert torch.equal(keys, chip_keys) and torch.equal(values, chip_values)

    each_forward(step, caches.values())
    assert caches["partial"].nbytes == caches["on-chip"].nbytes


def test_the_plan_s_resident_layers_reach_the_cache():
    """The 3090 at 128K, exact: bf16 weights, 2 of 32 layers' KV on the GPU (test_plan_candidates);
    the loader's options carry the count, the model's cache streams the others."""
    pair = REGISTRY.get("llama3.1-8b")
    plan = make_plan(PROFILES["rtx3090-24gb-32gb"], pair, 131072, Overrides(precision="exact"))
    options = target_options(plan, pair.target)
    assert (options.offload_capacity, options.resident_layers) == (131072, plan.kv_resident_layers) == (131072, 2)
    model = TransformersLM(tiny_llama(0).hf, offload_capacity=64, resident_layers=1)
    assert model.new_cache().streamed == (1,)


def test_greedy_chain_trees_and_triforce_equal_greedy_plain():
    models = [(seed, partly_offloaded(tiny_llama(seed), 1)) for seed in range(2)]
    assert_greedy_identity(models, lambda seed, model: make_decoder("chain"), 30)
    assert_greedy_identity(models, lambda seed, model: TreeDecoder(SuffixDrafter()), 24)
    model = partly_offloaded(tiny_llama(4, weight_scale=8.0), 1, int8=True)
    prompt = prompts(4)["n-gram hits"]
    plain, _ = run(model, prompt, "plain", SamplingParams(), 30)
    for settings in (TriforceSettings(draft="skip1", **SMALL), TriforceSettings(tree=Tree((-1, 0, 0, 1, 1, 3)), **SMALL)):
        speculative, _ = run(model, prompt, "triforce", SamplingParams(), 30,
                             triforce_decoder(model, settings, prefill_chunk=PREFILL_CHUNK))
        assert speculative == plain


def _like_on_chip(model: TransformersLM, resident: int, int8: bool) -> OffloadedCache:
    """A prefill, a verification, a rollback and a tree's path, then a step, on a cache with
    `resident` layers on the GPU: its logits are the on-chip cache's (to float32's rounding: the
    kernels may differ with the tensors' strides)."""
    streamed = partly_offloaded(model, resident, int8).new_cache()
    chip = Int8Cache(model.config, model.dtype) if int8 else FullCache(model.config)

    def step(ids, positions, mask=None):
        torch.testing.assert_close(model.forward(ids, positions, streamed, mask),
                                   model.forward(ids, positions, chip, mask))

    each_forward(step, (streamed, chip))
    return streamed


@needs_cuda
@pytest.mark.parametrize("int8", [False, True], ids=["compute-dtype", "8-bit"])
def test_on_cuda_the_resident_layers_stay_on_the_gpu_and_only_the_others_cross_the_link(int8):
    model = tiny_llama(3, dtype=torch.float32, layers=3)
    model.to("cuda")
    all_streamed, partial = _like_on_chip(model, 0, int8), _like_on_chip(model, 2, int8)
    assert partial.streamed == (2,)
    assert [keys.is_cuda for keys, _ in partial._rows] == [True, True, False] and partial._rows[2][0].is_pinned()
    # The same forwards fetch each streamed layer alike: one layer of three crossed the link.
    assert all_streamed.fetched_bytes == 3 * partial.fetched_bytes > 0


@needs_cuda
def test_on_cuda_greedy_triforce_over_a_partial_offload_equals_plain():
    model = tiny_llama(4, dtype=torch.float32, weight_scale=8.0, layers=3)
    model.to("cuda")
    prompt = prompts(4)["n-gram hits"]
    plain, _ = run(model, prompt, "plain", SamplingParams(), 30)
    partial = partly_offloaded(model, 1)
    settings = TriforceSettings(draft="skip1", **SMALL)
    speculative, _ = run(partial, prompt, "triforce", SamplingParams(), 30,
                         triforce_decoder(partial, settings, prefill_chunk=PREFILL_CHUNK))
    assert speculative == plain
