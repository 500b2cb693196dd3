"""The 8-bit KV's fused attention (core/kv/int8_kernel.py, routed by core/kv/int8_attention.py): the
Triton kernel reads the packed rows and attends exactly to their dequantized values.

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
where there is no CUDA): float32 and float16 queries, as the interpreter computes bf16 dot products
wrongly (Triton 3.7.1 and 3.9); bf16 runs in the CUDA tests."""

import pytest
import torch

from conftest import needs_cuda, route_on_cpu, tiny_llama
from test_decoding import assert_greedy_identity
from test_kv_int8 import IDS, SMALL, each_forward, filled, reference_cache
from test_tree_decoding import model_tree_decoder, noisy_copy
from specchat.core.decoding import TriforceSettings, make_decoder, triforce_decoder
from specchat.core.kv import int8_attention
from specchat.core.kv.int8_rows import pack, unpack
from specchat.core.model import TransformersLM
from specchat.core.speculative.tree import Tree

int8_kernel = pytest.importorskip("specchat.core.kv.int8_kernel", reason="Triton is not installed")


def packed_rows(kv_heads: int, length: int, head_dim: int, spare: int = 37, seed: int = 0):
    """Packed keys and values [kv_heads, length, head_dim + 4], views of buffers with spare
    capacity, as a cache holds them."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(2):
        buffer = torch.zeros(kv_heads, length + spare, head_dim + 4, dtype=torch.int8)
        buffer[:, :length] = pack(torch.randn(kv_heads, length, head_dim, generator=generator) * 3)
        rows.append(buffer[:, :length])
    return rows


def reference(queries, key_rows, value_rows, scale):
    """Softmax attention in float64 over the dequantized rows: (out, lse)."""
    keys, values = unpack(key_rows, torch.float64), unpack(value_rows, torch.float64)
    scores = queries.double() @ keys.transpose(-1, -2) * scale
    return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)


@pytest.mark.parametrize("kv_heads, rows, length, head_dim, dtype, tolerance", [
    (2, 3, 300, 64, torch.float32, 1e-5),  # a decode step of a 3-head group; 5 splits, the last partial
    (2, 20, 1000, 128, torch.float32, 1e-5),  # a 5-token verification of a 4-head group
    (1, 6, 70, 80, torch.float32, 1e-5),  # a head size that is no power of two
    (3, 256, 200, 64, torch.float32, 1e-5),  # the most rows the route sends: 4 row blocks
    (2, 4, 500, 64, torch.float16, 2e-3),
    (2, 64, 3000, 128, torch.float16, 2e-3),
])
def test_the_kernel_attends_exactly_to_the_dequantized_rows(kv_heads, rows, length, head_dim, dtype, tolerance):
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(kv_heads, rows, head_dim, generator=generator).to(dtype)
    key_rows, value_rows = packed_rows(kv_heads, length, head_dim)
    out, lse = int8_kernel.attend_packed(queries, key_rows, value_rows, head_dim ** -0.5)
    expected_out, expected_lse = reference(queries, key_rows, value_rows, head_dim ** -0.5)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected_out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=tolerance, atol=tolerance)


def masked_reference(queries, key_rows, value_rows, scale, allowed):
    """`reference` where the last n rows are new tokens under `allowed` [n, n]; query row r is
    token r mod n (a group's heads folded with the tokens)."""
    n, (rows, length) = allowed.shape[0], (queries.shape[1], key_rows.shape[1])
    visible = torch.ones(rows, length, dtype=torch.bool)
    visible[:, length - n:] = allowed[torch.arange(rows) % n]
    keys, values = unpack(key_rows, torch.float64), unpack(value_rows, torch.float64)
    scores = (queries.double() @ keys.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)


# 581: the last of 4 splits (192 positions each here) starts at new row 3, so some rows see none
# of its positions (a split empty for a row must weigh nothing, not make NaN).
@pytest.mark.parametrize("length, on_device", [(40, False), (581, False), (700, False), (581, True), (700, True)])
def test_the_kernel_attends_the_new_rows_under_their_mask(length, on_device):
    """An 8-node tree verification of a 3-head group after a past of length - 8: every row sees
    the past and only its token's ancestors and itself among the new rows; with the past read from
    the device the buffer's spare slots after the new rows are not read."""
    from test_hierarchy import TREE
    allowed = TREE.ancestors
    n = allowed.shape[0]
    generator = torch.Generator().manual_seed(7)
    queries = torch.randn(2, 3 * n, 64, generator=generator)
    key_rows, value_rows = packed_rows(2, length, 64, spare=50)
    if on_device:  # the whole buffer, spare slots poisoned: a scale of 3.4e38
        key_rows, value_rows = (rows._base if rows._base is not None else rows for rows in (key_rows, value_rows))
        key_rows[:, length:], value_rows[:, length:] = 127, 127
        past = torch.tensor([length - n], dtype=torch.int32)
        out, lse = int8_kernel.attend_packed(queries, key_rows, value_rows, 0.125, n, allowed, past=past)
        key_rows, value_rows = key_rows[:, :length], value_rows[:, :length]
    else:
        out, lse = int8_kernel.attend_packed(queries, key_rows, value_rows, 0.125, n, allowed)
    expected_out, expected_lse = masked_reference(queries, key_rows, value_rows, 0.125, allowed)
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)


