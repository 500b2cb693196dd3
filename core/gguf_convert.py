"""Convert a llama GGUF to a transformers safetensors directory, reading the file once.

It writes what `from_pretrained(gguf_file=...)` then `save_pretrained` would write, bit for bit: the
same dequantization (`gguf.quants`' block formulas), the same reverse permutation of the q/k rows
(transformers' `LlamaTensorProcessor`), the same config keys (transformers' GGUF config mapping)
and the same tokenizer (transformers' GGUF tokenizer converter). It skips what made that path slow:
three `GGUFReader` parses that build every one of the 98K vocabulary and merge strings as numpy
views, a tensor-name map rebuilt for every module, and a copy of the model into a plain one.
"""

from __future__ import annotations

import struct
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np

# GGUF metadata value types of a fixed width: u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# GGUF llama tensor names -> transformers LlamaForCausalLM names ("{}" is the layer number)
LLAMA_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{}.attn_norm": "model.layers.{}.input_layernorm",
    "blk.{}.attn_q": "model.layers.{}.self_attn.q_proj",
    "blk.{}.attn_k": "model.layers.{}.self_attn.k_proj",
    "blk.{}.attn_v": "model.layers.{}.self_attn.v_proj",
    "blk.{}.attn_output": "model.layers.{}.self_attn.o_proj",
    "blk.{}.ffn_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.ffn_gate": "model.layers.{}.mlp.gate_proj",
    "blk.{}.ffn_up": "model.layers.{}.mlp.up_proj",
    "blk.{}.ffn_down": "model.layers.{}.mlp.down_proj",
}


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy/torch order: ggml lists dimensions fastest-moving first
    ggml_type: int
    offset: int  # from the start of the data section


class Gguf(NamedTuple):
    metadata: dict  # key -> value; an array of strings (the vocabulary, the merges) is only counted
    tensors: tuple[TensorInfo, ...]
    data: np.ndarray  # the file as a read-only uint8 memory map
    data_start: int


def read_gguf(path: Path) -> Gguf:
    """A GGUF's metadata and tensor table; tensor data stays in the memory map until used.

    Unlike `gguf.GGUFReader` it does not build a numpy view per string, which for this vocabulary
    took about 10 s a parse; string arrays are stepped over and recorded by their length.
    """
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(blob)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path} is GGUF v{version}; only v2 and v3 are read")

    def string(pos):
        (length,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8:pos + 8 + length]).decode("utf-8"), pos + 8 + length

    def value(pos, kind):
        if kind in _SCALAR:
            return struct.unpack_from(_SCALAR[kind], buf, pos)[0], pos + struct.calcsize(_SCALAR[kind])
        if kind == _STRING:
            return string(pos)
        if kind != _ARRAY:
            raise ValueError(f"{path}: unknown GGUF metadata type {kind}")
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _SCALAR:
            fmt = f"<{count}{_SCALAR[item][1]}"
            return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
        if item != _STRING:
            raise ValueError(f"{path}: unsupported GGUF array of type {item}")
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        return count, pos

    metadata, pos = {}, 24
    for _ in range(kv_count):
        key, pos = string(pos)
        metadata[key], pos = value(pos + 4, struct.unpack_from("<I", buf, pos)[0])
    tensors = []
    for _ in range(tensor_count):
        name, pos = string(pos)
        (ndim,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        tensors.append(TensorInfo(name, tuple(reversed(dims)), ggml_type, offset))
    alignment = metadata.get("general.alignment", 32)
    return Gguf(metadata, tuple(tensors), blob, (pos + alignment - 1) // alignment * alignment)


def hf_config_dict(gguf: Gguf) -> dict:
    """The config transformers' GGUF loader derives from this file (its `load_gguf_checkpoint`)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    architecture = gguf.metadata["general.architecture"]
    if architecture != "llama":
        raise ValueError(f"only llama GGUFs are converted directly, not {architecture}")
    names = {info.name for info in gguf.tensors}
    config = {"tie_word_embeddings": "output.weight" not in names}
    for key, value in gguf.metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            config[renamed] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in gguf.metadata:
        config["vocab_size"] = gguf.metadata["tokenizer.ggml.tokens"]  # counted, see read_gguf
    return config


def _hf_name(gguf_name: str) -> str:
    base, dot, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    layer = parts[1] if parts[0] == "blk" and len(parts) > 2 else None
    pattern = ".".join(["blk", "{}", *parts[2:]]) if layer is not None else base
    if pattern not in LLAMA_NAMES:
        raise ValueError(f"no transformers name for GGUF tensor {gguf_name}")
    return LLAMA_NAMES[pattern].format(layer) + dot + suffix


def _reverse_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleaving of a q/k weight, as transformers does."""
    w = weights.reshape(heads, weights.shape[0] // heads // 2, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


# Types whose blocks dequantize element by element (scale * q [+ min]), so one call over all of a
# tensor's blocks gives the same bits as `gguf.quants.dequantize`'s 16-row groups, about 3x faster.
_BLOCKWISE = ("Q4_0", "Q4_1", "Q8_0")


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's float32 values from its bytes (`raw`: the byte shape `gguf.quants` expects)."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(ggml_type)
    if qtype.name in _BLOCKWISE:
        kind = getattr(quants, qtype.name)
        return kind.dequantize_blocks(raw.reshape(-1, kind.type_size)).reshape(shape)
    return np.array(quants.dequantize(raw, qtype), dtype=np.float32)  # a copy, not a file view


def hf_state_dict(gguf: Gguf, config: dict) -> dict:
    """`{transformers name: float32 torch tensor}`: what `save_pretrained` writes, which for tied
    embeddings (no `output.weight` in the file) has no lm_head.weight either."""
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors = {}
    for info in gguf.tensors:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        byte_shape = (*info.shape[:-1], info.shape[-1] // block * block_bytes)
        start = gguf.data_start + info.offset
        weights = dequantize(gguf.data[start:start + prod(byte_shape)].reshape(byte_shape),
                             info.ggml_type, info.shape)
        if ".attn_q." in info.name:
            weights = _reverse_permute(weights, config["num_attention_heads"])
        elif ".attn_k." in info.name:
            weights = _reverse_permute(weights, config["num_key_value_heads"])
        tensors[_hf_name(info.name)] = torch.from_numpy(weights)
    return tensors


def convert(path: Path, out: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer into `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    gguf = read_gguf(path)
    config_dict = hf_config_dict(gguf)
    config = AutoConfig.for_model(**config_dict)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = torch.float32
    state_dict = hf_state_dict(gguf, config_dict)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    save_file(state_dict, out / "model.safetensors", metadata={"format": "pt"})
    # The class AutoTokenizer picks for a GGUF, minus its second full-file config parse (~8 s).
    PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)

