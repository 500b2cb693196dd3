"""Where the wall time of a forward goes when the GPU is not the bottleneck (Llama-3.1-8B shape,
random bf16 weights, 32K cached positions):
1. host time of one attention call, before (masked SDPA, heads folded) and after (past unmasked +
   new masked, merged by log-sum-exp), over a short past so the GPU never holds the host back;
2. host time to enqueue a whole forward (model.hf, no synchronization) vs its wall time;
3. a one-token decode step captured in a CUDA graph at a fixed cache length and replayed: the wall
   time a launch-free step would take (task 3 of issue 19, a feasibility probe only).
Output: $OUT/host-overhead.json (kept as bench/2026-11-23-h100-host-overhead.json)."""
import datetime
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch

from specchat.benchmarks.offload import LLAMA_31_8B, random_model
from specchat.core.kv import queries
from specchat.core.kv.past_attention import NewTokenMask, past_and_new_attention
from specchat.core.speculative.tree import Tree

CONTEXT = 32768
result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0),
          "torch": torch.__version__, "what": __doc__.split("Output:")[0].strip()}


def host_us(call, repeats=400):
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(repeats):
        call()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return round(elapsed / repeats * 1e6, 1)


# 1. one attention call (layer shape of the 8B model, n = 16, a 256-position past)
n, past = 16, 256
query = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
key, value = (torch.randn(1, 8, past + n, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
tree = Tree(tuple([-1] + [(i - 1) // 2 for i in range(1, n)]))
allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), tree.ancestors], dim=1).cuda()
module = SimpleNamespace(num_key_value_groups=4, layer_idx=0, is_causal=True)
mask = NewTokenMask(tree.ancestors, n)
result["attention_call_host_us (n=16, tree)"] = {
    "before": host_us(lambda: queries._grouped_attention(module, query, key, value, allowed[None, None], 0.088)),
    "after": host_us(lambda: past_and_new_attention(query, key, value, 0.088, mask)),
    "one torch.add, for scale": host_us(lambda: key + 1)}
print(result, flush=True)

# 2. enqueue vs wall of a whole forward
model = random_model(LLAMA_31_8B, CONTEXT + 128, "cuda", torch.bfloat16)
ids = torch.randint(1000, (CONTEXT + 64,), generator=torch.Generator().manual_seed(0))
cache = model.new_cache()
for start in range(0, CONTEXT, 1024):
    model.forward(ids[start:start + 1024], torch.arange(start, start + 1024), cache, last_only=True)


@torch.inference_mode()
def enqueue_and_wall(n, shape, mode):
    queries.SPLIT_DEVICES.clear()
    queries.SPLIT_DEVICES.update({"cuda"} if mode == "after" else set())
    if shape == "tree":
        tree = Tree(tuple([-1] + [(i - 1) // 2 for i in range(1, n)]))
        positions, mask = tree.positions(CONTEXT), tree.attention_mask(CONTEXT)
    else:
        positions, mask = torch.arange(CONTEXT, CONTEXT + n), None
    enqueue, wall = [], []
    for repeat in range(13):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        device_mask = None if mask is None else mask.to("cuda", torch.bfloat16)
        with queries.new_tokens_see_the_past(device_mask, n):
            out = model.hf(input_ids=ids[CONTEXT:CONTEXT + n][None].cuda(), position_ids=positions[None].cuda(),
                           attention_mask=device_mask,
                           past_key_values=cache.transformers_cache, use_cache=True)
        queued = time.perf_counter()
        out.logits[0].float().cpu()
        done = time.perf_counter()
        cache.trim(CONTEXT)
        if repeat >= 3:
            enqueue.append((queued - begin) * 1e3)
            wall.append((done - begin) * 1e3)
    return {"enqueue_ms": round(statistics.median(enqueue), 2), "wall_ms": round(statistics.median(wall), 2)}


forwards = {}
for n, shape in ((1, "chain"), (16, "chain"), (16, "tree")):
    for mode in ("before", "after"):
        forwards[f"{shape} n={n} {mode}"] = enqueue_and_wall(n, shape, mode)
        print(shape, n, mode, forwards[f"{shape} n={n} {mode}"], flush=True)
result["forward_enqueue_vs_wall"] = forwards

# 3. a one-token step captured in a CUDA graph at a fixed length, replayed
probe = {}
try:
    with torch.inference_mode():
        static_ids, static_positions = ids[CONTEXT:CONTEXT + 1][None].cuda(), torch.tensor([[CONTEXT]], device="cuda")

        def step():
            return model.hf(input_ids=static_ids, position_ids=static_positions, past_key_values=cache.transformers_cache,
                            use_cache=True).logits

        eager = step()[0, -1].float()
        cache.trim(CONTEXT)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
                cache.trim(CONTEXT)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        cache.trim(CONTEXT)
        graph.replay()
        probe["max_abs_difference_vs_eager"] = float((captured[0, -1].float() - eager).abs().max())
        walls = []
        for _ in range(20):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            graph.replay()
            captured[0, -1, 0].item()
            walls.append((time.perf_counter() - begin) * 1e3)
        probe["replay_wall_ms"] = round(statistics.median(walls), 2)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events = []
        for _ in range(10):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            events.append(start.elapsed_time(end))
        probe["replay_event_ms"] = round(statistics.median(events), 2)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        probe["replay_kernel_sum_ms"] = round(sum(e.self_device_time_total for e in prof.key_averages()) / 1e3, 2)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        cache.trim(CONTEXT)
        averages = prof.key_averages()
        probe["eager_kernel_sum_ms"] = round(sum(e.self_device_time_total for e in averages) / 1e3, 2)
        probe["eager_kernel_launches"] = sum(e.count for e in averages if e.self_device_time_total > 0)
        probe["eager_top_kernels_ms"] = {e.key[:80]: round(e.self_device_time_total / 1e3, 2) for e in
                                         sorted(averages, key=lambda e: -e.self_device_time_total)[:8]}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        probe["replay_top_kernels_ms"] = {e.key[:80]: round(e.self_device_time_total / 1e3, 2) for e in
                                          sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:8]}
except Exception as error:  # a probe: record why capture failed
    probe["failed"] = repr(error)[:500]
print(probe, flush=True)
result["cuda_graph_one_token_probe"] = probe
json.dump(result, open(os.path.join(os.environ.get("OUT", "."), "host-overhead.json"), "w"), indent=1)
