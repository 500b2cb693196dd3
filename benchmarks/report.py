"""Where benchmark results go: bench/<date>-<stem>.json and a PNG, labelled with the device."""

from __future__ import annotations

import json
import platform
from datetime import date
from pathlib import Path

import torch


def device_label() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def write_report(report: dict, out_dir: Path, stem: str, draw=None) -> list[Path]:
    """bench/<date>-<stem>.json, and a PNG drawn by `draw(report, pyplot) -> figure` when
    matplotlib is there."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / f"{date.today().isoformat()}-{stem}"
    json_path = base.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    written = [json_path]
    try:
        import matplotlib
    except ImportError:
        return written
    if draw is None:
        return written
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = draw(report, plt)
    figure.tight_layout()
    png_path = base.with_suffix(".png")
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return written + [png_path]
