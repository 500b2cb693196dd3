"""Task 3 probe (issue 19): why a one-token step captured in a CUDA graph replayed slower than eager
(32.5 vs 9.5 ms of GPU time, 2026-11-23-h100-host-overhead.json). Llama-3.1-8B shape, random bf16
weights; the step at 1K and 32K cached positions, eager and replayed: each kernel's time by name,
and the attention mask transformers hands to attention in each case.
DROP_MASK=1 drops the explicit mask transformers builds under capture for a single query.
Output: $OUT/cuda-graph-probe[-mask-dropped].json (kept under bench/ with the date and device)."""
import json
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specchat.benchmarks.offload import LLAMA_31_8B, random_model
from specchat.core.kv import queries

masks_seen = []
plain_sdpa = queries.sdpa_attention_forward


DROP_SINGLE_QUERY_MASK = os.environ.get("DROP_MASK") == "1"  # second run: the floor without the mask


def recording_sdpa(module, query, key, value, attention_mask, **kwargs):
    if module.layer_idx == 0:
        masks_seen.append(None if attention_mask is None else (tuple(attention_mask.shape), str(attention_mask.dtype)))
    if DROP_SINGLE_QUERY_MASK and query.shape[2] == 1:  # one token sees every cached position anyway
        attention_mask = None
    return plain_sdpa(module, query, key, value, attention_mask, **kwargs)


queries.sdpa_attention_forward = recording_sdpa


def kernels(prof):
    rows = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
                   if e.self_device_time_total > 0), key=lambda row: -row[1])
    return {"sum_ms": round(sum(row[1] for row in rows), 2), "launches": sum(row[2] for row in rows),
            "top": [[name[:160], round(ms, 2), count] for name, ms, count in rows[:8]]}


result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
          "single-query mask dropped": DROP_SINGLE_QUERY_MASK}
model = random_model(LLAMA_31_8B, 32768 + 128, "cuda", torch.bfloat16)
ids = torch.randint(1000, (32768 + 8,), generator=torch.Generator().manual_seed(0))
for context in (1024, 32768):
    cache = model.new_cache()
    for start in range(0, context, 1024):
        model.forward(ids[start:start + 1024], torch.arange(start, start + 1024), cache, last_only=True)
    row = {}
    with torch.inference_mode():
        static_ids, static_positions = ids[context:context + 1][None].cuda(), torch.tensor([[context]], device="cuda")

        def step():
            return model.hf(input_ids=static_ids, position_ids=static_positions, past_key_values=cache.transformers_cache,
                            use_cache=True).logits

        masks_seen.clear()
        step()
        cache.trim(context)
        row["eager_mask_layer0"] = masks_seen[:]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        cache.trim(context)
        row["eager"] = kernels(prof)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
                cache.trim(context)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        masks_seen.clear()
        with torch.cuda.graph(graph):
            step()
        cache.trim(context)
        row["captured_mask_layer0"] = masks_seen[:]
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        row["replay"] = kernels(prof)
        walls = []
        for _ in range(10):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - begin) * 1e3)
        row["replay_wall_ms"] = round(statistics.median(walls), 2)
    result[f"context {context}"] = row
    print(context, json.dumps(row, indent=1), flush=True)
    del graph, cache
    torch.cuda.empty_cache()
name = "cuda-graph-probe-mask-dropped.json" if DROP_SINGLE_QUERY_MASK else "cuda-graph-probe.json"
json.dump(result, open(os.path.join(os.environ.get("OUT", "."), name), "w"), indent=1)
