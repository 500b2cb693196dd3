"""The full KV cache in CPU memory, streamed to the GPU one layer at a time (TriForce's offloading,
algorithms.md section 5), for contexts whose KV does not fit next to the weights.

On a CUDA device the KV lives in pinned host memory, head-major ([kv_heads, capacity, head_dim]
per layer: each head's prefix is one contiguous block, so streaming is one DMA per head). Two GPU
buffers take turns: while layer i attends over one, layer i+1's KV is copied into the other on a
side stream (double buffering), and the last layer's turn prefetches the first for the next forward.
The new entries of each forward are written back to host memory asynchronously. A full
verification then costs about `KV bytes / host-to-device bandwidth`, hidden behind nothing else.
TriForce's reference copies without any overlap. The host memory is packed into blocks whose sizes
are powers of two, which PyTorch's pinned allocator does not round up (slabs.py).

With `int8` it holds 8-bit rows (kv/int8.py: codes, then the row's scale), which halves the
pinned memory and what a verification streams; a forward's new entries are quantized before its
attention, which sees every row dequantized, as `Int8Cache` does on a GPU.

With `resident_layers` that many layers keep their KV on the GPU (a partial offload: what fits
beside the weights), spread among the streamed ones (`streamed_layers`) so that each streamed
layer's copy overlaps the compute of the resident layers before it; only the others are pinned
and streamed.

On the CPU the same class keeps the KV in place (nothing to stream), which is what the tests run.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .cache import head_rows, rows_at
from .chunk_means import ChunkMeans
from .int8_rows import SCALE_BYTES, pack, unpack
from .slabs import slabs


class OffloadedCache:
    """A `KVCache` of fixed capacity whose slots are the positions 0 .. length-1, like `FullCache`."""

    def __init__(self, hf_config, capacity: int, device: torch.device | str, dtype: torch.dtype,
                 overlap: bool = True, int8: bool = False, resident_layers: int = 0):
        self.config = hf_config
        self.device = torch.device(device)
        self.dtype = dtype  # what attention sees
        self.int8 = int8
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        shape = (hf_config.num_key_value_heads, capacity, head_dim + (SCALE_BYTES if int8 else 0))
        stored_dtype = torch.int8 if int8 else dtype
        on_gpu = self.device.type == "cuda"
        self.streamed = streamed_layers(hf_config.num_hidden_layers, resident_layers)
        host = iter(_host_tensors(shape, stored_dtype, 2 * len(self.streamed), pinned=on_gpu))

        def storage(layer: int) -> torch.Tensor:
            if layer in self.streamed:
                return next(host)
            return torch.empty(shape, dtype=stored_dtype, device=self.device)

        # Per layer (keys, values) [kv_heads, capacity, width]: in (pinned) host memory, or on the
        # device for a resident layer.
        self._rows = [(storage(layer), storage(layer)) for layer in range(hf_config.num_hidden_layers)]
        self.capacity = capacity
        self._length = 0
        self.fetched_bytes = 0  # host-to-device traffic, so tests and benchmarks can account for it
        # overlap=False copies each layer when it is needed (TriForce's reference): a baseline.
        self._streamer = _Streamer(self, shape, stored_dtype, overlap) if on_gpu and self.streamed else None
        self._chunk_means: ChunkMeans | None = None  # the retrieval stage's, once it asks (`chunk_means`)
        self._staging: _Staging | None = None  # a retrieval rebuild's rows on their way to the GPU
        self.transformers_cache = _StreamedKV(self)

    @property
    def length(self) -> int:
        return self._length

    @property
    def overlap(self) -> bool:
        return self._streamer is not None and self._streamer.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        """Prefetch the next layer during compute (the default), or copy each layer when needed."""
        if self._streamer is not None:
            self._settle()
            self._streamer.overlap = on
            self._streamer.staged = None

    @property
    def num_layers(self) -> int:
        return len(self._rows)

    def layer_shape(self, length: int) -> tuple[int, ...]:
        """The shape of one layer's keys (and values) for `length` positions, as stored (`stored_layers`)."""
        kv_heads, _, width = self._rows[0][0].shape
        return (1, kv_heads, length, width)

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held, resident layers included (a full verification streams
        the others'). Reserved but not counted: memory for `capacity` positions and, on a GPU, the
        two staging buffers (one layer each)."""
        return sum(2 * keys[:, :self._length].numel() * keys.element_size() for keys, _ in self._rows)

    def stored_layers(self, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) [1, kv_heads, length, head_dim] as stored (packed rows of
        head_dim + 4 bytes when 8-bit), as views of host memory (of the device's, for a resident
        layer): what a saved document holds."""
        self._settle()
        length = self._length if length is None else length
        return [(k[:, :length][None], v[:, :length][None]) for k, v in self._rows]

    def layers(self, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) [1, kv_heads, length, head_dim] as attention sees them: views of
        where they are stored, or new dequantized tensors when 8-bit."""
        return [(self._seen(keys), self._seen(values)) for keys, values in self.stored_layers(length)]

    def layers_at(self, positions: torch.Tensor, count: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer of the first `count` (all by default), the (keys, values) [1, kv_heads,
        len(positions), head_dim] at `positions` as attention sees them, new tensors: only those
        rows are read (dequantized, for an 8-bit cache), whatever the cache's length."""
        return rows_at(self.stored_layers()[:count], self._seen, positions)

    def _seen(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows as attention sees them, in the model's dtype."""
        return unpack(rows, self.dtype) if self.int8 else rows

    @torch.inference_mode()
    def fill(self, layers: Iterable[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Replace the contents with per-layer (keys, values) [1, kv_heads, length, head_dim] as
        stored (`stored_layers`), taken one layer at a time (a generator keeps only one layer in
        memory)."""
        self._check_room(length)
        self._settle()
        for (stored_k, stored_v), (keys, values) in zip(self._rows, layers, strict=True):
            stored_k[:, :length].copy_(keys[0])
            stored_v[:, :length].copy_(values[0])
        self._length = length
        self._changed(0)

    def trim(self, length: int) -> None:
        if length > self._length:
            raise ValueError(f"cannot trim a cache of {self._length} positions to {length}")
        self._length = length  # a prefetched prefix stays valid: the first `length` are unchanged
        if self._chunk_means is not None:
            self._chunk_means.changed(length)

    @torch.inference_mode()
    def keep(self, positions: torch.Tensor) -> None:
        """Keep only `positions` (ascending) in consecutive slots (a tree's accepted path)."""
        self._settle()
        positions = positions.to(torch.long)
        unchanged = int((positions == torch.arange(positions.shape[0])).cumprod(0).sum())
        moved = positions[unchanged:]
        if moved.numel():
            for keys, values in self._rows:
                at = moved.to(keys.device)
                keys[:, unchanged:unchanged + moved.shape[0]] = keys[:, at]
                values[:, unchanged:unchanged + moved.shape[0]] = values[:, at]
            self._changed(unchanged)
        self._length = positions.shape[0]

    def abandon_forward(self) -> None:
        """A forward stopped between layers (core/interrupt.py): its positions were never counted
        (the last layer sets the length), what its first layers wrote lies past the length, and
        what was prefetched for its next layer is dropped."""
        self._settle()
        self._changed(self._length)

    def _check_room(self, length: int) -> None:
        if length > self.capacity:
            raise ValueError(f"the offloaded KV cache holds {self.capacity} positions; {length} do not fit")

    def _settle(self) -> None:
        """Wait for the asynchronous write-backs, before host memory is read or changed."""
        if self._streamer is not None:
            self._streamer.settle()

    def _changed(self, position: int) -> None:
        """Host memory was rewritten from `position` on."""
        if self._streamer is not None:
            self._streamer.invalidate()
        if self._chunk_means is not None:
            self._chunk_means.changed(position)

    def chunk_means(self, chunk_size: int, device: torch.device | str) -> list[torch.Tensor]:
        """Per layer, the mean key of each complete chunk of `chunk_size` positions [kv_heads,
        chunks, head_dim] on `device`, in the cache's dtype: kept there and brought up to date
        from what changed since the last call (`ChunkMeans`)."""
        self._settle()
        means = self._chunk_means
        if means is None or means.chunk_size != chunk_size or means.device != torch.device(device):
            kv_heads, _, stored_width = self._rows[0][0].shape
            head_dim = stored_width - (SCALE_BYTES if self.int8 else 0)
            means = self._chunk_means = ChunkMeans(self.num_layers, kv_heads, self.capacity, head_dim, chunk_size,
                                                   self.dtype, device)
        exact = functools.partial(unpack, dtype=torch.float32) if self.int8 else torch.Tensor.float
        return means.update([keys for keys, _ in self._rows], self._length, exact)

    @torch.inference_mode()
    def gather(self, positions: torch.Tensor, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [1, kv_heads, kept, head_dim] on `device` of the positions
        [layers, kv_heads, kept] (CPU, ascending per head): only they cross to the device, from
        host memory through page-locked staging (`_Staging`), so the host does not wait for each
        layer's copy."""
        self._settle()
        device = torch.device(device)
        layers = []
        for (stored_k, stored_v), kept in zip(self._rows, positions, strict=True):
            if stored_k.device.type == "cpu" and device.type == "cuda":
                if self._staging is None:
                    self._staging = _Staging()
                keys, values = self._staging.send(stored_k, stored_v, kept, device)
            else:  # a resident layer, or the CPU's cache
                keys, values = (head_rows(stored, kept).to(device) for stored in (stored_k, stored_v))
            layers.append((self._seen(keys)[None], self._seen(values)[None]))
        return layers

    def _attend(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a forward's new entries [1, kv_heads, n, head_dim] of `layer`; return all of the
        layer's keys and values for attention (dequantized when 8-bit, the new ones included)."""
        start, end = self._length, self._length + keys.shape[2]
        self._check_room(end)
        if self.int8:
            keys, values = pack(keys), pack(values)
        if self._streamer is not None and layer in self.streamed:
            result = self._streamer.attend(layer, start, end, keys, values)
        else:  # a resident layer, or the CPU's cache in place
            stored_k, stored_v = self._rows[layer]
            stored_k[:, start:end] = keys[0]
            stored_v[:, start:end] = values[0]
            result = stored_k[:, :end][None], stored_v[:, :end][None]
        if self._chunk_means is not None:
            self._chunk_means.changed(start)
        if layer == self.num_layers - 1:
            self._length = end
        return self._seen(result[0]), self._seen(result[1])


class _Staging:
    """Two page-locked slots for a retrieval rebuild's rows on their way from host memory to a GPU,
    used in turn: a slot is refilled once the copies from it (two layers back, long done) have
    finished, so a rebuild pins two layers' chosen rows whatever the model's depth (a staging
    block per layer would keep the whole retrieval cache's size page-locked)."""

    def __init__(self):
        self._slots: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
        self._turn = 0

    def send(self, stored_k: torch.Tensor, stored_v: torch.Tensor, kept: torch.Tensor,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows `kept` [kv_heads, k] of host `stored_k`, `stored_v` [kv_heads, capacity, width],
        as new [kv_heads, k, width] tensors on `device`, copied asynchronously."""
        rows, width = kept.numel(), stored_k.shape[-1]
        if not self._slots or self._slots[0][0].shape[0] < rows or self._slots[0][0].shape[1] != width \
                or self._slots[0][0].dtype != stored_k.dtype:
            for _, _, done in self._slots:
                done.synchronize()
            self._slots = [(torch.empty(rows, width, dtype=stored_k.dtype, pin_memory=True),
                            torch.empty(rows, width, dtype=stored_k.dtype, pin_memory=True), torch.cuda.Event())
                           for _ in range(2)]
        key_slot, value_slot, done = self._slots[self._turn]
        self._turn ^= 1
        done.synchronize()  # an event never recorded returns at once
        keys = head_rows(stored_k, kept, key_slot[:rows]).to(device, non_blocking=True)
        values = head_rows(stored_v, kept, value_slot[:rows]).to(device, non_blocking=True)
        done.record(torch.cuda.current_stream(device))
        return keys, values


def streamed_layers(layers: int, resident: int) -> tuple[int, ...]:
    """The layers whose KV is streamed when `resident` of `layers` keep theirs on the GPU: spread
    evenly, the last among them, so that every streamed layer follows resident ones whose compute
    hides its copy."""
    if not 0 <= resident <= layers:
        raise ValueError(f"{resident} resident layers of {layers}")
    streamed = layers - resident
    return tuple(layer for layer in range(layers) if (layer + 1) * streamed // layers > layer * streamed // layers)


def _host_tensors(shape: tuple[int, ...], dtype: torch.dtype, count: int, pinned: bool) -> list[torch.Tensor]:
    """`count` tensors of `shape` in host memory (page-locked when `pinned`), packed into blocks
    whose sizes are powers of two, which the pinned allocator does not round up (slabs.py)."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    tensors = []
    for block_bytes, held in slabs(size, count):
        block = torch.empty(block_bytes, dtype=torch.uint8, pin_memory=pinned)
        tensors += [block[index * size:(index + 1) * size].view(dtype).view(shape) for index in range(held)]
    return tensors


def following_fetch(streamed: tuple[int, ...], layer: int, start: int, end: int) -> tuple[int, int]:
    """(the layer to prefetch, positions to copy) once streamed `layer` has stored a forward's
    positions `start`..`end`: the next streamed layer, which sees `start` positions in this forward;
    past the last, the first, in the next forward, which sees `end`."""
    following = streamed[(streamed.index(layer) + 1) % len(streamed)]
    return following, start if following > layer else end


def _write_back(host: torch.Tensor, new: torch.Tensor) -> None:
    """Copy new entries [kv_heads, n, head_dim] into host memory, head by head (each a contiguous
    block: asynchronous from a GPU, with no staging copy)."""
    for head in range(host.shape[0]):
        host[head].copy_(new[head], non_blocking=True)


class _Streamer:
    """The CUDA side of the streamed layers: two staging buffers, a copy stream, events."""

    def __init__(self, cache: OffloadedCache, shape: tuple[int, ...], dtype: torch.dtype, overlap: bool):
        self.cache = cache
        self.overlap = overlap
        device = cache.device
        self.buffers = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                        for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in range(2)]
        self.turn = 0  # which buffer the next layer to run reads
        self.staged: tuple[int, int] | None = None  # (layer, positions) in buffers[turn], if prefetched
        self.written = torch.cuda.Event()

    def attend(self, layer: int, start: int, end: int, keys: torch.Tensor, values: torch.Tensor):
        compute = torch.cuda.current_stream(self.cache.device)
        if self.staged is None or self.staged[0] != layer or self.staged[1] < start:
            self._fetch(layer, start, self.turn)  # nothing usable was prefetched (first forward)
            if not self.overlap:
                compute.wait_stream(self.copy_stream)
        compute.wait_event(self.ready[self.turn])
        buffer_k, buffer_v = self.buffers[self.turn]
        buffer_k[:, start:end] = keys[0]
        buffer_v[:, start:end] = values[0]
        host_k, host_v = self.cache._rows[layer]
        _write_back(host_k[:, start:end], buffer_k[:, start:end])
        _write_back(host_v[:, start:end], buffer_v[:, start:end])
        self.written.record(compute)
        self.turn ^= 1
        if self.overlap:
            # The other buffer was last read by the previous layer, queued before this point.
            self.copy_stream.wait_stream(compute)
            self._fetch(*following_fetch(self.cache.streamed, layer, start, end), self.turn)
        else:
            self.staged = None
        return buffer_k[:, :end][None], buffer_v[:, :end][None]

    def _fetch(self, layer: int, length: int, turn: int) -> None:
        host_k, host_v = self.cache._rows[layer]
        buffer_k, buffer_v = self.buffers[turn]
        with torch.cuda.stream(self.copy_stream):
            for head in range(host_k.shape[0]):  # one contiguous block per head
                buffer_k[head, :length].copy_(host_k[head, :length], non_blocking=True)
                buffer_v[head, :length].copy_(host_v[head, :length], non_blocking=True)
            self.ready[turn].record(self.copy_stream)
        self.cache.fetched_bytes += 2 * host_k[:, :length].numel() * host_k.element_size()
        self.staged = (layer, length)

    def settle(self) -> None:
        self.written.synchronize()
        self.copy_stream.synchronize()  # a prefetch may still be reading host memory

    def invalidate(self) -> None:
        self.staged = None


class _StreamedLayer(CacheLayerMixin):
    """What transformers' mask builder asks of a layer: how many positions are attended."""

    is_sliding = False
    is_croppable = True

    def __init__(self, cache: OffloadedCache):
        super().__init__()
        self.cache = cache
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("the offloaded cache is updated through its Cache")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.length

    def get_max_length(self) -> int:
        return self.cache.capacity


class _StreamedKV(Cache):
    """The transformers face of an `OffloadedCache`: each layer's `update` goes to `_attend`."""

    def __init__(self, cache: OffloadedCache):
        super().__init__(layers=[_StreamedLayer(cache) for _ in range(cache.num_layers)])
        self.cache = cache

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.cache._attend(layer_idx, key_states, value_states)
