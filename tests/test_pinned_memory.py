"""Pinned memory an offloaded KV holds: its host rows packed into blocks whose sizes are powers of
two (PyTorch's pinned allocator rounds every block up to one and keeps it: one block per layer
would pin up to twice the KV), the plan counting the same bytes, and what a dropped model held
given back before the next one loads."""

import torch

from conftest import tiny_llama
from test_plan import PROFILES, REGISTRY
from specchat.core import loading, memory_release
from specchat.core.kv.offload import OffloadedCache
from specchat.core.kv.slabs import pinned_bytes, slabs
from specchat.core.planning import make_plan

MIB = 2**20


def test_blocks_are_powers_of_two_and_waste_little():
    # An 8-bit row of 132 bytes: a 128K layer's keys are 132 MiB, which one block each pins as 256.
    layout = slabs(132 * MIB, 64)
    assert layout == ((4096 * MIB, 31), (4096 * MIB, 31), (512 * MIB, 2))
    assert pinned_bytes(132 * MIB, 64) <= 1.04 * 64 * 132 * MIB
    # Sizes that are powers of two already: one block each, nothing lost.
    assert slabs(256 * MIB, 4) == ((256 * MIB, 1),) * 4
    for size, count in ((3, 5), (1000, 7), (192 * MIB, 60), (132 * MIB, 6)):
        layout = slabs(size, count)
        assert sum(held for _, held in layout) == count
        assert all(block & (block - 1) == 0 and held * size <= block for block, held in layout)
        assert pinned_bytes(size, count) <= count * (1 << (size - 1).bit_length())  # never above a block each
    assert slabs(100, 0) == () and pinned_bytes(100, 0) == 0


def test_the_cache_s_host_rows_share_the_blocks_and_the_plan_counts_them():
    model = tiny_llama(0, layers=4)
    cache = OffloadedCache(model.config, 100, "cpu", model.dtype, int8=True, resident_layers=1)
    rows = [tensor for layer in cache.streamed for tensor in cache._rows[layer]]
    row_bytes = rows[0].numel() * rows[0].element_size()  # 2 KV heads x 100 positions x (8 + 4) bytes
    assert row_bytes == 2 * 100 * 12 and all(tensor.shape == rows[0].shape for tensor in rows)
    blocks = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in rows}
    assert sum(blocks.values()) == pinned_bytes(row_bytes, 6) < 6 * 4096  # not a block each
    # The plan's pinned item: the 8 GB laptop's 8-bit KV at 128K, fully streamed.
    plan = make_plan(PROFILES["laptop-rtx4060-8gb"], REGISTRY.get("llama3.1-8b"), 131072)
    assert (plan.kv_dtype, plan.kv_device, plan.kv_resident_layers) == ("int8", "cpu-pinned", 0)
    pinned = sum(item.bytes for item in plan.memory if item.where == "cpu" and "pinned" in item.what)
    per_tensor = 131072 * 8 * (128 + 4)
    assert pinned == pinned_bytes(per_tensor, 64) < 1.04 * 64 * per_tensor


def test_what_a_dropped_model_held_is_given_back_before_the_next_loads(monkeypatch, tiny_model_dir, tmp_path):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("gpu"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("pinned"), raising=False)
    memory_release.release_cached_memory()
    assert calls == ["gpu", "pinned"]
    monkeypatch.undo()
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    released = []
    monkeypatch.setattr(loading, "release_cached_memory", lambda: released.append(True))
    loading.load_engine(str(tiny_model_dir), progress=lambda line: None, calibrate_when_idle=True)
    assert released == [True]
