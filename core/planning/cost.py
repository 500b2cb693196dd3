"""Predicted time on one layout: a target forward (memory-bound: its bytes over the measured rate,
each format at its kernel's efficiency, efficiency.py), a prompt's prefill (compute-bound: its FLOPs
over an estimate of the GPU's rate) and the time to an answer that the plan minimizes.

Pure arithmetic; None wherever a rate it needs is not measured (a CPU-only profile has none).
"""

from __future__ import annotations

from ..hardware import GpuInfo
from .efficiency import kv_efficiency, weights_efficiency
from .memory import Layout, body_params, slowest

# A typical answer. The time to an answer, what the plan minimizes, is reading a prompt that fills
# the context less this, then writing this many tokens.
ANSWER_TOKENS = 512

# The profile measures bandwidth, not compute, so a GPU's dense bf16 tensor FLOP/s (fp32
# accumulate) is estimated from its measured bandwidth: FLOP/s per byte/s of the spec-sheet
# bandwidth by compute capability (spec sheets; bench/notes/plan-efficiencies.md).
FLOPS_PER_BYTE = {
    (8, 0): 150,  # A100: 312 TFLOP/s over 2.0 TB/s
    (8, 6): 75,  # GeForce Ampere: RTX 3090 71 TFLOP/s over 936 GB/s, RTX 3060 25.6 over 360
    (8, 9): 140,  # GeForce Ada: RTX 4090 165 TFLOP/s over 1,008 GB/s, RTX 4060 Ti 44 over 288
    (9, 0): 290,  # H100 SXM: 989 TFLOP/s over 3.35 TB/s
    (12, 0): 115,  # GeForce Blackwell: RTX 5090 209 TFLOP/s over 1.8 TB/s
}
FLOPS_PER_BYTE_OTHER = 40  # an unlisted card: below every listed family, so its prefill is not flattered
COPY_OVER_SPEC = 0.84  # a measured on-device copy over the spec sheet's rate (H100: 2.82 of 3.35 TB/s)
PREFILL_FLOP_SHARE = 0.35  # of that peak, a chunked prefill's (H100: 340 TFLOP/s at 32K and 128K, campaign `graphs`)


# What candidates are ranked by: the main job, a document read once, then a summary and follow-ups
# that reuse its KV. One answer alone would let a 128K prompt's read hide a decode half as fast,
# which every follow-up pays.
ANSWERS_PER_DOCUMENT = 4


def document_job_seconds(prefill_seconds: float | None, tokens_per_second: float | None, context: int) -> float | None:
    """Read a prompt filling the context less an answer, then write ANSWERS_PER_DOCUMENT answers."""
    if prefill_seconds is None or not tokens_per_second:
        return None
    return prefill_seconds + ANSWERS_PER_DOCUMENT * answer_tokens(context) / tokens_per_second