def test_the_split_count_covers_every_position_once(monkeypatch):
    """One split and many (32: two iterations of the merge's 16) give the same attention: none
    drops or repeats a block."""
    queries = torch.randn(2, 4, 64)
    key_rows, value_rows = packed_rows(2, 2000, 64)
    monkeypatch.setattr(int8_kernel, "PROGRAMS_PER_CPU_RUN", 1)
    one = int8_kernel.attend_packed(queries, key_rows, value_rows, 0.125)
    monkeypatch.setattr(int8_kernel, "PROGRAMS_PER_CPU_RUN", 64)
    many = int8_kernel.attend_packed(queries, key_rows, value_rows, 0.125)
    for single, split in zip(one, many):
        torch.testing.assert_close(single, split, rtol=0, atol=1e-5)


def rows_to_pack(dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """[2, 40, 64] keys or values as attention hands them over (a transposed view), with the rows
    packing is hard on: all zeros, exact halfway ratios (absmax 127: scale 1, so 2.5 -> 2, 3.5 ->
    4, -2.5 -> -2, half to even), and values so small that the scale is subnormal in float32
    (float32 on the CPU: Triton's interpreter (3.7.1, 3.9) converts subnormal bf16 wrongly; float16 cannot
    hold them)."""
    generator = torch.Generator().manual_seed(5)
    states = (torch.randn(40, 2, 64, generator=generator) * 4).transpose(0, 1)
    states[0, 3] = 0.0
    states[1, 7] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5, -0.5, 1.5, 126.5] * 8)
    if dtype == torch.float32 or (device == "cuda" and dtype == torch.bfloat16):
        states[0, 11] = torch.linspace(-1e-37, 1e-37, 64)
    return states.to(device, dtype)


