"""`specchat bench --suite gpu`: the GPU path measured whole in one short run, one JSON (and PNG)
under bench/ with the GPU, the versions and the commit; `--dry-run` runs every section on the CPU
at toy shapes, so the real run cannot break on its first GPU.

Each section returns its figures and, where it says so, a `status` ('fail: why', 'skipped: why');
a section that raises is a failed section and the others still run. A section that would start
after the time budget is skipped with that reason. The JSON is rewritten after every section, so
a run stopped from outside keeps what it measured."""

from __future__ import annotations

import os
import platform
import subprocess
import time
import traceback
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from ..report import write_report
from ...core.errors import InputError, first_line
from . import checks, kv8, modes, offload, projection, steps, weights
from .clock import free_memory
from .rig import Rig, dry_rig, goal, gpu_rig

MEMORY_GOAL = "0.9..1.1"  # measured over the plan's prediction


def memory(rig: Rig, report: dict) -> dict:
    """Every placement measured above against the plan's arithmetic."""
    rows = [dict(row) for section in report.values() for row in section.get("memory", ())
            if row.get("measured_peak_bytes") is not None]
    if not rows:  # the CPU has no allocator statistics to hold against the plan
        return {"status": "dry-run" if rig.dry_run else "skipped: no placement ran", "rows": []}
    for row in rows:
        row["measured_over_predicted"] = row["measured_peak_bytes"] / row["predicted_bytes"]
    return {"rows": rows, "goals": [goal("memory_measured_over_planned", row["measured_over_predicted"], MEMORY_GOAL,
                                         row["placement"]) for row in rows]}


SECTIONS: dict[str, Callable[[Rig, dict], dict]] = {
    "tests": checks.tests,
    "selftest": checks.selftest,
    "graphs": steps.run,
    "quantized": weights.run,
    "kv8": kv8.run,
    "offload": offload.run,
    "memory": memory,
    "modes": modes.run,
    "projection": projection.run,
}


def parse_sections(text: str | None) -> list[str]:
    if not text:
        return list(SECTIONS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise InputError(f"--sections: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(SECTIONS)}")
    return names


def run_campaign(sections: list[str], dry_run: bool, budget_s: float, out_dir: Path, repo_root: Path,
                 progress: Callable[[str], None] = print) -> list[Path]:
    if not dry_run and not torch.cuda.is_available():
        raise InputError("the gpu suite needs a CUDA GPU (this machine has none); --dry-run rehearses it on the CPU")
    rig = (dry_rig if dry_run else gpu_rig)(budget_s, repo_root)
    stem = "cpu-dry-run-campaign" if dry_run else f"{_slug(torch.cuda.get_device_name(0))}-campaign"
    report = {"what": "specchat bench --suite gpu" + (" --dry-run" if dry_run else ""),
              "environment": _environment(rig), "budget_s": budget_s, "sections": {}}
    paths: list[Path] = []
    for name in sections:
        began = time.monotonic()
        if rig.seconds_left() <= 0:
            result = {"status": f"skipped: the {budget_s:.0f} s budget ran out"}
        else:
            try:
                result = SECTIONS[name](rig, report["sections"])
            except Exception as error:  # one broken section must not lose the others' figures
                result = {"status": f"fail: {type(error).__name__}: {first_line(error)}",
                          "traceback": traceback.format_exc()[-3000:]}
        result.setdefault("status", "dry-run" if dry_run else "pass")
        result["seconds"] = round(time.monotonic() - began, 2)
        report["sections"][name] = result
        report["goals"] = [g for section in report["sections"].values() for g in section.get("goals", ())]
        paths = write_report(report, out_dir, stem, draw_campaign if name == sections[-1] else None)
        progress(f"{name}: {result['status']} ({result['seconds']:.0f} s)")
        free_memory(rig.device)
    return paths


def _slug(device_name: str) -> str:
    words = [word for word in device_name.lower().replace("nvidia", "").split() if word not in ("geforce", "rtx")]
    return "-".join(words[:2]) or "gpu"


def _environment(rig: Rig) -> dict:
    import transformers

    environment = {"date": date.today().isoformat(), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "commit": _commit(rig.repo_root), "python": platform.python_version(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "cuda": torch.version.cuda, "device": rig.device,
                   "shape": rig.shape_name, "dtype": str(rig.dtype), "left_out": list(rig.left_out)}
    if torch.cuda.is_available():
        environment["gpu"] = torch.cuda.get_device_name(0)
        environment["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    try:
        import bitsandbytes
        environment["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        environment["bitsandbytes"] = None
    return environment


def _commit(repo_root: Path) -> str:
    """SPECCHAT_COMMIT where the caller names it (a tree copied to a GPU machine may carry another
    checkout's .git), else HEAD, with '+changes' for a modified tree."""
    fallback = os.environ.get("SPECCHAT_COMMIT", "unknown")
    if fallback != "unknown":
        return fallback
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return fallback
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") if head.returncode == 0 else fallback


def draw_campaign(report: dict, plt):
    """Each weight kind at its longest context: one step and a 16-token verification, in GPU time
    (what a launch-free path would pay) beside the wall time the eager engine pays."""
    figure, axis = plt.subplots(figsize=(9, 5))
    rows = [row for row in report["sections"].get("quantized", {}).get("kinds", []) if row.get("steps")]
    labels, series = [], {"GPU, 1 token": [], "GPU, 16 tokens": [], "wall, 1 token": [], "wall, 16 tokens": []}
    for row in rows:
        last = row["steps"][-1]
        busy, wall, most = last.get("gpu_busy_s", {}), last["wall_s"], max(last["wall_s"], key=int)
        labels.append(f"{row['kind']}\n{last['context']:,} positions")
        series["GPU, 1 token"].append((busy.get("1") or 0) * 1e3)
        series["GPU, 16 tokens"].append((busy.get(most) or 0) * 1e3)
        series["wall, 1 token"].append(wall["1"] * 1e3)
        series["wall, 16 tokens"].append(wall[most] * 1e3)
    width = 0.2
    for offset, (name, values) in enumerate(series.items()):
        axis.bar([i + (offset - 1.5) * width for i in range(len(labels))], values, width, label=name)
    axis.set_xticks(range(len(labels)), labels)
    axis.set_ylabel("ms per forward")
    axis.set_title(f"{report['environment'].get('gpu', 'CPU dry run')}: {report['environment']['shape']}, weights by kind")
    if rows:
        axis.legend()
    return figure