def answer_tokens(context: int) -> int:
    return min(ANSWER_TOKENS, context // 2)


def prompt_tokens(context: int) -> int:
    return context - answer_tokens(context)


def answer_seconds(prefill_seconds: float | None, tokens_per_second: float | None, context: int) -> float | None:
    """The time to an answer: read a prompt filling the context less the answer, write the answer."""
    if prefill_seconds is None or not tokens_per_second:
        return None
    return prefill_seconds + answer_tokens(context) / tokens_per_second


def predictions(layout: Layout, seconds_per_token: float | None) -> dict:
    """The plan's predicted figures for `layout` decoding at `seconds_per_token` (its speculation)."""
    step = step_seconds(layout)
    return {"predicted_tokens_per_second": 1 / seconds_per_token if seconds_per_token else None,
            "predicted_prefill_seconds": prefill_seconds(layout),
            "plain_tokens_per_second": 1 / step if step else None}


def step_seconds(layout: Layout) -> float | None:
    """One token of plain decoding at the full context."""
    return _forward_seconds(layout, verify=False)


def verification_seconds(layout: Layout) -> float | None:
    """A target forward of a few tokens at the full context (a verification): it reads the weights
    and the whole KV on the GPUs, or streams the KV over the link while the weights (and the
    resident layers' KV, in a partial offload) are read (offloaded; double buffering overlaps the
    two)."""
    return _forward_seconds(layout, verify=True)


def _forward_seconds(layout: Layout, verify: bool) -> float | None:
    rate = slowest(layout, "memory_bytes_per_s")
    h2d = slowest(layout, "host_to_device_bytes_per_s")
    if rate is None or (not layout.kv_on_chip and h2d is None):
        return None
    weights = weights_seconds(layout, rate, verify)
    kv = kv_efficiency(layout.kv_dtype)
    # Attention reads every layer's KV from GPU memory, where it lives or where it was staged.
    reading = weights + layout.full_kv / (rate * (kv.verify if verify else kv.step))
    # Offloaded: the link streams the next layers while the GPU computes (double buffering).
    return reading if layout.kv_on_chip else max(layout.streamed_kv / h2d, reading)


def weights_seconds(layout: Layout, rate: float, verify: bool) -> float:
    """Reading the output head and the decoder layers once (the embedding is read a row at a time)."""
    _, head, body = layout.weights()
    efficiency = weights_efficiency(layout.quantization)
    share = efficiency.verify if verify else efficiency.step
    return head / (rate * (share if layout.head_quantized else 1.0)) + body / (rate * share)


def retrieval_forward_seconds(layout: Layout, rate: float, verify: bool) -> float:
    """A target forward over TriForce's retrieval cache: the weights and the budget's KV, kept in
    the compute dtype."""
    return weights_seconds(layout, rate, verify) + layout.retrieval[0] * layout.kv_per_token / rate


def gpu_flops(gpu: GpuInfo) -> float | None:
    """The estimated dense bf16 FLOP/s of `gpu`, from its measured bandwidth (None if unmeasured)."""
    if gpu.memory_bytes_per_s is None:
        return None
    ratio = FLOPS_PER_BYTE.get(tuple(gpu.compute_capability), FLOPS_PER_BYTE_OTHER)
    return ratio * gpu.memory_bytes_per_s / COPY_OVER_SPEC


def prefill_seconds(layout: Layout) -> float | None:
    """Reading a prompt of `prompt_tokens(context)` in prefill chunks. Each chunk is compute-bound
    (its FLOPs at PREFILL_FLOP_SHARE of the estimated rate) unless its pass over the weights is
    slower (a quantized multi-token forward dequantizes them), and adds what it costs to attend to
    the KV before it beyond the FLOPs: an offloaded KV re-streamed over the link, or an 8-bit KV
    dequantized (efficiency.py). None without a GPU and its measured rates."""
    rate = slowest(layout, "memory_bytes_per_s")
    h2d = slowest(layout, "host_to_device_bytes_per_s")
    if rate is None or (not layout.kv_on_chip and h2d is None):
        return None
    flops = PREFILL_FLOP_SHARE * min(gpu_flops(gpu) for gpu in layout.profile.gpus
                                     if f"cuda:{gpu.index}" in layout.target_devices)
    target = layout.pair.target
    linear = 2 * body_params(target)  # FLOPs per token through the decoder layers' matmuls
    attention = 4 * target.layers * target.attention_heads * target.head_dim  # per token, per position attended
    weight_pass = weights_seconds(layout, rate, verify=True)
    dequantizing = layout.full_kv_per_token / (rate * kv_efficiency("int8").verify) if layout.kv_int8 else 0.0
    # Seconds per token of KV before the chunk: streamed (offloaded) and dequantized (8-bit); a
    # compute-dtype KV on the GPUs is attended at the FLOPs' pace.
    streamed = layout.full_kv_per_token * layout.streamed_kv / layout.full_kv
    past = dequantizing + (0.0 if layout.kv_on_chip else streamed / h2d)
    prompt, chunk, seconds = prompt_tokens(layout.context), layout.prefill_chunk, 0.0
    for start in range(0, prompt, chunk):
        tokens = min(chunk, prompt - start)
        compute = tokens * (linear + attention * (start + tokens / 2)) / flops
        seconds += max(compute, weight_pass) + start * past
    return seconds
