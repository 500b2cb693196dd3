"""Should the CPU attend the past unmasked (kv/past_attention.py) too? The embedded model's shape
(SmolLM2-135M, random fp32 weights) on 2 CPU threads, as on this project's 2-core machine: a
7.7K-token prefill in 1024-token chunks, a 16-node tree verification and a one-token step after
it, with the split off and on (alternating). Run on the device machine's CPU (the project's own
was saturated by other sessions that day).
Output: $OUT/cpu-split.json (kept as bench/2026-11-23-cpu-split-attention.json)."""
import datetime
import json
import os
import platform
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specchat.core.kv import queries
from specchat.core.model import TransformersLM
from specchat.core.speculative.tree import Tree

torch.set_num_threads(2)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa")
model = TransformersLM(LlamaForCausalLM(config))
LENGTH = 7680
ids = torch.randint(1000, (LENGTH + 16,), generator=torch.Generator().manual_seed(0))
tree = Tree(tuple([-1] + [(i - 1) // 2 for i in range(1, 16)]))
result = {"date": datetime.date.today().isoformat(), "device": f"CPU {platform.machine()}, 2 threads (device machine)",
          "torch": torch.__version__, "what": __doc__.split("Output:")[0].strip()}
timings: dict[str, list] = {}
for _ in range(2):
    for split in (False, True):
        queries.SPLIT_DEVICES.clear()
        queries.SPLIT_DEVICES.update({"cpu"} if split else set())
        cache = model.new_cache()
        begin = time.perf_counter()
        for start in range(0, LENGTH, 1024):
            end = min(LENGTH, start + 1024)
            model.forward(ids[start:end], torch.arange(start, end), cache, last_only=True)
        timings.setdefault(f"prefill split={split} s", []).append(round(time.perf_counter() - begin, 2))
        for name, n, mask, positions in (("tree16", 16, tree.attention_mask(LENGTH), tree.positions(LENGTH)),
                                         ("decode", 1, None, torch.tensor([LENGTH]))):
            seconds = []
            for _ in range(5):
                begin = time.perf_counter()
                model.forward(ids[LENGTH:LENGTH + n], positions, cache, mask=mask)
                seconds.append(time.perf_counter() - begin)
                cache.trim(LENGTH)
            timings.setdefault(f"{name} split={split} ms", []).append(round(statistics.median(seconds) * 1e3, 1))
        print(timings, flush=True)
result["timings (two alternating rounds)"] = timings
json.dump(result, open(os.path.join(os.environ.get("OUT", "."), "cpu-split.json"), "w"), indent=1)
