"""CUDA graphs for decode steps: a forward of a few tokens replayed as one launch.

Why: a one-token forward of Llama-3.1-8B's shape on an H100 took 21-36 ms of wall time for
9.5 ms of GPU work; its ~1,500 kernel launches from Python are the step
(bench/2026-11-23-h100-host-overhead.json). A graph captured once per (cache buffers, tokens)
replays them in one call.

What is replayed: the model's forward with the cache layers writing at device-side slots and
attention reading a device-side past length (kv/device_length.py), into a fixed logits buffer.
The host keeps the lengths (it commits the tokens anyway) and sets the device numbers before each
replay. Captured by hand (`CUDAGraph.capture_begin`, no compiler), so it works wherever CUDA does.

Where it applies: caches whose layers are all `GrowingLayer`s with room for the new tokens (the
full KV on the GPU, a StreamingLLM draft's, the retrieval cache; an 8-bit KV where its fused
kernel runs, kv/int8_attention.py), forwards of up to `GRAPH_TOKENS` tokens after at least one
cached position that see all of it (recording the queries or not: a size that records has a
graph of its own), with every weight on one CUDA device but an input embedding kept on the host
(host_embedding.py: 8 GB cards), whose rows are looked up eagerly and copied into the graph's
input. Elsewhere (an offloaded KV, an 8-bit one without its kernel, prefill chunks, a model split
over GPUs) the eager forward runs. A graph is
captured at the second forward of its size over the same buffers (a cache used once is not worth
a capture) and lives as long as they do. A model's first capture is checked against its eager
forward; a mismatch or a failed capture turns graphs off for that model, with the reason in `off`.
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from .host_embedding import HostEmbedding
from .interrupt import Cancelled
from .kv.device_length import DeviceStep, device_step
from .kv import int8_attention
from .kv.full import GrowingLayer
from .kv.int8 import Int8Layer
from .kv.int8_rows import SCALE_BYTES
from .kv.queries import ATTENTION, recording

GRAPH_TOKENS = 64  # decode steps and verifications; a prefill chunk runs eagerly
# The largest difference from the eager forward's logits a first capture may show, over their
# spread: kernels differ (variable-length attention), so half precision differs by rounding; a
# wrong slot or length shows as a difference of the logits' own size.
# (The logits buffer is fp32, so fp64 models agree to fp32's rounding.)
AGREEMENT = {torch.float16: 0.03, torch.bfloat16: 0.03}
FULL_PRECISION_AGREEMENT = 1e-4


@dataclass
class _Replay:
    """One size's static inputs and, once captured, its graph, for one set of cache buffers."""
    buffers: tuple[int, ...]  # the data pointers of every layer's buffers it was made for
    step: DeviceStep
    ids: torch.Tensor  # [n] long; with the embedding on the host, their rows [n, hidden] instead
    positions: torch.Tensor  # [n] long
    graph: torch.cuda.CUDAGraph | None = None
    uses: int = 0  # forwards of this size over these buffers: the second captures


