"""The load options an 8 GB plan needs (plan.py, placement.py), run on the CPU: the input
embedding kept in CPU memory (host_embedding.py) and the output head quantized with the layers.
On a CPU the embedding's "compute device" is the CPU too, so these tests prove the wiring and that
nothing changes the logits; the transfer itself runs on the device machine."""

from __future__ import annotations

import pytest
import torch

from specchat.core.host_embedding import HostEmbedding
from specchat.core.kv.full import FullCache
from specchat.core.model import TransformersLM
from specchat.core.placement import LoadOptions


def _saved_llama(path, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    # A vocabulary of a multiple of 64, as real ones are: bitsandbytes' CPU nf4 kernel needs it.
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _logits(model: TransformersLM, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache()
    first = model.forward(ids[:-3], torch.arange(len(ids) - 3), cache)
    rest = model.forward(ids[-3:], torch.arange(len(ids) - 3, len(ids)), cache)  # a 3-token verification
    return torch.cat([first, rest])


def test_the_embedding_kept_in_cpu_memory_changes_no_logit(tmp_path):
    path = _saved_llama(tmp_path / "untied", tied=False)
    ids = torch.randint(0, 512, (20,))
    plain = TransformersLM.from_pretrained(path, LoadOptions("float32", "cpu", None, None))
    hosted = TransformersLM.from_pretrained(path, LoadOptions("float32", "cpu", None, None, embedding_on_cpu=True))
    assert isinstance(hosted.hf.get_input_embeddings(), HostEmbedding)
    assert hosted.device == torch.device("cpu") and hosted.hf.get_input_embeddings().weight.device.type == "cpu"
    assert torch.equal(_logits(hosted, ids), _logits(plain, ids))
    draft = hosted.truncated(1)  # a layer-skip draft shares the hosted embedding
    assert torch.equal(draft.forward(ids, torch.arange(20), FullCache(draft.hf.config)),
                       plain.truncated(1).forward(ids, torch.arange(20), FullCache(plain.hf.config)))


def test_a_tied_embedding_stays_with_the_output_head(tmp_path):
    path = _saved_llama(tmp_path / "tied", tied=True)
    hosted = TransformersLM.from_pretrained(path, LoadOptions("float32", "cpu", None, None, embedding_on_cpu=True))
    embedding = hosted.hf.get_input_embeddings()
    assert not isinstance(embedding, HostEmbedding)
    assert embedding.weight is hosted.hf.get_output_embeddings().weight


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_the_output_head_is_quantized_only_when_the_plan_says(tmp_path, quantization):
    """bitsandbytes (the `gpu` extra; its CPU backend runs both formats) leaves the head in the
    compute dtype unless told; told, the head is quantized and the logits keep their width."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is the gpu extra")
    path = _saved_llama(tmp_path / "model", tied=False)
    quantized_kind = bnb.nn.Linear4bit if quantization == "nf4" else bnb.nn.Linear8bitLt
    ids = torch.randint(0, 512, (12,))
    for quantize_head in (False, True):
        model = TransformersLM.from_pretrained(path, LoadOptions("bfloat16", "cpu", quantization, None,
                                                                 quantize_head=quantize_head))
        assert isinstance(model.hf.model.layers[0].mlp.up_proj, quantized_kind)
        assert isinstance(model.hf.get_output_embeddings(), quantized_kind) == quantize_head
        assert model.vocab_size == 512  # read from the head's out_features, not its packed weight
        logits = _logits(model, ids)
        assert logits.shape == (12, 512) and torch.isfinite(logits).all()
