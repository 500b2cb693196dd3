"""The 4-bit weights' fused kernel for a verification's tokens (core/nf4_kernel.py, routed by
core/nf4_linear.py): it multiplies by exactly the weights bitsandbytes dequantizes, and decoding
through it stays lossless against the 4-bit model.

On the CPU the kernel runs in Triton's interpreter (float32 and float16: the interpreter's bf16 dot
products are wrong), and the layers are stand-ins holding bitsandbytes' layout, built here (the
test machine has no bitsandbytes); where bitsandbytes is installed the kernel is also checked
against its own quantization, and on CUDA in bf16."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import needs_cuda, route_on_cpu
from test_decoding import assert_greedy_identity
from test_tree_decoding import model_tree_decoder
from specchat.core import nf4_linear
from specchat.core.decoding import make_decoder
from specchat.core.model import TransformersLM

nf4_kernel = pytest.importorskip("specchat.core.nf4_kernel", reason="Triton is not installed")

# The 16 NF4 values (QLoRA's normal-float quantiles), as bitsandbytes' code table holds them.
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def nf4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' NF4 layout of `weight` [out, in]: (packed uint8 [out x in / 2], absmax
    float32 [out x in / 64]); each element the nearest code to it over its block's absmax."""
    blocks = weight.float().reshape(-1, 64)
    absmax = blocks.abs().amax(-1)
    codes = (blocks / absmax[:, None].clamp(min=1e-12))[..., None].sub(NF4).abs().argmin(-1).flatten()
    return (codes[0::2] * 16 + codes[1::2]).to(torch.uint8), absmax


def nf4_unpack(packed: torch.Tensor, absmax: torch.Tensor, shape, dtype) -> torch.Tensor:
    """The weight the model as loaded multiplies by: code value x absmax, rounded to `dtype`."""
    codes = torch.stack([packed.long() >> 4, packed.long() & 15], -1).flatten()
    return (NF4[codes].reshape(-1, 64) * absmax[:, None]).reshape(shape).to(dtype)


@pytest.mark.parametrize("rows, outputs, inner, dtype, tolerance", [
    (2, 96, 128, torch.float32, 1e-6),  # a 2-token chain; outputs not a multiple of the block
    (16, 200, 640, torch.float16, 1e-3),
    (64, 64, 256, torch.float32, 1e-6),  # the most rows the route sends
    (5, 130, 4096, torch.float16, 1e-3),  # 64 blocks of the inner dimension split among programs
])
def test_the_kernel_multiplies_by_the_dequantized_weight(rows, outputs, inner, dtype, tolerance):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(outputs, inner, generator=generator)
    packed, absmax = nf4_pack(weight)
    x = torch.randn(rows, inner, generator=generator).to(dtype)
    out = nf4_kernel.nf4_matmul(x, packed, absmax, nf4_kernel.code_pairs(NF4), outputs)
    expected = x.double() @ nf4_unpack(packed, absmax, weight.shape, dtype).double().T
    assert out.dtype == dtype and out.shape == (rows, outputs)
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_one_block_an_iteration_or_several_sum_the_same():
    generator = torch.Generator().manual_seed(3)
    packed, absmax = nf4_pack(torch.randn(96, 2048, generator=generator))
    x = torch.randn(4, 2048, generator=generator).half()  # float32 always takes one block a step
    pairs = nf4_kernel.code_pairs(NF4)
    one, *several = (nf4_kernel.nf4_matmul(x, packed, absmax, pairs, 96, blocks_per_step=step) for step in (1, 2, 4))
    for other in several:
        torch.testing.assert_close(other, one, rtol=1e-3, atol=1e-3)


def test_its_layout_is_bitsandbytes():
    functional = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is the gpu extra")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight = torch.randn(96, 256, device=device)
    packed, state = functional.quantize_4bit(weight, quant_type="nf4", blocksize=64)
    x = torch.randn(7, 256, device=device)
    out = nf4_kernel.nf4_matmul(x, packed.view(-1), state.absmax, nf4_kernel.code_pairs(state.code), 96)
    torch.testing.assert_close(out, x @ functional.dequantize_4bit(packed, state).T, rtol=1e-5, atol=1e-4)


