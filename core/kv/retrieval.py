"""The retrieval cache (TriForce's middle stage): a fixed budget of the target's own KV, chosen in
chunks by how much the current query attends to them, so the target can draft for itself while
reading a few thousand positions instead of the whole context.

Scoring (`select_positions`) follows grouped-query attention: a KV head serves a group of query
heads, so each KV head keeps the chunks its whole group attends to (TriForce's reference scores
as if every query head had its own KV head, which is wrong for Llama 3 and Qwen).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from .cache import KVCache, head_rows
from .full import GrowingLayer, held_bytes, hf_cache, keep_slots
from .offload import OffloadedCache


def select_positions(queries: torch.Tensor, keys: torch.Tensor, budget: int, chunk_size: int,
                     recent: int) -> torch.Tensor:
    """Positions each KV head keeps: [kv_heads, kept] ascending, kept <= budget, the same count
    for every head.

    queries [heads, head_dim] (the latest token's, after RoPE); keys [kv_heads, length, head_dim].
    Always kept: the first chunk (attention sinks) and the last `recent` positions (plus the
    partial chunk before them). The rest of the budget goes to the chunks holding the most
    attention: each chunk's share of the softmax weights of the group's queries, averaged over
    the group. TriForce scores a chunk by the attention to its mean key, a cheaper proxy; on the
    embedded model at 7.7K tokens and a 1K budget the exact share agreed with the full cache on
    100% of next tokens where the mean key agreed on 92-97% (bench notes in README).
    """
    kv_heads, length, head_dim = keys.shape
    chunks, picked = _layout(length, budget, chunk_size, recent)
    if picked is None:
        return torch.arange(length).expand(kv_heads, length)
    top = torch.empty(kv_heads, 0, dtype=torch.long)
    if picked > 0:
        grouped = queries.reshape(kv_heads, -1, head_dim).to(keys.dtype)  # [kv_heads, group, head_dim]
        weights = torch.softmax((grouped @ keys.transpose(1, 2)).float() / math.sqrt(head_dim), dim=-1)
        recent_start = chunk_size * (1 + chunks)
        shares = weights.mean(1)[:, chunk_size:recent_start].reshape(kv_heads, chunks, chunk_size).sum(-1)
        top = shares.cpu().topk(picked, dim=-1).indices
    return _positions(top, length, chunk_size, chunks)


def select_by_chunk_means(queries: torch.Tensor, means: torch.Tensor, length: int, budget: int, chunk_size: int,
                          recent: int) -> torch.Tensor:
    """`select_positions`' choice with TriForce's proxy score, on the device of `means` (the mean
    key of each complete chunk, [kv_heads, chunks, head_dim]): each chunk scored by the group's
    attention to its mean key, so no key but the chunk means is read. Positions [kv_heads, kept]
    on that device. Over an offloaded KV the exact share would stream every key per rebuild."""
    kv_heads, _, head_dim = means.shape
    chunks, picked = _layout(length, budget, chunk_size, recent)
    if picked is None:
        return torch.arange(length, device=means.device).expand(kv_heads, length)
    top = torch.empty(kv_heads, 0, dtype=torch.long, device=means.device)
    if picked > 0:
        grouped = queries.reshape(kv_heads, -1, head_dim).to(means.device, means.dtype)
        scores = (grouped @ means[:, 1:1 + chunks].transpose(1, 2)).float() / math.sqrt(head_dim)
        top = torch.softmax(scores, dim=-1).mean(1).topk(picked, dim=-1).indices
    return _positions(top, length, chunk_size, chunks)


def _layout(length: int, budget: int, chunk_size: int, recent: int) -> tuple[int, int | None]:
    """(the chunks scorable between the sink chunk and the recent part, how many of them fit the
    budget); None for the latter when the whole context fits."""
    if length <= budget:
        return 0, None
    if budget < 2 * chunk_size + recent:  # the recent part may run up to a chunk longer
        raise ValueError(f"a retrieval budget of {budget} cannot hold the sink chunk ({chunk_size}), "
                         f"the recent window ({recent}) and a partial chunk")
    chunks = max(0, (length - recent - chunk_size) // chunk_size)
    recent_start = chunk_size * (1 + chunks)
    return chunks, max(0, min(chunks, (budget - chunk_size - (length - recent_start)) // chunk_size))


def _positions(top: torch.Tensor, length: int, chunk_size: int, chunks: int) -> torch.Tensor:
    """The sink chunk, the chunks `top` [kv_heads, picked] (0 = the first after the sink), and
    everything from the recent part on: [kv_heads, kept] ascending, on `top`'s device."""
    kv_heads, device = top.shape[0], top.device
    recent_start = chunk_size * (1 + chunks)
    offsets = torch.arange(chunk_size, device=device)
    middle = (chunk_size * (1 + top.sort(dim=-1).values[..., None]) + offsets).flatten(1)
    sink = offsets.expand(kv_heads, chunk_size)
    tail = torch.arange(recent_start, length, device=device).expand(kv_heads, length - recent_start)
    return torch.cat([sink, middle, tail], dim=1)


class RetrievalCache:
    """A `KVCache`: retrieved slots for the first `base_length` positions (different per KV head),
    then every position after them in order (the tokens drafted and committed since the build).

    It only rolls back to `base_length` or later: it is rebuilt from the full cache whenever the
    committed text moves on, so rollback never reaches into the retrieved part."""

    def __init__(self, hf_config, layers: list[tuple[torch.Tensor, torch.Tensor]], base_length: int):
        self.config = hf_config
        self.transformers_cache = hf_cache(hf_config, layers)
        self.base_length = base_length
        self.base_slots = layers[0][0].shape[2]

    @classmethod
    def held(cls, hf_config, layers: list[tuple[torch.Tensor, torch.Tensor]], base_length: int,
             reuse: RetrievalCache | None) -> RetrievalCache:
        """A cache holding `layers` as built at `base_length`: `reuse`, refilled in its own
        buffers where they fit, so that the step graphs captured over them keep replaying (a
        retrieval cache is rebuilt every few verifications) and no second cache is allocated
        beside it; else a new one."""
        if reuse is not None and len(reuse.transformers_cache.layers) == len(layers) and all(
                isinstance(layer, GrowingLayer) and layer.refill(keys, values)
                for layer, (keys, values) in zip(reuse.transformers_cache.layers, layers)):
            reuse.base_length, reuse.base_slots = base_length, layers[0][0].shape[2]
            return reuse
        return cls(hf_config, layers, base_length)

    @classmethod
    @torch.inference_mode()
    def build(cls, hf_config, full_layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
              queries: dict[int, torch.Tensor], budget: int, chunk_size: int, recent: int,
              device: torch.device | None = None, reuse: RetrievalCache | None = None) -> RetrievalCache:
        """From the full cache's per-layer (keys, values) [1, kv_heads, length, head_dim], taken one
        layer at a time, and each layer's latest queries [heads, head_dim], on `device` (where the
        draft runs), in `reuse`'s buffers where they fit (`held`)."""
        layers, length = [], 0
        for index, (keys, values) in enumerate(full_layers):
            length = keys.shape[2]
            if device is not None:
                keys, values = keys.to(device), values.to(device)
            kept = select_positions(queries[index].to(keys.device), keys[0], budget, chunk_size, recent)
            layers.append((head_rows(keys[0], kept)[None], head_rows(values[0], kept)[None]))
        return cls.held(hf_config, layers, length, reuse)

    @classmethod
    def from_full(cls, full: KVCache, queries: dict[int, torch.Tensor], budget: int, chunk_size: int, recent: int,
                  device: torch.device, reuse: RetrievalCache | None = None) -> RetrievalCache:
        """`build` over a `FullCache` (every key scored; an 8-bit one's dequantized a layer at a
        time, never the whole KV at once); over an `OffloadedCache`, `from_offloaded`."""
        if isinstance(full, OffloadedCache):
            return cls.from_offloaded(full, queries, budget, chunk_size, recent, device, reuse)
        return cls.build(full.config, full.each_layer(), queries, budget, chunk_size, recent, device, reuse)

    @classmethod
    @torch.inference_mode()
    def from_offloaded(cls, full: OffloadedCache, queries: dict[int, torch.Tensor], budget: int, chunk_size: int,
                       recent: int, device: torch.device, reuse: RetrievalCache | None = None) -> RetrievalCache:
        """Chunks chosen on `device` by their mean keys (`select_by_chunk_means`, kept there by the
        cache), the positions of every layer brought to the host at once (one wait), and only
        those gathered from host memory and sent to `device`."""
        means = full.chunk_means(chunk_size, device)
        kept = torch.stack([select_by_chunk_means(queries[index], layer_means, full.length, budget, chunk_size,
                                                  recent) for index, layer_means in enumerate(means)])
        return cls.held(full.config, full.gather(kept.cpu(), device), full.length, reuse)

    @property
    def length(self) -> int:
        return self.base_length + self.transformers_cache.get_seq_length() - self.base_slots

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held (the retrieved slots and those after them), on every
        device; the spare capacity of the layers' buffers is reserved but not counted."""
        return held_bytes(self.transformers_cache)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) [1, kv_heads, slots, head_dim]: the `base_slots` retrieved
        (their positions differ per KV head), then one slot per position from `base_length` on."""
        return [(layer.keys, layer.values) for layer in self.transformers_cache.layers]

    def keep(self, positions: torch.Tensor) -> None:
        """Keep only `positions` (ascending, every one before `base_length` included) in
        consecutive slots: after a tree, the accepted path's entries follow the committed text."""
        positions = positions.to(torch.long)
        if positions.shape[0] < self.base_length or not torch.equal(
                positions[:self.base_length], torch.arange(self.base_length)):
            raise ValueError("a retrieval cache keeps everything before its build")
        slots = torch.cat([torch.arange(self.base_slots),
                           self.base_slots + positions[self.base_length:] - self.base_length])
        keep_slots(self.transformers_cache, slots)

    def trim(self, length: int) -> None:
        if length < self.base_length:
            raise ValueError(f"a retrieval cache built at {self.base_length} cannot roll back to {length}")
        excess = self.length - length
        if excess:
            self.transformers_cache.crop(-excess)