def assert_packs_as_torch(dtype: torch.dtype, device: str = "cpu") -> None:
    """From a slot on (an eager forward) and at slots read from a tensor (a replayable step): the
    codes and scale bytes of kv/int8_rows.py's `pack`, and nothing outside those slots."""
    states = rows_to_pack(dtype, device)
    expected = pack(states)
    for at in (5, torch.arange(40, device=device).flip(0) * 2 + 3):
        rows = torch.full((2, 90, 68), 0x55, dtype=torch.int8, device=device)
        int8_kernel.pack_rows(states, rows, at)
        slots = torch.arange(5, 45, device=device) if isinstance(at, int) else at
        assert torch.equal(rows[:, slots], expected)
        untouched = torch.ones(90, dtype=torch.bool, device=device)
        untouched[slots] = False
        assert (rows[:, untouched] == 0x55).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_packing_kernel_writes_the_bits_torch_packs(dtype):
    assert_packs_as_torch(dtype)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The route on the CPU; yields each kernel call's tensor shapes (the keys' second: positions).
    One split a call: the interpreter's cost is per program, and a whole model's forwards would
    take minutes with eight splits and their merge (the kernel-level tests above split and merge)."""
    monkeypatch.setattr(int8_kernel, "PROGRAMS_PER_CPU_RUN", 1)
    return route_on_cpu(monkeypatch, int8_attention.ROUTE, int8_kernel, "attend_packed")


def int8_fp32(seed: int, **kwargs) -> TransformersLM:
    return TransformersLM(tiny_llama(seed, dtype=torch.float32, **kwargs).hf, kv_dtype="int8")


def test_the_model_attends_exactly_to_the_dequantized_values_through_the_kernel(fused_on_cpu):
    """Prefill, a verification, a rollback, a tree and its accepted path, a decode step: the
    logits through the kernel are those of attention over values rounded to the int8 steps; the
    verification, the tree and the decode step went through it (the prefill has no past)."""
    model = int8_fp32(3)
    caches = {"int8": model.new_cache(), "reference": reference_cache(model.hf)}

    def step(ids, positions, mask=None):
        logits = {name: model.forward(ids, positions, cache, mask) for name, cache in caches.items()}
        torch.testing.assert_close(logits["int8"], logits["reference"], rtol=0, atol=1e-5)

    each_forward(step, caches.values())
    layers = model.hf.config.num_hidden_layers
    assert [shapes[1][1] for shapes in fused_on_cpu] == [36] * layers + [37] * layers + [37] * layers  # past and new


def test_a_prefill_chunk_and_a_hidden_past_take_the_dequantized_path(fused_on_cpu):
    model = int8_fp32(0)
    cache = filled(model, 40)
    model.forward(IDS[:2], torch.tensor([40, 41]), cache,
                  torch.ones(1, 1, 2, 42, dtype=torch.bool).tril(40).logical_and(torch.arange(42) != 5))
    rows = 2 * (int8_attention.MAX_ROWS // 4 + 1)  # past MAX_ROWS once folded with the group of 2
    model.forward(torch.arange(rows) % 97, torch.arange(42, 42 + rows), cache)
    assert fused_on_cpu == []


def test_heads_past_128_or_not_a_multiple_of_4_keep_the_dequantized_path(fused_on_cpu):
    cpu = torch.device("cpu")
    assert int8_attention.reads_packed(cpu, torch.float32, 128) and int8_attention.reads_packed(cpu, torch.float16, 8)
    assert not int8_attention.reads_packed(cpu, torch.float32, 256)  # its tiles would pass 99 KB of shared memory
    assert not int8_attention.reads_packed(cpu, torch.float32, 70)
    assert not int8_attention.reads_packed(cpu, torch.float64, 64)


def test_a_kernel_that_fails_leaves_the_dequantized_path_with_the_reason(fused_on_cpu, monkeypatch):
    model = int8_fp32(1)

    def broken(*args, **kwargs):
        raise RuntimeError("PTX .version 9.0 does not support .target sm_120")

    monkeypatch.setattr(int8_kernel, "attend_packed", broken)
    cache = filled(model, 30)
    logits = model.forward(IDS[30:40], torch.arange(30, 40), cache)
    cpu = torch.device("cpu")
    assert "sm_120" in int8_attention.ROUTE.describe(cpu, torch.float32)
    assert not int8_attention.reads_packed(cpu, torch.float32, 8)
    monkeypatch.setattr(int8_attention.ROUTE, "devices", {"cuda"})
    reference_logits = model.forward(IDS[30:40], torch.arange(30, 40), filled(model, 30))
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=0)


def test_a_cache_packed_by_the_kernel_holds_what_torch_packs(fused_on_cpu, monkeypatch):
    """A prefill and a decode step with the route on: the kernel packed every new key and value,
    bit for bit as torch does with the route off; a packing kernel that fails leaves torch's
    packing, same bits, with the reason kept. (Attention takes the dequantized path throughout:
    the kernel's rounding would change later layers' keys.)"""
    model = int8_fp32(2)
    packed_calls = route_on_cpu(monkeypatch, int8_attention.ROUTE, int8_kernel, "pack_rows")
    monkeypatch.setattr(int8_attention, "attend", lambda *args: None)

    def stored(cache):
        model.forward(IDS[:30], torch.arange(30), cache)
        model.forward(IDS[30:31], torch.tensor([30]), cache)
        return cache.stored_layers()

    through_kernel = stored(model.new_cache())
    assert len(packed_calls) == 2 * 2 * model.hf.config.num_hidden_layers  # keys and values, two forwards
    monkeypatch.setattr(int8_attention.ROUTE, "devices", {"cuda"})
    for (keys, values), (torch_keys, torch_values) in zip(through_kernel, stored(model.new_cache()), strict=True):
        assert torch.equal(keys, torch_keys) and torch.equal(values, torch_values)

    def broken(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(int8_attention.ROUTE, "devices", {"cuda", "cpu"})
    monkeypatch.setattr(int8_kernel, "pack_rows", broken)
    for (keys, values), (torch_keys, torch_values) in zip(stored(model.new_cache()), through_kernel, strict=True):
        assert torch.equal(keys, torch_keys) and torch.equal(values, torch_values)
    assert "shared memory" in int8_attention.ROUTE.describe(torch.device("cpu"), torch.float32)


def test_greedy_chain_through_the_kernel_equals_greedy_plain(fused_on_cpu):
    assert_greedy_identity([(0, int8_fp32(0))], lambda seed, model: make_decoder("chain"), 16)
    assert fused_on_cpu


def test_greedy_tree_through_the_kernel_equals_greedy_plain(fused_on_cpu):
    assert_greedy_identity([(1, int8_fp32(1, weight_scale=8.0))],
                           lambda seed, model: model_tree_decoder(noisy_copy(seed, 0.3, weight_scale=8.0)), 16)
    assert fused_on_cpu


def test_greedy_triforce_through_the_kernel_equals_greedy_plain(fused_on_cpu):
    settings = TriforceSettings(tree=Tree((-1, 0, 0, 0, 1, 1, 2, 4)), **SMALL)
    assert_greedy_identity([(0, int8_fp32(0, weight_scale=8.0))],
                           lambda seed, model: triforce_decoder(model, settings, prefill_chunk=16), 16)
    assert fused_on_cpu


@needs_cuda
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
def test_on_cuda_the_kernel_attends_exactly_to_the_dequantized_rows(dtype, tolerance):
    """Llama-3.1-8B's attention shape (8 KV heads of 4 query heads, head size 128) at 32K
    positions: a decode step and a 16-token verification."""
    key_rows, value_rows = (rows.cuda() for rows in packed_rows(8, 32768, 128))
    for rows in (4, 64):
        queries = torch.randn(8, rows, 128, device="cuda").to(dtype)
        out, lse = int8_kernel.attend_packed(queries, key_rows, value_rows, 128 ** -0.5)
        expected_out, expected_lse = reference(queries, key_rows, value_rows, 128 ** -0.5)
        torch.testing.assert_close(out.double(), expected_out, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(lse.double(), expected_lse, rtol=tolerance, atol=tolerance)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_on_cuda_the_packing_kernel_writes_the_bits_torch_packs(dtype):
    assert_packs_as_torch(dtype, "cuda")


@needs_cuda
def test_on_cuda_greedy_chain_and_tree_through_the_kernel_and_graphs_equal_greedy_plain():
    assert int8_attention.reads_packed(torch.device("cuda"), torch.float32, 8)  # the tiny models' head size
    models = [(seed, int8_fp32(seed, weight_scale=8.0).to("cuda")) for seed in range(2)]
    assert_greedy_identity(models, lambda seed, model: make_decoder("chain"), 24)
    assert_greedy_identity(models, lambda seed, model: model_tree_decoder(noisy_copy(seed, 0.3, weight_scale=8.0)
                                                                          .to("cuda")), 24)
    assert int8_attention.ROUTE.describe(torch.device("cuda"), torch.float32) == "fused kernel"
    for _, model in models:  # the steps were captured and replayed as CUDA graphs, checked against eager
        assert model.step_graphs.off is None and model.step_graphs.replays > 0


def test_a_length_read_on_the_device_attends_only_that_many_positions():
    """What a CUDA graph replays: the whole buffers, the length in a device tensor; the splits
    past it add nothing."""
    queries = torch.randn(2, 6, 64)
    key_rows, value_rows = packed_rows(2, 900, 64, spare=0)
    for length in (1, 63, 500):
        expected = int8_kernel.attend_packed(queries, key_rows[:, :length], value_rows[:, :length], 0.125)
        on_device = torch.tensor([length], dtype=torch.int32)
        got = int8_kernel.attend_packed(queries, key_rows, value_rows, 0.125, past=on_device)
        for one, other in zip(got, expected):
            torch.testing.assert_close(one, other, rtol=0, atol=1e-5)


def test_replayable_steps_over_an_8bit_cache_equal_the_eager_forwards(fused_on_cpu):
    """The static path a CUDA graph captures (run eagerly here): steps of 1-7 tokens, a tree and
    its accepted path, against the same model's eager forwards through the kernel."""
    from test_hierarchy import TREE

    eager, replaying = int8_fp32(3, weight_scale=4.0), int8_fp32(3, weight_scale=4.0)
    graphs = replaying.set_step_graphs(capture=False)
    ids = torch.randint(0, 97, (80,), generator=torch.Generator().manual_seed(0))
    caches = eager.new_cache(), replaying.new_cache()

    def both(start, n, mask=None):
        logits = [model.forward(ids[start:start + n], torch.arange(start, start + n), cache, mask)
                  for model, cache in zip((eager, replaying), caches)]
        torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)

    both(0, 30)
    with torch.inference_mode():  # spare slots' bytes 0x7f: a scale of 3.4e38, inf once read
        for layer in caches[1].transformers_cache.layers:
            for buffer in layer.buffers:
                buffer[:, :, layer.get_seq_length():] = 127
    for n in (1, 4, 1, 7):
        both(caches[0].length, n)
    for cache in caches:
        cache.trim(40)
    both(40, TREE.size, TREE.attention_mask(40))
    assert graphs.replays == 5 and graphs.off is None


def test_greedy_chain_through_replayable_8bit_steps_equals_greedy_plain(fused_on_cpu):
    from test_decoding import prompts, run
    from specchat.core.sampling import SamplingParams

    drafted = accepted = 0
    for name, prompt in prompts(0).items():
        plain, _ = run(int8_fp32(0, weight_scale=8.0), prompt, "plain", SamplingParams(), 16)
        target = int8_fp32(0, weight_scale=8.0)
        graphs = target.set_step_graphs(capture=False)
        chain, steps = run(target, prompt, "chain", SamplingParams(), 16)
        assert chain == plain and graphs.replays > 0, name
        drafted, accepted = drafted + sum(s.drafted for s in steps), accepted + sum(s.accepted for s in steps)
    assert 0 < accepted < drafted  # both verification branches ran through the replayed steps
