"""From a plan to loading options (pure, on the synthetic machines), and loading with them."""

import pytest
import torch

from conftest import needs_cuda, tiny_llama
from test_plan import PROFILES, REGISTRY
from specchat.core.model import TransformersLM
from specchat.core.placement import LoadOptions, allocator_caps, draft_options, offload_capacity, target_options
from specchat.core.planning import Overrides, make_plan

K = 1024


def plan(profile, pair_id, context, precision="exact"):
    """The exact precision's plans by default: their tiers exercise every load option."""
    return make_plan(PROFILES[profile], REGISTRY.get(pair_id), context, Overrides(precision=precision),
                     registry=REGISTRY)


def test_a_12_gb_card_loads_llama_in_8_bit_with_the_kv_and_embedding_offloaded():
    chosen = plan("rtx3060-12gb", "llama3.1-8b", 128 * K)
    options = target_options(chosen, REGISTRY.get("llama3.1-8b").target)
    assert options == LoadOptions("bfloat16", "cuda:0", "int8", None, 128 * K,
                                  quantize_head=False, embedding_on_cpu=True, cache_positions=128 * K,
                                  allocator_caps=allocator_caps(chosen))
    assert offload_capacity(chosen) == 128 * K
    assert draft_options(chosen) is None  # the plan leaves the draft out


def test_an_8_gb_card_loads_llama_in_4_bit_with_its_output_head():
    # TriForce's retrieval cache leaves room only with the head quantized too (a chain keeps it in bf16).
    chosen = make_plan(PROFILES["rtx4060ti-8gb-32gb"], REGISTRY.get("llama3.1-8b"), 128 * K,
                       Overrides(precision="exact", mode="triforce"))
    options = target_options(chosen, REGISTRY.get("llama3.1-8b").target)
    assert options == LoadOptions("bfloat16", "cuda:0", "nf4", None, 128 * K,
                                  quantize_head=True, embedding_on_cpu=True, cache_positions=128 * K,
                                  allocator_caps=allocator_caps(chosen))


def test_two_cards_split_the_layers_in_order():
    chosen = plan("2x-rtx4090", "llama3.1-8b", 128 * K)
    device_map = target_options(chosen, REGISTRY.get("llama3.1-8b").target).device_map
    layers = [device_map[f"model.layers.{i}"] for i in range(32)]
    assert layers == ["cuda:0"] * chosen.target_layers[0] + ["cuda:1"] * chosen.target_layers[1]
    assert device_map["model.embed_tokens"] == "cuda:0" and device_map["lm_head"] == "cuda:1"
    assert draft_options(chosen) == LoadOptions("bfloat16", "cuda:1", None, None,
                                                allocator_caps=allocator_caps(chosen))


@pytest.mark.parametrize("context, scaled", [(32 * K, False), (128 * K, True)])
def test_rope_scaling_only_past_the_configs_positions(context, scaled):
    chosen = plan("rtx4090-24gb", "qwen2.5-7b", context)
    options = target_options(chosen, REGISTRY.get("qwen2.5-7b").target)
    assert (options.rope_scaling is not None) == scaled
    if scaled:
        assert options.rope_scaling["rope_type"] == "yarn" and options.rope_scaling["factor"] == 4.0


