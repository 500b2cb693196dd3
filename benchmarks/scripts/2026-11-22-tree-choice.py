"""Sequoia's hardware-aware optimizer on one measured acceptance vector with each machine's
measured t(n): this CPU (bench/2026-11-22-cpu-trees.json) and the H100 (8B shape at 32K, KV on
the GPU, bench/2026-11-22-h100-offload.json), for the measured draft costs and a sweep of c.
Writes bench/2026-11-22-h100-vs-cpu-tree-choice.json. Run from the repository root."""
import json
from dataclasses import asdict

from specchat.core.speculative.forward_times import ForwardTimes
from specchat.core.speculative.optimizer import choose_tree

old = json.load(open("bench/2026-11-22-h100-vs-cpu-tree-choice.json"))
acceptance = old["acceptance"]
cpu = json.load(open("bench/2026-11-22-cpu-trees.json"))
gpu = json.load(open("bench/2026-11-22-h100-offload.json"))
curves = {"cpu": ForwardTimes(**{**cpu["forward_times"], "sizes": tuple(cpu["forward_times"]["sizes"]),
                                 "ratios": tuple(cpu["forward_times"]["ratios"])})}
at_32k = next(c for c in gpu["target_forward_curves_kv_on_gpu"] if c["context"] == 32768)
curves["h100"] = ForwardTimes(**{**at_32k, "sizes": tuple(at_32k["sizes"]), "ratios": tuple(at_32k["ratios"])})
draft_1b = gpu["drafting_seconds"]["draft 1B streaming n=1"] / at_32k["one_token_seconds"]


def choice(machine, cost):
    tree = choose_tree(acceptance["p"], curves[machine], cost, 64, 8)
    return asdict(tree)


report = {
    "date": "2026-11-22", "what": old["what"], "acceptance": acceptance,
    "inputs": {"cpu": "bench/2026-11-22-cpu-trees.json (forward_times at 2,261 tokens, draft_cost)",
               "gpu": "bench/2026-11-22-h100-offload.json (target_forward_curves_kv_on_gpu at 32768, "
                      "drafting_seconds), measured after the KV and attention fixes of this date"},
    "t(n)": {machine: dict(zip(curve.sizes, curve.ratios)) for machine, curve in curves.items()},
    "choices": {
        "CPU, c = CPU 24-layer draft": choice("cpu", cpu["draft_cost"]),
        "H100, c = 1B-shape draft / 8B-shape target": {**choice("h100", draft_1b), "draft_cost": draft_1b},
    },
    "draft_cost_sweep": {str(c): {"cpu": [choice("cpu", c)[k] for k in ("size", "depth", "speedup")],
                                  "h100": [choice("h100", c)[k] for k in ("size", "depth", "speedup")]}
                         for c in (0.02, 0.05, 0.1, 0.2, 0.3, 0.4)},
}
json.dump(report, open("bench/2026-11-22-h100-vs-cpu-tree-choice.json", "w"), indent=1)
print(json.dumps(report["draft_cost_sweep"]), json.dumps(report["choices"], indent=0)[:1500])
