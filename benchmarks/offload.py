"""Offloaded long-context verification on a CUDA GPU, timed with random weights of real shapes
(no downloads on a benchmark machine): `specchat bench --suite offload`.

Measured side by side in one process:
- the pinned host-to-device bandwidth B, and the floor of one full verification, KV bytes / B;
- one full verification (n tokens against the offloaded KV of `context` positions), with the
  layer-by-layer prefetch overlapping compute, without it (each layer copied when needed, as
  TriForce's reference does), and with attention over the stored KV computed on the CPU;
- drafting: the target over a retrieval cache of `budget` positions and a Llama-3.2-1B-shaped
  draft over a StreamingLLM cache, both on the GPU; the bytes they fetch from host memory
  (must be zero);
- the hardware profile and the target's t(n) curves with its KV on the GPU, for the planner.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict

import torch

from ..core.errors import InputError
from ..core.kv.full import FullCache
from ..core.kv.offload import OffloadedCache
from ..core.kv.retrieval import RetrievalCache
from ..core.kv.streaming import StreamingCache
from ..core.model import TransformersLM

LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0)
LLAMA_32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                   tie_word_embeddings=True)


def random_model(shape: dict, context: int, device: str, dtype: torch.dtype) -> TransformersLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=context, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return TransformersLM(hf)


def pinned_bandwidth(device: str, nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Median bytes per second of a pinned host -> device copy."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1000)
    return nbytes / statistics.median(seconds)


def _median_seconds(run, repeats: int) -> float:
    run()  # warm-up: allocations, kernel choice, the first layer's unprefetched copy
    torch.cuda.synchronize()
    seconds = []
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds)


def random_layers(config, length: int, device: str, dtype: torch.dtype, generator: torch.Generator):
    head_dim = config.head_dim
    for _ in range(config.num_hidden_layers):
        shape = (1, config.num_key_value_heads, length, head_dim)
        yield (torch.randn(shape, device=device, dtype=dtype, generator=generator),
               torch.randn(shape, device=device, dtype=dtype, generator=generator))


def _timed_forward(model: TransformersLM, cache, n: int, repeats: int) -> float:
    start = cache.length
    ids = torch.randint(model.vocab_size, (n,))

    def forward():
        model.forward(ids, torch.arange(start, start + n), cache)
        cache.trim(start)

    return _median_seconds(forward, repeats)


CURVE_CONTEXTS = [1024, 8192, 32768]
CURVE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


@torch.inference_mode()
def run_offload_bench(capacity: int = 131072, sizes: tuple[int, ...] = (1, 7, 16), budget: int = 4096,
                      draft_window: int = 1024, repeats: int = 5, curves: bool = True) -> dict:
    """`capacity` positions of offloaded KV (a power of two keeps pinned allocations exact),
    filled up to `capacity - max(sizes)` so every verification fits."""
    if not torch.cuda.is_available():
        raise InputError("the offload benchmark needs a CUDA GPU (this machine has none)")
    from ..core.hardware import probe

    device, dtype = "cuda", torch.bfloat16
    context = capacity - max(sizes)
    generator = torch.Generator(device).manual_seed(0)
    target = random_model(LLAMA_31_8B, capacity, device, dtype)
    config = target.config
    cache = OffloadedCache(config, capacity, device, dtype)
    cache.fill(random_layers(config, context, device, dtype, generator), context)
    bandwidth = pinned_bandwidth(device)
    floor = cache.nbytes / bandwidth

    verify = {}
    for overlap in (True, False):
        cache.overlap = overlap
        for n in sizes:
            before = cache.fetched_bytes
            seconds = _timed_forward(target, cache, n, repeats)
            verify[f"{'overlapped' if overlap else 'unoverlapped'} n={n}"] = {
                "seconds": seconds, "vs_floor": seconds / floor,
                "fetched_bytes_per_forward": (cache.fetched_bytes - before) / (repeats + 1)}
    cache.overlap = True

    fetched_before_drafting = cache.fetched_bytes
    retrieval = RetrievalCache(config, list(random_layers(config, budget, device, dtype, generator)), context)
    drafting = {f"retrieval n={n}": _timed_forward(target, retrieval, n, repeats) for n in (1, 3)}
    draft = random_model(LLAMA_32_1B, capacity, device, dtype)
    full = FullCache.from_layers(draft.config, list(random_layers(draft.config, draft_window + 4, device, dtype,
                                                                  generator)))
    streaming = StreamingCache.from_cache(draft.config, full, sinks=4, window=draft_window)
    drafting["draft 1B streaming n=1"] = _timed_forward(draft, streaming, 1, repeats)
    fetched_while_drafting = cache.fetched_bytes - fetched_before_drafting
    kv_bytes = cache.nbytes
    del cache, retrieval, full, streaming, draft
    torch.cuda.empty_cache()
    forward_curves = _curves(target) if curves else None

    return {
        "what": "one full verification against an offloaded KV cache; drafting on the GPU",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "target_shape": "Llama-3.1-8B (random weights, bf16)", "draft_shape": "Llama-3.2-1B (random weights, bf16)",
        "context": context, "kv_bytes": kv_bytes,
        "host_to_device_bytes_per_s": bandwidth, "floor_seconds": floor,
        "verify": verify, "drafting_seconds": drafting,
        "retrieval_budget": budget, "draft_window": draft_window,
        "fetched_bytes_while_drafting": fetched_while_drafting,
        "gpu_memory_peak_bytes": torch.cuda.max_memory_allocated(),
        "profile": json.loads(probe().to_json()),
        "target_forward_curves_kv_on_gpu": forward_curves,
    }


def _curves(target: TransformersLM) -> list[dict]:
    """t(n) of the 8B shape with its KV on the GPU (no offloading), at a few contexts."""
    from ..core.speculative.optimizer import measure_forward_times

    return [asdict(measure_forward_times(target, context, CURVE_SIZES, repeats=5)) for context in CURVE_CONTEXTS]


def draw_offload(report: dict, plt):
    figure, axis = plt.subplots(figsize=(9, 5))
    labels = list(report["verify"]) + list(report["drafting_seconds"])
    seconds = [row["seconds"] for row in report["verify"].values()] + list(report["drafting_seconds"].values())
    axis.barh(labels, seconds, color=["tab:blue"] * len(report["verify"]) + ["tab:green"] * len(report["drafting_seconds"]))
    axis.axvline(report["floor_seconds"], color="black", linestyle="--",
                 label=f"floor: KV / bandwidth = {report['floor_seconds']:.3f} s")
    axis.set_xlabel("seconds per forward")
    axis.set_title(f"{report['device']}: {report['context']:,}-token offloaded KV, "
                   f"{report['host_to_device_bytes_per_s'] / 1e9:.1f} GB/s host-to-device")
    axis.legend()
    return figure
