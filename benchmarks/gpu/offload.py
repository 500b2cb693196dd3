"""The `offload` section: the target's full KV in host memory (pinned on CUDA), streamed per layer,
as TriForce's last stage and the plan's offloaded placements use it.

At each offloaded context: one full verification (1 and 16 tokens) against its link floor (KV bytes
/ measured host-to-device bandwidth; goal <= 1.3 at the longest), a retrieval cache's rebuild from
the offloaded KV, the retrieval stage's step and the draft's step over its StreamingLLM cache, and
the full verification again over the KV in 8 bits (`int8`: half the bytes streamed) and over a
partial offload (`partial`: half the layers' KV on the device, the others' streamed). At the
first context also a prefill into the offloaded cache in the plan's chunks: its time, the bytes it
streamed, and the GPU memory it needed beyond the weights against the plan's activation budget."""

from __future__ import annotations

import time

import torch

from ..offload import random_layers, pinned_bandwidth
from ...core.kv.full import FullCache
from ...core.kv.int8_rows import pack
from ...core.kv.offload import OffloadedCache
from ...core.kv.retrieval import RetrievalCache
from ...core.kv.streaming import StreamingCache
from ...core.planning import DRAFT_SINKS, RETRIEVAL_CHUNK_OFFLOADED, activation_bytes
from .clock import allocated_bytes, free_memory, peak_bytes, reset_peak, synchronize, wall_seconds
from .rig import Rig, goal
from .shapes import model_spec, prefill, random_ids, random_model

FLOOR_GOAL = 1.3  # a full verification's time over KV bytes / bandwidth
VERIFY_TOKENS = 16


