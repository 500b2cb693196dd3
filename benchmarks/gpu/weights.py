"""The `quantized` section: the target's decoder layers in bf16, bitsandbytes nf4 and LLM.int8, and
int4 through PyTorch's tinygemm kernel, side by side in one run: memory after loading against the
plan's arithmetic, and t(1..16) at each context with the KV on the device (how flat: whether
speculation can pay on a quantized target), with the GPU's busy time beside the wall time, (an 8-bit KV is the `kv8` section).

bitsandbytes layers are built the way transformers' loader builds them (Linear4bit/Linear8bitLt
with the production options of core/model.py), from random weights instead of a checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from ...core.nf4_linear import ROUTE as NF4_ROUTE, use_fused_nf4
from .clock import allocated_bytes, busy_seconds, free_memory, wall_seconds
from .int4 import GROUP, Int4Linear, max_relative_error
from .rig import Rig
from .shapes import model_spec, predicted_weight_bytes, prefill, random_ids, random_model
from .steps import time_steps

# nf4 through bitsandbytes' own forward, then through the engine's route (core/nf4_linear.py: the
# fused kernel for 2-64 tokens where Triton runs), as a loaded 4-bit model runs it.
KINDS = ("bf16", "nf4", "nf4-fused", "int8", "int4")
PLAN_QUANTIZATION = {"bf16": "none", "nf4": "nf4", "nf4-fused": "nf4", "int8": "int8"}  # int4 is not a plan tier yet


class Unavailable(Exception):
    """This kind cannot run here (a missing library or kernel): the row says why."""


def run(rig: Rig, report: dict) -> dict:
    if not rig.quantized_contexts:
        return {"status": "skipped: no context fits this machine (" + "; ".join(rig.left_out) + ")"}
    rows, memory = [], []
    for kind in KINDS:
        if rig.seconds_left() <= 0:
            rows.append({"kind": kind, "status": "skipped: the time budget ran out"})
            continue
        try:
            row = _measure(rig, kind)
        except Unavailable as why:
            row = {"kind": kind, "status": f"skipped: {why}"}
        rows.append(row)
        if "predicted_weight_bytes" in row:
            memory.append({"placement": f"{rig.shape_name} weights, {kind}", "predicted_bytes": row["predicted_weight_bytes"],
                           "measured_peak_bytes": row["weight_bytes"]})
        free_memory(rig.device)
    return {"shape": rig.shape_name, "kinds": rows, "memory": memory}


def _measure(rig: Rig, kind: str) -> dict:
    longest = max(rig.quantized_contexts)
    model = random_model(rig.shape, longest + max(rig.sizes), rig.device, rig.dtype)
    spec = model_spec(model, rig.dtype)
    row = {"kind": kind, "status": "ran"}
    if kind != "bf16":
        row.update(quantize_layers(model.hf, kind.removesuffix("-fused"), rig.dtype))
    if kind == "nf4-fused":
        row["route"] = NF4_ROUTE.describe(torch.device(rig.device), rig.dtype)
        if row["route"] != "fused kernel" or not use_fused_nf4(model.hf):
            raise Unavailable(row["route"])
        mlp = model.hf.model.layers[0].mlp
        row["kernel_rows"] = [nf4_kernel_rows(layer, rig) for layer in (mlp.up_proj, mlp.down_proj)]
    free_memory(rig.device)
    if rig.device == "cuda":
        row["weight_bytes"] = allocated_bytes(rig.device)
        if kind in PLAN_QUANTIZATION:
            row["predicted_weight_bytes"] = predicted_weight_bytes(spec, PLAN_QUANTIZATION[kind], rig.dtype)
    ids = random_ids(model.vocab_size, longest + max(rig.sizes))
    row["steps"] = []
    for context in rig.quantized_contexts:
        cache = model.new_cache()
        prefill_s = prefill(model, cache, ids, context, rig.prefill_chunk)

        row["steps"].append({"context": context, "prefill_tokens_per_s": context / prefill_s,
                             **time_steps(rig, model, cache, ids, context)})
        del cache
        free_memory(rig.device)
    return row


def nf4_kernel_rows(layer: nn.Module, rig: Rig) -> dict:
    """One 4-bit layer (routed by core/nf4_linear.py) at 1-64 rows: bitsandbytes' forward against
    the fused kernel (as run, and reading one block an iteration), and the bytes each reads per
    second (the packed weight and its scales)."""
    state = layer.weight.quant_state
    outputs, inner = state.shape
    stored = layer.weight.data.numel() + state.absmax.numel() * state.absmax.element_size()
    result = {"outputs": outputs, "inner": inner, "stored_bytes": stored, "rows": []}
    for rows in (1, 2, 4, 8, 16, 64):
        x = torch.randn(rows, inner, device=rig.device, dtype=rig.dtype)
        timed = {}

        pairs = NF4_ROUTE.kernel.code_pairs(state.code)

        def fused(blocks_per_step):
            return lambda: NF4_ROUTE.kernel.nf4_matmul(x, layer.weight.data.view(-1), state.absmax, pairs,
                                                       outputs, blocks_per_step=blocks_per_step)
        # the kernel as the engine runs it, and one block an iteration (nf4_kernel.BLOCKS_PER_STEP's alternative)
        for name, run in (("bitsandbytes", lambda: layer.bitsandbytes_forward(x)),
                          ("fused", fused(NF4_ROUTE.kernel.BLOCKS_PER_STEP)), ("fused_one_block_a_step", fused(1))):
            busy = busy_seconds(run, rig.device)
            timed[f"{name}_s"] = busy if busy is not None else wall_seconds(run, rig.device, rig.repeats)
            timed[f"{name}_bytes_per_s"] = stored / timed[f"{name}_s"]
        result["rows"].append({"rows": rows, **timed,
                               "fused_over_bitsandbytes": timed["fused_s"] / timed["bitsandbytes_s"]})
    return result


def quantize_layers(hf_model, kind: str, compute_dtype: torch.dtype) -> dict:
    """Replace every linear layer of the decoder layers (not the embedding or the head, as
    bitsandbytes' default leaves them) with `kind`'s; report the first layer's kernel error."""
    convert = {"nf4": nf4_linear, "int8": _int8, "int4": _int4}[kind]
    checks = {}
    for layer in hf_model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    new = convert(child, compute_dtype)
                    if kind == "int4" and not checks:
                        checks["int4_kernel_relative_error"] = max_relative_error(new, child.weight.data)
                    setattr(parent, name, new)
                    del child
    if kind == "int4":
        checks["int4_group"] = GROUP
    return checks


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as error:
        raise Unavailable(f"bitsandbytes is not installed ({error}; pip install 'specchat[gpu]')") from None
    return bitsandbytes


def nf4_linear(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    bnb = _bitsandbytes()
    # core/model.py's BitsAndBytesConfig: nf4, no double quantization, compute in the model's dtype.
    new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=compute_dtype,
                            compress_statistics=False, quant_type="nf4", device="meta")
    new.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=False,
                                   quant_type="nf4", module=new).to(linear.weight.device)
    return new


def _int8(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    bnb = _bitsandbytes()
    if linear.weight.device.type != "cuda":
        raise Unavailable("LLM.int8 runs on CUDA only")
    new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=False, has_fp16_weights=False,
                              threshold=6.0, device="meta")
    # Int8Params quantizes when it moves from host memory to the GPU.
    new.weight = bnb.nn.Int8Params(linear.weight.data.cpu(), requires_grad=False,
                                   has_fp16_weights=False).to(linear.weight.device)
    return new


def _int4(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    kernel = "_weight_int4pack_mm" if linear.weight.device.type == "cuda" else "_weight_int4pack_mm_for_cpu"
    if not hasattr(torch.ops.aten, kernel):
        raise Unavailable(f"this PyTorch has no {kernel}")
    return Int4Linear(linear.weight.data, torch.bfloat16)
