"""Giving memory back. PyTorch keeps the GPU blocks and the page-locked host blocks it frees,
for reuse by allocations of the same sizes: after a failed answer, an out-of-memory measurement or
a model switched out (whose offloaded KV pinned gigabytes), they would stay held from the OS, the
next model and the next probe of free memory."""

from __future__ import annotations

import gc

import torch


def release_gpu_memory() -> None:
    """The GPU allocator's cached blocks."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_cached_memory() -> None:
    """Everything a dropped model held: unreachable objects collected, then the GPU's cached
    blocks and the pinned host blocks (PyTorch's own call, private, present since 2.5)."""
    gc.collect()
    release_gpu_memory()
    host = getattr(torch._C, "_host_emptyCache", None) if torch.cuda.is_available() else None
    if host is not None:
        host()