class StandIn(torch.nn.Module):
    """bitsandbytes' Linear4bit as the router sees it (its weight's quant_state), whose own
    forward multiplies by the dequantized weight and counts its calls."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        packed, absmax = nf4_pack(linear.weight.detach())
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        self.weight.quant_state = SimpleNamespace(quant_type="nf4", blocksize=64, nested=False, absmax=absmax,
                                                  code=NF4, shape=tuple(linear.weight.shape),
                                                  dtype=linear.weight.dtype)
        self.bias, self.compute_dtype = None, linear.weight.dtype
        self.dequantized = nf4_unpack(packed, absmax, linear.weight.shape, linear.weight.dtype)
        self.own_calls = 0

    def forward(self, x):
        self.own_calls += 1
        return torch.nn.functional.linear(x, self.dequantized)


def four_bit_llama(seed: int, quantized: bool = True) -> TransformersLM:
    """A small fp32 Llama (inner sizes multiples of 64) whose decoder layers' linears are 4-bit
    stand-ins, routed as a loaded 4-bit model's are (`quantized` False: the same model unquantized,
    a draft that agrees with it often)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    hf = LlamaForCausalLM(config)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    for layer in hf.model.layers if quantized else ():
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, StandIn(child))
    return TransformersLM(hf)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The route on the CPU; yields each kernel call's tensor shapes (the first: the rows')."""
    return route_on_cpu(monkeypatch, nf4_linear.ROUTE, nf4_kernel, "nf4_matmul")


def stand_ins(model: TransformersLM) -> list[StandIn]:
    return [module for module in model.hf.modules() if isinstance(module, StandIn)]


def test_a_verification_goes_through_the_kernel_and_one_token_or_a_prefill_does_not(fused_on_cpu):
    model = four_bit_llama(0)
    layers = stand_ins(model)
    assert len(layers) == 14 and all(hasattr(layer, "bitsandbytes_forward") for layer in layers)
    cache = model.new_cache()
    model.forward(torch.arange(70) % 97, torch.arange(70), cache)  # a prefill chunk past 64 rows
    model.forward(torch.tensor([5]), torch.tensor([70]), cache)
    assert fused_on_cpu == [] and all(layer.own_calls == 2 for layer in layers)
    fused = model.forward(torch.tensor([6, 7, 8]), torch.arange(71, 74), cache)
    assert [shapes[0][0] for shapes in fused_on_cpu] == [3] * 14 and all(layer.own_calls == 2 for layer in layers)
    cache.trim(71)
    nf4_linear.ROUTE.devices.discard("cpu")
    own = model.forward(torch.tensor([6, 7, 8]), torch.arange(71, 74), cache)
    torch.testing.assert_close(fused, own, rtol=0, atol=1e-5)


def test_a_kernel_that_fails_leaves_bitsandbytes_forward_with_the_reason(fused_on_cpu, monkeypatch):
    model = four_bit_llama(1)

    def broken(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(nf4_kernel, "nf4_matmul", broken)
    logits = model.forward(torch.arange(5), torch.arange(5), model.new_cache())
    assert "no kernel image" in nf4_linear.ROUTE.describe(torch.device("cpu"), torch.float32)
    assert all(layer.own_calls == 1 for layer in stand_ins(model))
    nf4_linear.ROUTE.devices.discard("cpu")
    torch.testing.assert_close(logits, model.forward(torch.arange(5), torch.arange(5), model.new_cache()),
                               rtol=0, atol=0)


def test_greedy_chain_through_the_kernel_equals_greedy_plain(fused_on_cpu):
    assert_greedy_identity([(0, four_bit_llama(0))], lambda seed, model: make_decoder("chain"), 16)
    assert fused_on_cpu


def test_greedy_tree_through_the_kernel_equals_greedy_plain(fused_on_cpu):
    draft = four_bit_llama(1, quantized=False)
    assert_greedy_identity([(1, four_bit_llama(1))], lambda seed, model: model_tree_decoder(draft), 16)
    assert fused_on_cpu


@needs_cuda
@pytest.mark.parametrize("rows", [2, 16, 64])
def test_on_cuda_the_kernel_multiplies_by_what_bitsandbytes_dequantizes(rows):
    """Llama-3.1-8B's MLP shape in bf16, as bitsandbytes quantizes it."""
    functional = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is the gpu extra")
    weight = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
    packed, state = functional.quantize_4bit(weight, quant_type="nf4", blocksize=64)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    out = nf4_kernel.nf4_matmul(x, packed.view(-1), state.absmax, nf4_kernel.code_pairs(state.code), 14336)
    expected = x.double() @ functional.dequantize_4bit(packed, state).double().T
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    assert nf4_linear.ROUTE.describe(torch.device("cuda"), torch.bfloat16) == "fused kernel"


def test_the_campaign_times_a_4bit_layer_through_bitsandbytes_and_the_kernel(fused_on_cpu):
    from specchat.benchmarks.gpu.weights import nf4_kernel_rows

    up = four_bit_llama(0).hf.model.layers[0].mlp.up_proj
    timed = nf4_kernel_rows(up, SimpleNamespace(device="cpu", dtype=torch.float32, repeats=1))
    assert (timed["outputs"], timed["inner"], timed["stored_bytes"]) == (128, 64, 128 * 64 // 2 + 128 * 4)
    assert [row["rows"] for row in timed["rows"]] == [1, 2, 4, 8, 16, 64]
    assert all(row["fused_s"] > 0 and row["fused_one_block_a_step_s"] > 0 and row["bitsandbytes_bytes_per_s"] > 0
               for row in timed["rows"])
    assert len(fused_on_cpu) >= 24 and up.own_calls >= 12  # each way, warm-up included


def test_codes_stored_in_wider_words_keep_bitsandbytes_forward(fused_on_cpu):
    """bitsandbytes can store the packed codes as bf16 words (`quant_storage`): the kernel reads
    bytes, so such layers are left alone rather than read wrongly."""
    torch.manual_seed(0)
    layer = StandIn(torch.nn.Linear(64, 64, bias=False))
    layer.weight = torch.nn.Parameter(layer.weight.data.view(torch.bfloat16), requires_grad=False)
    layer.weight.quant_state = SimpleNamespace(quant_type="nf4", blocksize=64, nested=False, shape=(64, 64),
                                               absmax=torch.ones(64), code=NF4, dtype=torch.float32)
    assert nf4_linear.use_fused_nf4(torch.nn.Sequential(layer)) == 0 and not hasattr(layer, "bitsandbytes_forward")


def test_a_bias_is_added_before_the_one_rounding():
    generator = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(64, 128, generator=generator), torch.randn(64, generator=generator)
    packed, absmax = nf4_pack(weight)
    x = torch.randn(3, 128, generator=generator).half()
    out = nf4_kernel.nf4_matmul(x, packed, absmax, nf4_kernel.code_pairs(NF4), 64, bias.half())
    expected = x.double() @ nf4_unpack(packed, absmax, weight.shape, torch.float16).double().T + bias.half().double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
