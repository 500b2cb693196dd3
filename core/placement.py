"""How a plan's choices become loading options: dtype, devices, quantization, rope scaling and
where (and in what precision) the full KV lives. Pure, so every machine's mapping is tested
without its hardware."""

from __future__ import annotations

from dataclasses import dataclass

from .planning import Plan
from .registry import ModelSpec

DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


@dataclass(frozen=True)
class LoadOptions:
    dtype: str  # torch dtype name for the weights that stay unquantized (and the compute)
    device_map: str | dict[str, str]  # one device, or module name -> device (layers split over GPUs)
    quantization: str | None  # None, "int8" or "nf4" (bitsandbytes)
    rope_scaling: dict | None  # applied to the config to reach the plan's context
    offload_capacity: int | None = None  # positions of full KV kept in pinned CPU memory (None: on the device)
    resident_layers: int = 0  # of an offloaded KV, the layers whose KV stays on the GPU (a partial offload)
    quantize_head: bool = False  # the output head quantized as the layers are (bitsandbytes skips it by default)
    embedding_on_cpu: bool = False  # the input embedding in CPU memory, the layers on the GPU(s)
    kv_dtype: str | None = None  # None: the KV in `dtype`; "int8": 8-bit with a scale per token (kv/int8.py)
    cache_positions: int | None = None  # the plan's context: a growing KV reserves no room past it
    allocator_caps: tuple[tuple[int, int], ...] = ()  # (GPU index, bytes) torch's allocator may hold


def target_options(plan: Plan, spec: ModelSpec) -> LoadOptions:
    quantization = plan.weights if plan.weights in ("int8", "nf4") else None
    dtype = "bfloat16" if quantization else DTYPES.get(plan.weights, "float32")
    return LoadOptions(dtype, _device_map(plan), quantization, _rope_scaling(plan, spec), offload_capacity(plan),
                       quantize_head=quantization is not None and plan.head_weights == plan.weights,
                       embedding_on_cpu=plan.embedding_device == "cpu" and plan.target_devices[0] != "cpu",
                       kv_dtype="int8" if plan.kv_dtype == "int8" else None, cache_positions=plan.context,
                       allocator_caps=allocator_caps(plan), resident_layers=plan.kv_resident_layers)


def draft_options(plan: Plan) -> LoadOptions | None:
    """None: the plan leaves the draft out (it does not fit next to the target). A draft is never
    quantized (its weights are small, and quantizing would only cost acceptance)."""
    if plan.draft_device is None:
        return None
    return LoadOptions(DTYPES.get(plan.draft_weights or "", "float32"), plan.draft_device, None, None,
                       allocator_caps=allocator_caps(plan))


def allocator_caps(plan: Plan) -> tuple[tuple[int, int], ...]:
    """(GPU index, bytes) for every GPU of the plan: all but its margin, which the plan leaves to
    other programs and which the driver would otherwise lend from system RAM (`cap_cuda_allocator`)."""
    return tuple((int(device.device.split(":")[1]), device.capacity_bytes - device.margin_bytes)
                 for device in plan.devices if device.device.startswith("cuda:"))


def offload_capacity(plan: Plan) -> int | None:
    """Positions of full KV to keep in pinned CPU memory, when the plan offloads it."""
    return plan.context if plan.kv_device == "cpu-pinned" else None


def _device_map(plan: Plan) -> str | dict[str, str]:
    if len(plan.target_devices) == 1:
        return plan.target_devices[0]
    # Layers split over GPUs in order (Llama and Qwen module names); embeddings with the first
    # layers, the final norm and head with the last.
    first, last = plan.target_devices[0], plan.target_devices[-1]
    mapping = {"model.embed_tokens": first, "model.rotary_emb": first, "model.norm": last, "lm_head": last}
    layer = 0
    for device, count in zip(plan.target_devices, plan.target_layers):
        for _ in range(count):
            mapping[f"model.layers.{layer}"] = device
            layer += 1
    return mapping


def _rope_scaling(plan: Plan, spec: ModelSpec) -> dict | None:
    """The registry's rope scaling, only when the context passes the config's positions (YaRN
    changes attention at every length, so short contexts keep the original)."""
    return spec.rope_scaling if spec.rope_scaling and plan.context > spec.max_position_embeddings else None