def test_the_allocator_is_capped_at_what_the_plan_fills_on_each_gpu(monkeypatch):
    """All but the margin, on each card: past it the driver would lend system RAM (Windows) at a
    fraction of the speed. A --vram-limit below it wins; a machine without CUDA is left alone."""
    import torch

    from specchat.core.hardware import cap_cuda_allocator

    chosen = plan("2x-rtx4090", "llama3.1-8b", 128 * K)
    caps = dict(allocator_caps(chosen))
    assert sorted(caps) == [0, 1]
    for device in chosen.devices:
        if device.device.startswith("cuda:"):
            cap = caps[int(device.device[-1])]
            assert cap == device.capacity_bytes - device.margin_bytes and cap <= 0.9 * device.capacity_bytes
    assert dict(target_options(chosen, REGISTRY.get("llama3.1-8b").target).allocator_caps) == caps
    fractions = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("P", (), {"total_memory": 24 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index: fractions.update({index: f}))
    monkeypatch.delenv("SPECCHAT_VRAM_LIMIT", raising=False)
    cap_cuda_allocator({0: 18 * 2**30})
    assert fractions == {0: 0.75}  # the second GPU has no cap: untouched
    monkeypatch.setenv("SPECCHAT_VRAM_LIMIT", "12")
    cap_cuda_allocator({0: 18 * 2**30, 1: 6 * 2**30})
    assert fractions == {0: 0.5, 1: 0.25}


def test_the_cpu_keeps_full_precision_in_place():
    chosen = plan("cpu-only-32gb", "embedded", 8 * K)
    assert target_options(chosen, REGISTRY.get("embedded").target) == LoadOptions("float32", "cpu", None, None,
                                                                                  cache_positions=8 * K)
    assert offload_capacity(chosen) is None


def test_loading_applies_dtype_and_rope_scaling(tmp_path):
    tiny_llama(0, dtype=torch.float32).hf.save_pretrained(tmp_path)
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    model = TransformersLM.from_pretrained(tmp_path, LoadOptions("bfloat16", "cpu", None, rope))
    assert model.hf.dtype == torch.bfloat16 and model.context_length == 2048
    assert model.hf.config.rope_parameters["rope_type"] == "yarn"
    cache = model.new_cache()
    assert model.forward(torch.arange(5), torch.arange(5), cache).shape == (5, 97)


@needs_cuda
def test_loading_places_the_model_on_the_gpu(tmp_path):
    tiny_llama(0, dtype=torch.float32).hf.save_pretrained(tmp_path)
    model = TransformersLM.from_pretrained(tmp_path, LoadOptions("bfloat16", "cuda:0", None, None))
    assert model.device.type == "cuda" and model.hf.dtype == torch.bfloat16
    model.offload_capacity = 64
    cache = model.new_cache()
    logits = model.forward(torch.arange(5), torch.arange(5), cache)
    assert logits.device.type == "cpu" and cache.length == 5 and cache.fetched_bytes >= 0



@needs_cuda
@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_bitsandbytes_weights_load_on_the_gpu_and_verify_as_they_step(tmp_path, quantization):
    """The production loader's bitsandbytes path on a GPU: the decoder layers are quantized, the
    head is not, and a 16-token verification forward gives the logits of 16 one-token steps up to
    bf16 rounding, which is what speculation over a quantized target relies on. (Greedy token
    identity is the fp64 tests' job: bf16 logits tie.) Wider than tiny_llama: nf4 quantizes in
    blocks of 64 weights."""
    pytest.importorskip("bitsandbytes", reason="the GPU install brings bitsandbytes (packaging/install.sh)")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = TransformersLM.from_pretrained(tmp_path, LoadOptions("bfloat16", "cuda:0", quantization, None))
    layer = model.hf.model.layers[0].mlp.up_proj
    assert type(layer).__name__ == {"nf4": "Linear4bit", "int8": "Linear8bitLt"}[quantization]
    assert type(model.hf.lm_head).__name__ == "Linear" and model.device.type == "cuda"
    ids = torch.randint(97, (48,), generator=torch.Generator().manual_seed(1))
    prompt = 32
    stepped = model.new_cache()
    model.forward(ids[:prompt], torch.arange(prompt), stepped)
    steps = torch.cat([model.forward(ids[i:i + 1], torch.arange(i, i + 1), stepped) for i in range(prompt, 48)])
    verified = model.new_cache()
    model.forward(ids[:prompt], torch.arange(prompt), verified)
    verification = model.forward(ids[prompt:], torch.arange(prompt, 48), verified)
    scale = steps.abs().max().item()
    assert (verification - steps).abs().max().item() <= 8 * torch.finfo(torch.bfloat16).eps * scale