class StepGraphs:
    """A model's replayable steps. `capture` False runs the same static path eagerly: what the
    CPU rehearses (tests, `bench --suite gpu --dry-run`), never a speed path."""

    def __init__(self, hf_model, cache_argument: str, capture: bool):
        self.hf = hf_model
        self._cache_argument = cache_argument
        self.capture = capture
        embedding = hf_model.get_input_embeddings()
        self._host_embedding = embedding if isinstance(embedding, HostEmbedding) else None
        on_host = {id(parameter) for parameter in embedding.parameters()} if self._host_embedding else set()
        devices = {parameter.device for parameter in hf_model.parameters() if id(parameter) not in on_host}
        self.device = next(iter(devices))
        self.off: str | None = None if len(devices) == 1 else "weights on more than one device"
        self._checked = not capture  # the first capture is compared with the eager forward
        self._pool = None
        self._logits: torch.Tensor | None = None  # [GRAPH_TOKENS, vocab] fp32: every graph writes here
        self.replays = 0  # forwards that went through the static path (the campaign reports it)
        # Per cache (dropped with it): the replays by size. A graph writes this runner's logits buffer,
        # so its replays live here, never on a cache another runner could reach.
        self._by_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # A DSI instance may run the same model in another thread at once: one thread at a time
        # uses the static tensors and the logits buffer, the other runs that forward eagerly.
        self._busy = threading.Lock()

    def __deepcopy__(self, memo) -> StepGraphs:
        """A copy of the model gets runners of its own, with no graphs yet (they write the
        original's buffers) and its own lock."""
        return StepGraphs(copy.deepcopy(self.hf, memo), self._cache_argument, self.capture)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor | None,
                eager: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """Logits [n, vocab] fp32 on the device, with the cache
        advanced by n; or None where this forward must run eagerly (the cache untouched).
        `eager` runs the eager forward (the first capture's reference)."""
        n = ids.shape[0]
        layers = getattr(cache.transformers_cache, "layers", None)
        if (self.off or n > GRAPH_TOKENS or not layers or not _replayable(layers, self.device, self.hf.dtype)
                or self.hf.config._attn_implementation != ATTENTION):  # another attention ignores the device step
            return None
        if not self._busy.acquire(blocking=False):
            return None
        try:
            return self._forward(ids, positions, cache, layers, mask, eager)
        finally:
            self._busy.release()

    def _forward(self, ids, positions, cache, layers, mask, eager) -> torch.Tensor | None:
        n = ids.shape[0]
        start = layers[0].get_seq_length()
        capacity = layers[0].buffers[0].shape[2]
        allowed = _new_tokens_mask(mask, start, n)
        if start < 1 or start + n > capacity or allowed is False:
            return None
        recorded = recording()
        replay = self._replay_for(cache.transformers_cache, layers, n, capacity, recorded is not None)
        replay.ids.copy_(ids if self._host_embedding is None else self._host_embedding(ids))
        replay.positions.copy_(positions)
        replay.step.fill(start, allowed)
        replay.uses += 1
        if not self.capture:
            self._run(replay, cache.transformers_cache)
        elif replay.graph is None:
            if replay.uses < 2:
                return None
            if not self._capture(replay, cache, layers, start, eager):
                return None
        else:
            replay.graph.replay()
        for layer in layers:
            layer.written(start + n)
        self.replays += 1
        if recorded is not None:  # copied out: the next replay rewrites them
            recorded.update({layer: queries.clone() for layer, queries in replay.step.queries.items()})
        return self._logits[:n].clone()

    def _replay_for(self, transformers_cache, layers, n: int, capacity: int, record: bool) -> _Replay:
        buffers = tuple(tensor.data_ptr() for layer in layers for tensor in layer.buffers)
        replays = self._by_cache.setdefault(transformers_cache, {})
        replay = replays.get((n, record))
        if replay is None or replay.buffers != buffers:  # new, or the buffers grew: capture again
            inputs = (torch.zeros(n, dtype=torch.long, device=self.device) if self._host_embedding is None else
                      torch.zeros(n, self._host_embedding.weight.shape[1], dtype=self._host_embedding.weight.dtype,
                                  device=self.device))
            replay = _Replay(buffers, DeviceStep.empty(n, capacity, self.device), inputs,
                             torch.zeros(n, dtype=torch.long, device=self.device))
            if record:
                replay.step.queries = {}
            replays[n, record] = replay
        if self._logits is None:
            vocab = self.hf.get_output_embeddings().out_features
            self._logits = torch.empty(GRAPH_TOKENS, vocab, dtype=torch.float32, device=self.device)
        return replay

    def _run(self, replay: _Replay, transformers_cache) -> None:
        """The static forward: every input read from the replay's tensors, the logits written to
        the shared buffer."""
        n = replay.ids.shape[0]
        inputs = {"input_ids" if self._host_embedding is None else "inputs_embeds": replay.ids[None]}
        with device_step(replay.step):
            out = self.hf(**inputs, position_ids=replay.positions[None],
                          # 4-D, so transformers builds no mask; attention reads `replay.step` instead
                          attention_mask=replay.step.allowed[None, None], use_cache=True,
                          **{self._cache_argument: transformers_cache}, logits_to_keep=0)
            self._logits[:n].copy_(out.logits[0])

    def _capture(self, replay: _Replay, cache, layers, start: int, eager: Callable[[], torch.Tensor]) -> bool:
        """Capture `replay`'s graph and run it once; False (graphs now off) where that failed."""
        expected = None
        if not self._checked:  # its failure is the eager forward's, raised as such
            expected = eager().clone()
            for layer in layers:
                layer.written(start)
        try:
            device = self.device
            side = torch.cuda.Stream(device)  # captures need a stream of their own
            side.wait_stream(torch.cuda.current_stream(device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                self._run(replay, cache.transformers_cache)  # lazy allocations and kernel choices, uncaptured
                # capture_begin, not `torch.cuda.graph`, which collects garbage first (a pause in a
                # large process, at every size of every answer); thread_local: a DSI thread's eager
                # forwards may run meanwhile
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    self._run(replay, cache.transformers_cache)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(device).wait_stream(side)
            self._pool = graph.pool()
            graph.replay()
        except Cancelled:
            raise
        except Exception as error:  # noqa: BLE001 - any failure: this model decodes eagerly
            self.off = f"capture failed: {type(error).__name__}: {str(error)[:200]}"
            return False
        replay.graph = graph
        if expected is not None:
            self._checked = True
            got = self._logits[:replay.ids.shape[0]]
            difference = float((got - expected).abs().max() / (expected.amax() - expected.amin()).clamp(min=1e-6))
            if not difference <= AGREEMENT.get(self.hf.dtype, FULL_PRECISION_AGREEMENT):
                self.off = f"a replayed step differed from the eager forward by {difference:.3g} of the logits' spread"
                for layer in layers:
                    layer.written(start)
                return False
        return True


def _replayable(layers, device: torch.device, dtype: torch.dtype) -> bool:
    """Buffers of one capacity on the model's device, each layer a full KV's or an 8-bit one's
    where its attention reads the packed rows in the kernel that takes its length on the device."""
    def replayable(layer) -> bool:
        if type(layer) not in (GrowingLayer, Int8Layer) or layer.buffers is None or layer.buffers[0].device != device:
            return False
        return type(layer) is GrowingLayer or int8_attention.reads_packed(device, dtype,
                                                                         layer.buffers[0].shape[-1] - SCALE_BYTES)

    return all(replayable(layer) for layer in layers) and len({layer.buffers[0].shape[2] for layer in layers}) == 1


def _new_tokens_mask(mask: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None | bool:
    """The new tokens' [n, n] mask from a forward's 4-D one [1, 1, n, start + n] (None: causal),
    or False where some new token does not see the whole past (not replayable)."""
    if mask is None:
        return None
    allowed = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
    if allowed.shape != (n, start + n) or not bool(allowed[:, :start].all()):
        return False
    return allowed[:, start:]
