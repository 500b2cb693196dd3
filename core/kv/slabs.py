"""How an offloaded KV's pinned memory is allocated: PyTorch's pinned allocator rounds every block
up to a power of two and keeps it, so one block per layer's keys would pin up to twice the KV (an
8-bit row of 132 bytes makes a 128K layer 132 MiB: 256 MiB pinned). Blocks whose sizes are powers
of two lose nothing, so the tensors are packed into the fewest bytes of such blocks.

Pure arithmetic, without torch: the plan counts the same bytes (planning/memory.py)."""

from __future__ import annotations


def slabs(tensor_bytes: int, count: int) -> tuple[tuple[int, int], ...]:
    """(block bytes, tensors in it) for `count` tensors of `tensor_bytes`, each block a power of
    two and each tensor whole in one block: the fewest bytes in all, in the smallest blocks that
    give them (one huge page-locked block is the likeliest to fail)."""
    if count <= 0 or tensor_bytes <= 0:
        return ()
    best: tuple[tuple[int, int], ...] = ()
    size = _power_of_two_at_least(tensor_bytes)
    while True:
        per_block = size // tensor_bytes
        full, left = divmod(count, per_block)
        layout = ((size, per_block),) * full + (((_power_of_two_at_least(left * tensor_bytes), left),) if left else ())
        if not best or _bytes(layout) < _bytes(best):
            best = layout
        if per_block >= count:  # one block holds them all: larger ones only add bytes
            return best
        size *= 2


def pinned_bytes(tensor_bytes: int, count: int) -> int:
    """What `slabs` pins in all."""
    return _bytes(slabs(tensor_bytes, count))


def _bytes(layout: tuple[tuple[int, int], ...]) -> int:
    return sum(size for size, _ in layout)


def _power_of_two_at_least(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()
