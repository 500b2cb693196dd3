"""GPU time of one forward of n tokens after 32K cached positions (Llama-3.1-8B shape, random
weights) with transformers' SDPA and with specchat's folded attention; CAT_CACHE=1 measures the
old torch.cat KV appends. Output: bench/2026-11-22-h100-verification-gpu-time.json."""
import torch, time, json, os, statistics
from torch.profiler import profile, ProfilerActivity
from specchat.core.bench_offload import LLAMA_31_8B, random_model
import specchat.core.kv.full as full
from transformers import DynamicCache
if os.environ.get("CAT_CACHE"):  # the baseline: transformers' DynamicCache, which appends by torch.cat
    full._growing_cache = lambda config: DynamicCache(config=config)
model = random_model(LLAMA_31_8B, 32768 + 128, "cuda", torch.bfloat16)
context = 32768
ids = torch.randint(1000, (context + 64,))
cache = model.new_cache()
for s in range(0, context, 1024):
    model.forward(ids[s:s+1024], torch.arange(s, s+1024), cache, last_only=True)
def fwd(n):
    out = model.forward(ids[context:context+n], torch.arange(context, context+n), cache)
    out[-1,-1].item(); cache.trim(context)
result = {}
for attention in ("sdpa", "specchat_sdpa"):
    model.hf.set_attn_implementation(attention)
    for n in (1, 2, 8, 32):
        for _ in range(3): fwd(n)
        cuda = []
        for _ in range(5):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fwd(n)
            cuda.append(sum(e.self_device_time_total for e in prof.key_averages()) / 1e3)
        wall = []
        for _ in range(9):
            t = time.perf_counter(); fwd(n); wall.append((time.perf_counter() - t) * 1e3)
        result[f"{attention} n={n}"] = {"gpu_ms": round(statistics.median(cuda), 2), "wall_ms": round(statistics.median(wall), 2)}
        print(attention, n, result[f"{attention} n={n}"], flush=True)
json.dump(result, open(os.path.join(os.environ.get("OUT", "."), "gpu_time" + os.environ.get("CAT_CACHE", "") + ".json"), "w"), indent=1)