def run(rig: Rig, report: dict) -> dict:
    if not rig.offloaded_contexts:
        return {"status": "skipped: no context fits this machine (" + "; ".join(rig.left_out) + ")"}
    longest = max(rig.offloaded_contexts)
    target = random_model(rig.shape, longest, rig.device, rig.dtype)
    draft = random_model(rig.draft_shape, longest, rig.device, rig.dtype)
    config, generator = target.config, torch.Generator(rig.device).manual_seed(0)
    bandwidth = pinned_bandwidth(rig.device) if rig.device == "cuda" else None
    result = {"shape": rig.shape_name, "draft_layers": rig.draft_shape["num_hidden_layers"],
              "host_to_device_bytes_per_s": bandwidth, "contexts": []}
    result["prefill"] = _prefill(rig, target)
    if "peak_beyond_resident_bytes" in result["prefill"]:
        result["memory"] = [{"placement": f"{rig.shape_name} {rig.dtype}, offloaded KV, temporaries of a "
                                          f"{rig.offloaded_prefill_chunk}-token prefill chunk at "
                                          f"{rig.offloaded_contexts[0]:,} positions",
                             "predicted_bytes": result["prefill"]["planned_activation_bytes"],
                             "measured_peak_bytes": result["prefill"]["peak_beyond_resident_bytes"]}]
    for capacity in rig.offloaded_contexts:
        if rig.seconds_left() <= 0:
            result["contexts"].append({"capacity": capacity, "status": "skipped: the time budget ran out"})
            continue
        context = capacity - VERIFY_TOKENS
        began = time.perf_counter()
        cache = OffloadedCache(config, capacity, rig.device, rig.dtype)
        allocate_s = time.perf_counter() - began
        cache.fill(random_layers(config, context, rig.device, rig.dtype, generator), context)
        floor = cache.nbytes / bandwidth if bandwidth else None
        row = {"capacity": capacity, "context": context, "kv_bytes": cache.nbytes, "host_allocation_s": allocate_s,
               "floor_s": floor, "verify_s": {}}
        for n in (1, VERIFY_TOKENS):
            before = cache.fetched_bytes
            row["verify_s"][str(n)] = _timed_forward(rig, target, cache, n)
            row[f"fetched_bytes_per_forward_{n}"] = (cache.fetched_bytes - before) / (rig.repeats + 1)
        if floor:
            row["full_verification_over_floor"] = row["verify_s"][str(VERIFY_TOKENS)] / floor
        row.update(_drafting(rig, target, draft, cache, generator))
        del cache
        free_memory(rig.device)
        row["int8"] = _verification(rig, target, capacity, context, bandwidth, generator, int8=True)
        row["partial"] = _verification(rig, target, capacity, context, bandwidth, generator,
                                       resident=config.num_hidden_layers // 2)
        result["contexts"].append(row)
    ran = [row for row in result["contexts"] if "floor_s" in row]
    if ran and ran[-1]["floor_s"]:
        result["goals"] = [goal("full_verification_over_floor", ran[-1]["full_verification_over_floor"],
                                f"<= {FLOOR_GOAL}", f"{VERIFY_TOKENS} tokens at {ran[-1]['context']:,} positions")]
    return result


def _timed_forward(rig: Rig, model, cache, n: int) -> float:
    start = cache.length
    ids = random_ids(model.vocab_size, n, seed=start)

    def forward():
        model.forward(ids, torch.arange(start, start + n), cache)
        cache.trim(start)

    return wall_seconds(forward, rig.device, rig.repeats)


def _verification(rig: Rig, target, capacity: int, context: int, bandwidth: float | None,
                  generator: torch.Generator, int8: bool = False, resident: int = 0) -> dict:
    """The same full verification over an 8-bit offloaded KV (packed rows streamed, dequantized a
    layer at a time on the device: half the link's bytes), or with `resident` layers' KV on the
    device (only the others' streamed), against the floor of the bytes streamed. The plan prices
    it max(streamed KV / link, weights + every layer's KV read, or dequantized) (planning/cost.py)."""
    config = target.config
    cache = OffloadedCache(config, capacity, rig.device, rig.dtype, int8=int8, resident_layers=resident)
    layers = random_layers(config, context, rig.device, rig.dtype, generator)
    cache.fill(((pack(keys), pack(values)) for keys, values in layers) if int8 else layers, context)
    streamed = cache.nbytes * len(cache.streamed) // config.num_hidden_layers
    floor = streamed / bandwidth if bandwidth else None
    before = cache.fetched_bytes
    row = {"kv_bytes": cache.nbytes, "streamed_kv_bytes": streamed, "resident_layers": resident, "floor_s": floor,
           "verify_s": _timed_forward(rig, target, cache, VERIFY_TOKENS)}
    row["fetched_bytes_per_forward"] = (cache.fetched_bytes - before) / (rig.repeats + 1)
    if floor:
        row["full_verification_over_floor"] = row["verify_s"] / floor
    del cache
    free_memory(rig.device)
    return row


def _drafting(rig: Rig, target, draft, cache, generator) -> dict:
    """TriForce's two drafting stages at this context, and a retrieval rebuild from the offloaded KV."""
    config = target.config
    queries = {index: torch.randn(config.num_attention_heads, config.head_dim, device=rig.device, dtype=rig.dtype,
                                  generator=generator) for index in range(config.num_hidden_layers)}
    synchronize(rig.device)
    began = time.perf_counter()
    retrieval = RetrievalCache.from_full(cache, queries, rig.retrieval_budget, RETRIEVAL_CHUNK_OFFLOADED,
                                         recent=rig.draft_window, device=torch.device(rig.device))
    synchronize(rig.device)
    rebuild_s = time.perf_counter() - began
    retrieval_step_s = _timed_forward(rig, target, retrieval, 1)
    del retrieval
    window = rig.draft_window
    full = FullCache.from_layers(draft.config, list(random_layers(draft.config, window + DRAFT_SINKS, rig.device,
                                                                  rig.dtype, generator)))
    streaming = StreamingCache.from_cache(draft.config, full, sinks=DRAFT_SINKS, window=window)
    draft_step_s = _timed_forward(rig, draft, streaming, 1)
    return {"retrieval_rebuild_s": rebuild_s, "retrieval_step_s": retrieval_step_s, "draft_step_s": draft_step_s,
            "retrieval_budget": rig.retrieval_budget}


def _prefill(rig: Rig, target) -> dict:
    """A prefill of the first offloaded context into an offloaded cache, in the plan's largest chunk."""
    context = rig.offloaded_contexts[0]
    cache = OffloadedCache(target.config, context, rig.device, rig.dtype)
    ids = random_ids(target.vocab_size, context)
    free_memory(rig.device)
    weights = allocated_bytes(rig.device)
    reset_peak(rig.device)
    seconds = prefill(target, cache, ids, context, rig.offloaded_prefill_chunk)
    peak = peak_bytes(rig.device)
    spec = model_spec(target, rig.dtype)
    dtype_bytes = torch.tensor([], dtype=rig.dtype).element_size()
    row = {"context": context, "chunk": rig.offloaded_prefill_chunk, "seconds": seconds,
           "tokens_per_s": context / seconds, "fetched_bytes": cache.fetched_bytes,
           "planned_activation_bytes": activation_bytes(spec, rig.offloaded_prefill_chunk, dtype_bytes)}
    if peak is not None:
        row["peak_beyond_resident_bytes"] = peak - weights
    del cache
    free_memory(rig.device)
    return row
