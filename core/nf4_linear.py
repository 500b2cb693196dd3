"""Which kernel runs a 4-bit NF4 layer (bitsandbytes' Linear4bit) for a few tokens: the fused
kernel (nf4_kernel.py) for a verification's 2-64 rows where Triton runs on a CUDA GPU, else
bitsandbytes' own forward (its fused one-token kernel, and dequantize-then-matmul for a prefill
chunk, which is compute-bound anyway).

`use_fused_nf4` wraps each eligible layer's forward once, at load; a layer keeps bitsandbytes'
forward wherever the fused one does not apply, and every layer keeps it from the moment the
kernel fails to build or run on a device type (Triton or driver too old), with the reason kept.
"""

from __future__ import annotations

import functools

import torch

from .triton_route import TritonRoute

ROWS = range(2, 65)  # tokens a forward sends through the kernel: a verification's, up to 64
BLOCK = 64  # bitsandbytes' default block size, the only one the kernel reads
ROUTE = TritonRoute(".nf4_kernel", "bitsandbytes")


def use_fused_nf4(hf_model: torch.nn.Module) -> int:
    """Route the eligible 4-bit layers of `hf_model` through the fused kernel where it applies;
    returns how many layers were wrapped (0 without Triton or such layers)."""
    layers = [module for module in hf_model.modules()
              if _eligible(module) and not hasattr(module, "bitsandbytes_forward")]
    if not layers or ROUTE.kernel is None:  # Triton is imported only for a model that has such layers
        return 0
    for module in layers:
        module.bitsandbytes_forward = module.forward
        module.forward = functools.partial(_forward, module)
    return len(layers)


def _eligible(module: torch.nn.Module) -> bool:
    """A Linear4bit-like layer holding NF4 codes in bitsandbytes' plain layout."""
    weight = getattr(module, "weight", None)
    state = getattr(weight, "quant_state", None)
    return (state is not None and getattr(state, "quant_type", None) == "nf4" and state.blocksize == BLOCK
            and not state.nested and len(state.shape) == 2 and state.shape[1] % BLOCK == 0
            and weight.dtype == torch.uint8)  # codes stored as bytes (bitsandbytes may store them as bf16 words)


def _forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    state = module.weight.quant_state
    compute_dtype = module.compute_dtype or x.dtype
    if (rows not in ROWS or not ROUTE.runs_on(x.device, compute_dtype)
            or getattr(state, "packing_format_for_cpu", False)):  # bitsandbytes repacked it for its CPU kernel
        return module.bitsandbytes_forward(x)
    if state.dtype != compute_dtype:  # bitsandbytes rounds the weight to its own dtype first: keep its path
        return module.bitsandbytes_forward(x)
    try:
        pairs = getattr(module, "nf4_code_pairs", None)
        if pairs is None or pairs.device != x.device:
            pairs = module.nf4_code_pairs = ROUTE.kernel.code_pairs(state.code)
        out = ROUTE.kernel.nf4_matmul(x.reshape(rows, x.shape[-1]).to(compute_dtype).contiguous(),
                                      module.weight.data.view(-1), state.absmax, pairs, state.shape[0], module.bias)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # a kernel that does not build or run here
        ROUTE.fail(x.device, error)
        return module.bitsandbytes_forward(x)
    return out.reshape(*x.shape[:-1], state.shape[0]).to(x.dtype)
