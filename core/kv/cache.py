"""The interface every KV cache implements (`FullCache`, `OffloadedCache`, `RetrievalCache`,
`StreamingCache`): what the model adapter, the decoders and the drafters may ask of a cache.

Positions are token positions in the text; slots are where a cache keeps entries. They coincide
in a full or offloaded cache; a streaming or retrieval cache holds fewer slots than positions.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from transformers.cache_utils import Cache


@runtime_checkable
class KVCache(Protocol):
    config: object
    """The transformers config the cache's shapes come from."""

    transformers_cache: Cache
    """The transformers Cache handed to the model's forward, which appends the new tokens' entries."""

    @property
    def length(self) -> int:
        """Positions covered: one past the last position whose keys and values are held."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held now, on every device (spare reserved capacity not counted)."""
        ...

    def trim(self, length: int) -> None:
        """Drop everything after the first `length` positions (rejected draft tokens)."""
        ...

    def keep(self, positions: torch.Tensor) -> None:
        """Keep only `positions` (ascending), renumbered 0, 1, ...: a tree's accepted path after its prefix."""
        ...

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [1, kv_heads, slots, head_dim] of every slot held, as views."""
        ...


def rows_at(stored_layers: list[tuple[torch.Tensor, torch.Tensor]], seen, positions: torch.Tensor
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`layers_at` of a full or offloaded cache: per layer the (keys, values) [1, kv_heads,
    len(positions), head_dim] at `positions` of its stored rows [1, kv_heads, length, width], new
    tensors, each read where it lies and turned by `seen` into what attention sees."""
    layers = []
    for keys, values in stored_layers:
        at = positions.to(keys.device)
        layers.append((seen(keys[:, :, at]), seen(values[:, :, at])))
    return layers



def head_rows(stored: torch.Tensor, kept: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The rows at `kept` [kv_heads, k] (positions, per head) of `stored` [kv_heads, length, width],
    as [kv_heads, k, width], written into `out` [kv_heads * k, width] when given (pinned host
    memory, for an asynchronous copy to a GPU). Whole rows are copied at once where each head's
    rows are evenly spaced in memory, as in every cache here: `gather` reads an index per element
    (15-25x slower on a CPU, for a retrieval rebuild's 1K positions of an 8B layer at 128K)."""
    heads, length, width = stored.shape
    kept = kept.to(stored.device)
    if stored.stride(2) != 1 or stored.stride(1) != width or stored.stride(0) % width:
        rows = stored.gather(1, kept[..., None].expand(-1, -1, width))
        return rows if out is None else out.view(heads, -1, width).copy_(rows)
    per_head = stored.stride(0) // width
    every_row = stored.as_strided(((heads - 1) * per_head + length, width), (width, 1))
    index = (kept + torch.arange(heads, device=stored.device)[:, None] * per_head).reshape(-1)
    return torch.index_select(every_row, 0, index, out=out).view(heads, -1, width)
