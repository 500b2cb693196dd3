"""`specchat models list|download|remove`, and the download progress line the CLI shows."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..core.download import DownloadProgress, download_pair
from ..core.model_cache import model_status, remove_pair
from ..core.files import human_size
from ..core.registry import ModelPair, Registry

if TYPE_CHECKING:  # the planner imports torch: only `models list` needs it, not download or remove
    from ..core.hardware import HardwareProfile
    from ..core.planning import Alternative, Plan

SLOW_ON_CPU_BYTES = 10**9  # weights a CPU reads per token above which a pair is called slow there


def run_models(args, registry: Registry) -> int:
    if args.models_command == "list":
        return _list(registry, args.json)
    pair = registry.get(args.pair)
    if args.models_command == "download":
        if pair.source != "hub":
            print(f"{pair.id} is built in: nothing to download")
            return 0
        paths = download_pair(pair, ProgressLine(), token=args.token)
        for role, path in paths.items():
            print(f"{role}: {path}")
        return 0
    removed, kept = remove_pair(pair, registry)
    for repo in removed:
        print(f"removed {repo}")
    for repo in kept:
        print(f"kept {repo}: another downloaded pair uses it")
    return 0


def _list(registry: Registry, as_json: bool) -> int:
    profile = listing_profile()
    rows = [pair_row(pair, profile, registry) for pair in registry.pairs.values()]
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    columns = (("id", "ID"), ("download", "DOWNLOAD"), ("fit", "FITS THIS MACHINE"), ("status", "DOWNLOADED"),
               ("name", "PAIR"))
    table = [[header for _, header in columns]] + [[str(row[key]) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    print("\nFit is the plan `specchat plan --pair ID --context N` shows, at each pair's full context on this "
          "machine; loading a pair follows the same plan (`--json` has the reasons). "
          f"Registry: {', '.join(str(path) for path in registry.files)}")
    return 0


def listing_profile() -> HardwareProfile:
    """This machine's profile for a listing, without measuring anything: the cached profile that
    `specchat plan` and loading use when there is one, else a probe without measurement (a fit
    depends only on memory sizes, which it has; measuring waits for `specchat profile` or a load)."""
    from ..core.hardware import HardwareProfile, cache_dir, load_or_probe, probe

    current = probe(measure_bandwidth=False)
    try:
        HardwareProfile.load(cache_dir() / current.machine_key() / "profile.json")
    except ValueError:  # none cached (or unreadable, which load_or_probe would measure again)
        return current
    return load_or_probe()  # the cached profile with fresh free memory and its curves: measures nothing


@dataclass(frozen=True)
class Fit:
    """Whether a pair fits a machine at its full context: the plan's verdict in a few words."""

    fits: bool
    verdict: str  # a few words for a table
    reason: str  # one sentence with the figures; a refusal's says what fits instead
    alternatives: tuple[Alternative, ...] = ()  # when it does not fit: what does, nearest first
    slow: bool = False  # it fits, but on the CPU, reading over `SLOW_ON_CPU_BYTES` of weights per token
    plain: str = ""  # the verdict in everyday words, for people who never heard of a KV cache
    tokens_per_second: float | None = None  # the plan's predicted decode speed (None: not predicted, as on a CPU)


def plan_fit(pair: ModelPair, profile: HardwareProfile, registry: Registry | None = None) -> Fit:
    """Does `pair` fit `profile`'s machine at its full context? The plan's answer: `make_plan` at
    `pair.context_length`, exactly as `specchat plan`, the app's "Use this pair" and loading plan it."""
    from ..core.planning import Overrides, PlanRefused, make_plan, precision_setting

    try:
        plan = make_plan(profile, pair, pair.context_length, Overrides(precision=precision_setting()),
                         registry=registry)
    except PlanRefused as refusal:
        shorter = next((alternative.context for alternative in refusal.alternatives
                        if alternative.pair_id == pair.id and alternative.quantization is None
                        and alternative.precision is None), None)
        verdict = "does not fit" + (f" (up to {shorter // 1024}K tokens)" if shorter else "")
        plain = "Too big for this computer" + (
            f" at its full length; it would fit for documents up to about {shorter * 3 // 4:,} words." if shorter
            else ".")
        return Fit(False, verdict, str(refusal), refusal.alternatives, plain=plain)
    slow = plan.target_devices == ("cpu",) and _weight_bytes(plan) > SLOW_ON_CPU_BYTES
    return Fit(True, _fit_verdict(plan, pair), _fit_reason(plan), slow=slow, plain=_fit_plain(plan, slow),
               tokens_per_second=plan.predicted_tokens_per_second)


def _fit_plain(plan: Plan, slow: bool) -> str:
    if plan.target_devices == ("cpu",):
        return ("Runs on the processor, slowly: a graphics card would make it many times faster." if slow else
                "Runs on the processor.")
    words = ["Runs on your graphics card"]
    if plan.weights in ("int8", "nf4") or plan.kv_dtype == "int8":
        words.append("stored compressed so that it fits")
    if plan.kv_device == "cpu-pinned":
        partly = "partly " if plan.kv_resident_layers else ""
        words.append(f"with what it remembers of long documents {partly}kept in the computer's memory")
    return ", ".join(words) + "."


