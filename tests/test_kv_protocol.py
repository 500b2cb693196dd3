"""Every cache implements `KVCache` (core/kv/cache.py) as declared: each member is there with the
declared signature, `nbytes` is the bytes of the keys and values it holds, and `trim` and `keep`
change `length` as the protocol says. On tiny random models, on the CPU."""

import inspect
import typing

import pytest
import torch

from conftest import tiny_llama
from specchat.core.kv.cache import KVCache
from specchat.core.kv.full import FullCache
from specchat.core.kv.offload import OffloadedCache
from specchat.core.kv.retrieval import RetrievalCache
from specchat.core.kv.streaming import StreamingCache

KINDS = ("full", "offloaded", "retrieval", "streaming")
MEMBERS = {"config", "transformers_cache", "length", "nbytes", "trim", "keep", "layers"}


def built(kind: str):
    """(model, cache) after forwards of a few tokens: 40 committed, then 4 new (for the retrieval
    and streaming caches, after their build or compaction), so every kind holds positions 40-43
    in its last four slots, and may drop any of them."""
    model = tiny_llama(5)
    ids = torch.arange(3, 43) % 97
    if kind == "full":
        cache = model.new_cache()
    elif kind == "offloaded":
        cache = OffloadedCache(model.config, 64, "cpu", model.dtype)
    elif kind == "retrieval":
        full = model.new_cache()
        _, queries = model.forward_with_queries(ids, torch.arange(len(ids)), full)
        queries = {layer: q[0, :, -1] for layer, q in queries.items()}
        cache = RetrievalCache.build(model.config, full.layers(), queries, budget=24, chunk_size=4, recent=8)
    else:
        cache = StreamingCache(model.config, sinks=2, window=6)
    if kind != "retrieval":
        model.forward(ids, torch.arange(len(ids)), cache)
    if kind == "streaming":
        cache.compact()
    model.forward(torch.tensor([7, 8, 9, 10]), torch.arange(40, 44), cache)
    assert cache.length == 44
    return model, cache


def slots_held(cache) -> int:
    """How many slots the cache holds, from each kind's own bookkeeping (not from its tensors)."""
    if isinstance(cache, RetrievalCache):
        return cache.base_slots + cache.length - cache.base_length
    if isinstance(cache, StreamingCache):
        return cache.slots
    return cache.length


def expected_nbytes(model, cache) -> int:
    """Keys and values of every layer: [1, kv_heads, slots, head_dim] each, from the config."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_tensor = config.num_key_value_heads * slots_held(cache) * head_dim * model.dtype.itemsize
    return config.num_hidden_layers * 2 * per_tensor


def test_the_protocol_declares_what_callers_use():
    declared = {name for name in [*vars(KVCache), *KVCache.__annotations__] if not name.startswith("_")}
    assert declared == MEMBERS


@pytest.mark.parametrize("kind", KINDS)
def test_every_cache_has_every_member_as_declared(kind):
    model, cache = built(kind)
    assert isinstance(cache, KVCache)
    hints = typing.get_type_hints(KVCache)
    for name in MEMBERS:
        declared = inspect.getattr_static(KVCache, name, None)
        if isinstance(declared, property):
            assert isinstance(inspect.getattr_static(type(cache), name), property), name
            assert type(getattr(cache, name)) is int, name
        elif callable(declared):
            wanted = [p for p in inspect.signature(declared).parameters.values() if p.name != "self"]
            # Called as the protocol calls it: positionally, with its parameters and no others.
            inspect.signature(getattr(cache, name)).bind(*wanted)
        else:
            assert isinstance(getattr(cache, name), hints[name]), name
    layers = cache.layers()
    assert len(layers) == model.config.num_hidden_layers
    assert all(keys.shape[2] == values.shape[2] == slots_held(cache) for keys, values in layers)


@pytest.mark.parametrize("kind", KINDS)
def test_nbytes_is_the_bytes_of_the_keys_and_values_held(kind):
    model, cache = built(kind)

    def bytes_check():
        held = sum(t.numel() * t.element_size() for pair in cache.layers() for t in pair)
        assert cache.nbytes == held == expected_nbytes(model, cache)

    bytes_check()
    cache.trim(43)
    bytes_check()
    cache.keep(torch.cat([torch.arange(41), torch.tensor([42])]))
    bytes_check()


@pytest.mark.parametrize("kind", KINDS)
def test_trim_and_keep_change_length_as_declared(kind):
    model, cache = built(kind)
    cache.trim(43)
    assert cache.length == 43
    before = [(keys.clone(), values.clone()) for keys, values in cache.layers()]
    cache.keep(torch.cat([torch.arange(41), torch.tensor([42])]))  # drop position 41
    assert cache.length == 42
    for (keys, values), (old_keys, old_values) in zip(cache.layers(), before, strict=True):
        # Position 42 moved to 41, the last slot; the slot before it still holds position 40.
        for new, old in ((keys, old_keys), (values, old_values)):
            assert torch.equal(new[:, :, -1], old[:, :, -1]) and torch.equal(new[:, :, -2], old[:, :, -3])
    cache.trim(42)  # to its length: nothing changes
    assert cache.length == 42
    model.forward(torch.tensor([11]), torch.tensor([42]), cache)
    assert cache.length == 43


def test_an_empty_cache_holds_no_bytes():
    model = tiny_llama(5)
    for cache in (FullCache(model.config), OffloadedCache(model.config, 8, "cpu", model.dtype),
                  StreamingCache(model.config, sinks=2, window=6)):
        assert cache.length == 0 and cache.nbytes == 0


def test_a_streaming_cache_keeps_only_positions_it_holds():
    _, cache = built("streaming")  # holds 0, 1 and 34 .. 43
    with pytest.raises(ValueError):
        cache.keep(torch.cat([torch.arange(20), torch.tensor([25])]))
    cache.keep(torch.cat([torch.arange(36), torch.tensor([40])]))
    assert (cache.length, cache.slots) == (37, 5)  # 0, 1, 34, 35, and 40 now at 36
