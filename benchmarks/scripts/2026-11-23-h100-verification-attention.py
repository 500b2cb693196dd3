"""One forward of n tokens after 32K cached positions (Llama-3.1-8B shape, random bf16 weights, KV
on the GPU), before (masked SDPA over past and new, grouped heads folded: kv/queries.py
`_grouped_attention`) and after (the past unmasked through flash attention, the new tokens
masked, merged by log-sum-exp: kv/past_attention.py). Chain (causal) and tree masks; GPU time
(torch.profiler, sum of kernel times, median of 5) and wall time (median of 9); the logits of
both paths compared; a 32K chunked prefill timed both ways.
Output: $OUT/verification-attention.json (kept as bench/2026-11-23-h100-verification-attention.json)."""
import datetime
import json
import os
import statistics
import time

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from specchat.benchmarks.offload import LLAMA_31_8B, random_model
from specchat.core.kv import queries
from specchat.core.speculative.tree import Tree

CONTEXT, CHUNK, SIZES = 32768, 1024, (1, 2, 8, 16, 32, 64)
MODES = {"before": set(), "after": {"cuda"}}


def use(mode):
    queries.SPLIT_DEVICES.clear()
    queries.SPLIT_DEVICES.update(MODES[mode])


def binary_tree(n):  # node i hangs off (i - 1) // 2: as bushy as a verification tree gets
    return Tree(tuple([-1] + [(i - 1) // 2 for i in range(1, n)]))


model = random_model(LLAMA_31_8B, CONTEXT + 128, "cuda", torch.bfloat16)
ids = torch.randint(1000, (CONTEXT + 64,), generator=torch.Generator().manual_seed(0))
cache = model.new_cache()
result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0),
          "torch": torch.__version__, "transformers": transformers.__version__,
          "what": __doc__.split("Output:")[0].strip(), "context": CONTEXT}

prefill = {}
for mode in ("before", "after", "before", "after"):  # twice each, alternating: the spread shows
    use(mode)
    cache.trim(0)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for start in range(0, CONTEXT, CHUNK):
        model.forward(ids[start:start + CHUNK], torch.arange(start, start + CHUNK), cache, last_only=True)
    torch.cuda.synchronize()
    prefill.setdefault(mode, []).append(round(time.perf_counter() - begin, 3))
    print("prefill", mode, prefill[mode], flush=True)
result["prefill_32k_in_1024_chunks_seconds"] = prefill


def forward(n, shape):
    if shape == "chain" or n == 1:
        positions, mask = torch.arange(CONTEXT, CONTEXT + n), None
    else:
        tree = binary_tree(n)
        positions, mask = tree.positions(CONTEXT), tree.attention_mask(CONTEXT)
    logits = model.forward(ids[CONTEXT:CONTEXT + n], positions, cache, mask=mask)
    logits[-1, -1].item()
    cache.trim(CONTEXT)
    return logits


timings = {}
for shape in ("chain", "tree"):
    for n in SIZES:
        if shape == "tree" and n == 1:
            continue
        gpu, wall = {}, {}
        for mode in MODES:
            use(mode)
            for _ in range(3):
                forward(n, shape)
            gpu[mode] = []
            for _ in range(5):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    forward(n, shape)
                gpu[mode].append(sum(e.self_device_time_total for e in prof.key_averages()) / 1e3)
        for _ in range(11):  # interleaved, so drift hits both alike
            for mode in MODES:
                use(mode)
                begin = time.perf_counter()
                forward(n, shape)
                wall.setdefault(mode, []).append((time.perf_counter() - begin) * 1e3)
        for mode in MODES:
            timings[f"{shape} n={n} {mode}"] = {"gpu_ms": round(statistics.median(gpu[mode]), 2),
                                                "wall_ms": round(statistics.median(wall[mode]), 2),
                                                "wall_ms_spread": [round(min(wall[mode]), 2), round(max(wall[mode]), 2)]}
            print(shape, n, mode, timings[f"{shape} n={n} {mode}"], flush=True)
result["forwards"] = timings
one = timings["chain n=1 after"]
result["ratio_to_one_token"] = {key: {"gpu": round(row["gpu_ms"] / one["gpu_ms"], 2),
                                      "wall": round(row["wall_ms"] / one["wall_ms"], 2)}
                                for key, row in timings.items()}

agreement = {}
sequential = torch.cat([model.forward(ids[CONTEXT + i:CONTEXT + i + 1], torch.tensor([CONTEXT + i]), cache)
                        for i in range(64)])  # one token at a time: the decode path, no mask
cache.trim(CONTEXT)
for n in (16, 64):
    for mode in MODES:
        use(mode)
        difference = (forward(n, "chain") - sequential[:n]).abs()
        agreement[f"chain n={n} {mode} vs one token at a time"] = {
            "max_abs_logit_difference": round(float(difference.max()), 4),
            "argmax_equal": f"{int((forward(n, 'chain').argmax(-1) == sequential[:n].argmax(-1)).sum())}/{n}"}
for shape in ("chain", "tree"):
    for n in (16, 64):
        logits = {}
        for mode in MODES:
            use(mode)
            logits[mode] = forward(n, shape)
        difference = (logits["after"] - logits["before"]).abs()
        agreement[f"{shape} n={n} after vs before"] = {
            "max_abs_logit_difference": round(float(difference.max()), 4),
            "argmax_equal": f"{int((logits['after'].argmax(-1) == logits['before'].argmax(-1)).sum())}/{n}"}
agreement["logit_scale (max abs)"] = round(float(sequential.abs().max()), 3)
print(json.dumps(agreement, indent=1), flush=True)
result["logits_after_vs_before (bf16)"] = agreement

use("after")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    forward(16, "tree")
kernels = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:10]
result["top_kernels_tree_n16_after_ms"] = {e.key[:90]: round(e.self_device_time_total / 1e3, 2) for e in kernels}
use("before")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    forward(16, "tree")
kernels = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:10]
result["top_kernels_tree_n16_before_ms"] = {e.key[:90]: round(e.self_device_time_total / 1e3, 2) for e in kernels}
print(json.dumps({k: result[k] for k in ("top_kernels_tree_n16_after_ms", "top_kernels_tree_n16_before_ms")}, indent=1))
json.dump(result, open(os.path.join(os.environ.get("OUT", "."), "verification-attention.json"), "w"), indent=1)
