"""The campaign's models: random weights of Llama-3.1-8B's shape on a GPU (nothing downloaded), a toy
Llama for the CPU rehearsal, and the registry's description of either for the plan's arithmetic."""

from __future__ import annotations

import time

import torch

from ..offload import LLAMA_31_8B, LLAMA_32_1B, random_model
from ...core.model import TransformersLM
from ...core.planning import PREFILL_CHUNK_GPU, activation_bytes, weight_parts
from ...core.registry import ModelSpec
from .clock import synchronize

# Small enough for a 2-core CPU, wide enough for int4 packing (k a multiple of 128) and grouped
# query attention (4 query heads per KV head, as in the 8B shape).
TOY_TARGET = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, rope_theta=500000.0)
TOY_DRAFT = dict(TOY_TARGET, num_hidden_layers=1, tie_word_embeddings=True)
# For cards that cannot hold the 8B shape in bf16 next to a 32K KV (under about 22 GB).
LLAMA_32_3B = dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                   num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                   tie_word_embeddings=True)

__all__ = ["LLAMA_31_8B", "LLAMA_32_1B", "LLAMA_32_3B", "TOY_TARGET", "TOY_DRAFT", "random_model", "model_spec",
           "predicted_weight_bytes", "predicted_prefill_bytes", "prefill", "random_ids", "weight_bytes",
           "kv_bytes_per_token"]


def weight_bytes(shape: dict, dtype_bytes: int = 2) -> int:
    """A Llama shape's weights: embedding, head (unless tied), the decoder layers' matrices and norms."""
    hidden, heads, kv_heads, head_dim = (shape[key] for key in ("hidden_size", "num_attention_heads",
                                                                 "num_key_value_heads", "head_dim"))
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    layer = attention + 3 * hidden * shape["intermediate_size"]
    matrices = 1 if shape.get("tie_word_embeddings") else 2
    norms = hidden * (2 * shape["num_hidden_layers"] + 1)
    return dtype_bytes * (matrices * shape["vocab_size"] * hidden + shape["num_hidden_layers"] * layer + norms)


def kv_bytes_per_token(shape: dict, dtype_bytes: int = 2) -> int:
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * dtype_bytes


def model_spec(model: TransformersLM, dtype: torch.dtype) -> ModelSpec:
    """The registry's entry for a random model: the shapes the plan's memory arithmetic reads."""
    config = model.config
    params = sum(p.numel() for p in model.hf.parameters())
    return ModelSpec(repo="random", revision="-", params_b=params / 1e9, download_bytes=0,
                     layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                     attention_heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                     head_dim=config.head_dim, vocab_size=config.vocab_size,
                     max_position_embeddings=config.max_position_embeddings,
                     dtype=str(dtype).removeprefix("torch."), rope_scaling=None)


def predicted_weight_bytes(spec: ModelSpec, quantization: str, dtype: torch.dtype) -> int:
    """What the plan budgets for the weights: embedding, head and decoder layers."""
    return sum(weight_parts(spec, quantization, _bytes(dtype)))


def predicted_prefill_bytes(spec: ModelSpec, context: int, chunk: int, dtype: torch.dtype) -> int:
    """What the plan budgets for a prefill with the KV on the device: weights, KV, activations."""
    return (predicted_weight_bytes(spec, "none", dtype) + context * spec.kv_bytes_per_token(_bytes(dtype))
            + activation_bytes(spec, chunk, _bytes(dtype)))


def _bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def random_ids(vocab_size: int, count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(vocab_size, (count,), generator=torch.Generator().manual_seed(seed))


def prefill(model: TransformersLM, cache, ids: torch.Tensor, length: int,
            chunk: int = PREFILL_CHUNK_GPU) -> float:
    """Read `ids[:length]` into `cache` in chunks, as the engine does; the wall seconds it took."""
    synchronize(model.device)
    begin = time.perf_counter()
    for start in range(cache.length, length, chunk):
        end = min(length, start + chunk)
        model.forward(ids[start:end], torch.arange(start, end), cache, last_only=True)
    synchronize(model.device)
    return time.perf_counter() - begin