def _fit_verdict(plan: Plan, pair: ModelPair) -> str:
    notes = [{"int8": "8-bit", "nf4": "4-bit"}.get(plan.weights)]
    if plan.weights in ("int8", "nf4") and plan.head_weights == plan.weights:
        notes.append("output head too")
    offloaded = (" partly offloaded to RAM" if plan.kv_resident_layers else
                 " offloaded to RAM" if plan.kv_device == "cpu-pinned" else "")
    notes.append(f"KV in 8 bits{offloaded}" if plan.kv_dtype == "int8" else f"KV{offloaded}" if offloaded else None)
    if pair.draft is not None and plan.draft_device is None and plan.mode != "plain":
        notes.append("no draft model")
    if plan.target_devices == ("cpu",):
        notes.append("CPU only, slow" if _weight_bytes(plan) > SLOW_ON_CPU_BYTES else "CPU only")  # Fit.slow
    notes = [note for note in notes if note]
    return "fits" + (f" ({', '.join(notes)})" if notes else "")


def _fit_reason(plan: Plan) -> str:
    """Where the plan puts the weights and the KV, why those weights, and how full each device is."""
    if plan.target_devices == ("cpu",):
        weights = human_size(_weight_bytes(plan))
        where = (f"runs on the CPU, slowly: every token reads {weights} of weights" if _weight_bytes(plan) >
                 SLOW_ON_CPU_BYTES else f"runs on the CPU ({weights} of weights)")
    else:
        kv = "in pinned RAM" if plan.kv_device == "cpu-pinned" else f"on {plan.kv_device}"
        if plan.kv_resident_layers:
            kv = f"on {plan.resident_words()}, the rest in pinned RAM"
        where = (f"{plan.weights} weights on {'+'.join(plan.target_devices)}, full KV {kv}"
                 + (f", draft on {plan.draft_device}" if plan.draft_device else ""))
    used = ", ".join(f"{human_size(device.used_bytes)} of the {human_size(device.capacity_bytes - device.margin_bytes)}"
                     f" usable on {device.device}" for device in plan.devices if device.used_bytes)
    why = f"; {plan.reasons['weights']}" if plan.weights in ("int8", "nf4") else ""
    if plan.precision == "auto" and (plan.weights in ("int8", "nf4") or plan.kv_dtype == "int8"):
        why += f"; {plan.reasons['precision']}"  # quantized for speed, against the exact placement
    return f"{where}{why}; at {plan.context:,} tokens it uses {used}"


def _weight_bytes(plan: Plan) -> int:
    return sum(item.bytes for item in plan.memory if item.what.startswith("target weights"))


def pair_row(pair: ModelPair, profile: HardwareProfile, registry: Registry | None = None) -> dict:
    """A pair for `specchat models list` and the app's Models & hardware tab: its size, whether it
    fits `profile`'s machine (the plan at its full context) with the reason, and what of it is
    downloaded. `registry` lets a refusal name a smaller pair that fits."""
    fit = plan_fit(pair, profile, registry)
    if pair.source == "embedded":
        downloaded, present = "built in", 0
    else:
        statuses = [model_status(model) for model in pair.models]
        present = sum(status.present_bytes for status in statuses)
        downloaded = "yes" if all(status.complete for status in statuses) else \
            f"partly ({human_size(present)})" if present else "no"
    return {"id": pair.id, "name": pair.name, "source": pair.source, "context_length": pair.context_length,
            "license": pair.license, "gated": pair.gated,
            "download_bytes": pair.download_bytes, "download": human_size(pair.download_bytes) if pair.download_bytes else "-",
            "fits": fit.fits, "fit": fit.verdict, "fit_reason": fit.reason, "fit_plain": fit.plain,
            "fit_alternatives": [asdict(alternative) for alternative in fit.alternatives],
            "downloaded": downloaded == "yes" or pair.source == "embedded", "present_bytes": present,
            "status": downloaded}


class ProgressLine:
    """Download progress on stderr: file, bytes, rate and time left. On a terminal one line
    redrawn in place; in a log, a plain line every few seconds."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.live = stream.isatty()
        self.interval = 0.25 if self.live else 5.0
        self.started = time.monotonic()
        self.first_done: int | None = None
        self.shown_at = 0.0

    def __call__(self, progress: DownloadProgress) -> None:
        now = time.monotonic()
        if self.first_done is None:
            self.first_done = progress.done_bytes
        finished = progress.done_bytes >= progress.total_bytes
        if now - self.shown_at < self.interval and not finished:
            return
        self.shown_at = now
        rate = (progress.done_bytes - self.first_done) / max(now - self.started, 1e-9)
        line = progress_text(progress, rate)
        if self.live:
            self.stream.write(f"\r{line}\033[K" + ("\n" if finished else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def progress_text(progress: DownloadProgress, rate: float) -> str:
    """File, bytes done of total, percent, rate (bytes per second) and time left: the CLI's
    progress line and the app's."""
    left = (progress.total_bytes - progress.done_bytes) / rate if rate > 0 else None
    eta = f", {left / 60:.0f} min left" if left is not None and left >= 90 else \
        f", {left:.0f} s left" if left is not None else ""
    percent = 100 * progress.done_bytes / progress.total_bytes if progress.total_bytes else 100
    return (f"{progress.model} {progress.filename}: {human_size(progress.done_bytes)} of "
            f"{human_size(progress.total_bytes)} ({percent:.0f}%), {human_size(rate)}/s{eta}")
