"""How fast each storage format is read, relative to the bf16 forwards the cost model is stated in:
the one table of kernel efficiencies. A forward of a few tokens reads its bytes at
`memory_bytes_per_s x efficiency`, so a format read through a slower kernel costs what it does,
not what its bytes would at the card's rate. The derivations: bench/notes/plan-efficiencies.md,
from bench/2026-11-26-h100-campaign.json (GPU busy time, H100; calibration on the user's card is
to replace them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Efficiency:
    step: float  # a one-token forward (plain decoding), against a bf16 one
    verify: float  # a forward of a few tokens (a verification), against a bf16 one of as many


# The target's decoder layers by quantization (the output head reads as bf16 unless quantized too).
WEIGHTS = {
    # The reference: bf16 forwards read at the measured rate, a verification as a step (t(n) = 1
    # until calibration measures it).
    "none": Efficiency(1.0, 1.0),
    # bitsandbytes 0.50.2: a step's fused 4-bit kernel reads 0.36x as fast, a verification
    # dequantizes every layer to bf16 first, 0.18x (campaign `quantized`, 1K and 32K). Where Triton
    # runs, a verification now goes through a fused kernel (nf4_kernel.py) instead; the campaign's
    # `nf4-fused` row is to replace the 0.18 there.
    "nf4": Efficiency(0.36, 0.18),
    # LLM.int8: 0.33x for a step, 0.29x for a verification (its int8 matmul) (campaign `quantized`).
    "int8": Efficiency(0.33, 0.29),
}

# The full KV by storage, per byte stored.
KV = {
    # Flash attention reads a bf16/fp16/fp32 KV at the card's rate.
    "compute": Efficiency(1.0, 1.0),
    # Dequantizing a layer's 8-bit KV to a bf16 copy, then attending to the copy: 8.3-9.0x the bf16
    # attention's time for 0.51x its bytes at 32-128K (campaign `kv8`). Where Triton runs, the engine
    # now reads it through a fused kernel (kv/int8_kernel.py) instead; its `fused_over_bf16` in the
    # next campaign is to replace this figure there (the dequantized path stays on Windows).
    "int8": Efficiency(0.06, 0.06),
}


def weights_efficiency(quantization: str) -> Efficiency:
    return WEIGHTS[quantization]


def kv_efficiency(kv_dtype: str) -> Efficiency:
    return KV["int8" if kv_dtype == "int8" else "compute"]
