"""The GPU campaign's clocks: a call's median wall time, and the GPU's busy time during one call
(the sum of its kernels), whose ratio tells a launch-bound step from a bandwidth-bound one."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def wall_seconds(run: Callable[[], object], device: torch.device | str, repeats: int) -> float:
    """Median wall time of `run()` to its last kernel's end, after one untimed warm-up."""
    run()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        synchronize(device)
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def busy_seconds(run: Callable[[], object], device: torch.device | str) -> float | None:
    """The summed kernel and copy time of one `run()` on a CUDA device (None elsewhere)."""
    return kernel_profile(run, device)[0]


def kernel_profile(run: Callable[[], object], device: torch.device | str) -> tuple[float | None, str | None]:
    """(summed kernel and copy seconds of one `run()`, the name of the kernel that took longest);
    (None, None) off CUDA."""
    if torch.device(device).type != "cuda":
        return None, None
    from torch.profiler import ProfilerActivity, profile

    run()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        synchronize(device)
    events = [event for event in prof.key_averages() if event.self_device_time_total > 0]
    top = max(events, key=lambda event: event.self_device_time_total).key[:120] if events else None
    return sum(event.self_device_time_total for event in events) / 1e6, top


def reset_peak(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device | str) -> int | None:
    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None


def allocated_bytes(device: torch.device | str) -> int | None:
    return torch.cuda.memory_allocated(device) if torch.device(device).type == "cuda" else None


def free_memory(device: torch.device | str) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
