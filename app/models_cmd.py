"""`specchat models list|download|remove`, and the download progress line the CLI shows."""

from __future__ import annotations

import json
import sys
import time

from ..core.download import DownloadProgress, download_pair, model_status, remove_pair
from ..core.files import human_size
from ..core.fit import Machine, estimate_fit, this_machine
from ..core.registry import ModelPair, Registry


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
    machine = this_machine()
    rows = [pair_row(pair, machine) for pair in registry.pairs.values()]
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    columns = (("id", "ID"), ("download", "DOWNLOAD"), ("fit", "FITS THIS MACHINE"), ("status", "DOWNLOADED"),
               ("name", "PAIR"))
    table = [[header for _, header in columns]] + [[str(row[key]) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    print(f"\nFit is an estimate from the registry's shapes (bf16 or 4-bit weights, 4K-token retrieval cache "
          f"on the GPU, full KV in RAM). Registry: {', '.join(str(path) for path in registry.files)}")
    return 0


def pair_row(pair: ModelPair, machine: Machine) -> dict:
    """A pair for `specchat models list` and the app's Models & hardware tab: its size, fit
    verdict for `machine` with the reason, and what of it is downloaded."""
    fit = estimate_fit(pair, machine)
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
            "fits": fit.fits, "fit": fit.verdict, "fit_reason": fit.reason,
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
