"""Where every byte of one candidate goes, from the registry's shapes (layers, KV heads, head dim,
vocabulary, hidden size, parameters), never a per-card figure; and whether it fits.

GPU memory left unplanned (the margin): 10% of each card, or what other processes already hold
when that is more. CPU memory left unplanned: 20% of the RAM, as pinned pages cannot be swapped out
and the OS and this app need room. Several GPUs: the target's layers are split across them in
order (each layer's KV lives with the layer), the output head and the draft go on the last.
"""

from __future__ import annotations

import math

from ..files import human_size
from ..hardware import HardwareProfile, curve_key, kv_label
from ..kv.slabs import pinned_bytes
from ..registry import DTYPE_BYTES, ModelPair, ModelSpec
from .types import DeviceMemory, MemoryItem


QUANTIZATIONS = ("none", "int8", "nf4")
# (the decoder layers' quantization, the output head's too), in the order tried: most precise first.
# bitsandbytes leaves the head in the compute dtype by default; quantizing it as well is the last
# resort (an 8 GB card at 128K), and the output is then lossless against that quantized target.
WEIGHT_TIERS = (("none", False), ("int8", False), ("nf4", False), ("nf4", True))
VRAM_MARGIN_SHARE = 0.10
RAM_MARGIN_SHARE = 0.20
CUDA_CONTEXT_BYTES = 2**30  # CUDA context, cuBLAS workspaces and allocator slack, per GPU used
# Hidden-sized tensors alive at once for each token of a forward: residual, norm, q/k/v/o and the
# MLP's gate, up and product (3-5x the hidden width each in these models).
ACTIVATION_WIDTHS = 16
MAX_VERIFY_TOKENS = 128  # the largest verification whose fp32 logits are budgeted
NF4_BITS = 4 + 32 / 64  # bitsandbytes nf4: 4-bit codes plus one fp32 absmax per 64-weight block
KV8_SCALE_BYTES = 4  # an 8-bit KV's fp32 scale per token and KV head, beside its head_dim codes (kv/int8.py)
RETRIEVAL_CHUNK_ON_CHIP = 8  # finer chunks retrieve more precisely
RETRIEVAL_CHUNK_OFFLOADED = 16  # the chunk keys are then the GPU's only copy of K: half of 8's
DRAFT_SINKS = 4  # StreamingLLM's attention sinks
DRAFT_WINDOW = 1020  # recent tokens the draft attends: 1024 slots with the sinks
PREFILL_CHUNK_CPU = 1024  # as the engine's prefill
PREFILL_CHUNK_GPU = 2048
PREFILL_CHUNKS_OFFLOADED = (8192, 4096, 2048, 1024)  # largest first: each chunk re-streams the KV so far


def weight_parts(spec: ModelSpec, quantization: str, dtype_bytes: int,
                 head_quantized: bool = False) -> tuple[int, int, int]:
    """(embedding, output head, decoder layers) bytes. bitsandbytes quantizes linear layers only,
    and by default not the output head: the embedding (and the head) stay in the compute dtype.
    The registry does not say whether a model ties them, so both are counted: exact for untied
    models, an upper bound for tied ones."""
    matrix = spec.vocab_size * spec.hidden_size
    bits = {"none": 8 * dtype_bytes, "int8": 8 + 32 / spec.hidden_size, "nf4": NF4_BITS}[quantization]
    head = int(matrix * bits / 8) if head_quantized else matrix * dtype_bytes
    return matrix * dtype_bytes, head, int(body_params(spec) * bits / 8)


def body_params(spec: ModelSpec) -> float:
    """The decoder layers' parameters: all but the embedding and the output head."""
    return max(0.0, spec.params_b * 1e9 - 2 * spec.vocab_size * spec.hidden_size)


def activation_bytes(spec: ModelSpec, chunk: int, dtype_bytes: int) -> int:
    """A prefill chunk's temporaries in a layer, the MLP's or attention's, whichever are more, plus
    the fp32 logits of the largest verification."""
    mlp = chunk * spec.hidden_size * dtype_bytes * ACTIVATION_WIDTHS
    return max(mlp, attention_bytes(spec, chunk, dtype_bytes)) + MAX_VERIFY_TOKENS * spec.vocab_size * 4


def attention_bytes(spec: ModelSpec, chunk: int, dtype_bytes: int) -> int:
    """A prefill chunk's tensors alive in attention (kv/past_attention.py): the layer's input and
    its norm, the queries, the new keys and values and those repeated per query head for the
    causal kernel, both kernels' outputs, their merge in fp32 (three tensors) and its result. No
    [chunk x context] mask: kv/queries.py builds none."""
    query_width, kv_width = spec.attention_heads * spec.head_dim, spec.kv_heads * spec.head_dim
    layer = (2 * spec.hidden_size + query_width + 2 * kv_width) * dtype_bytes
    return chunk * (layer + query_width * (5 * dtype_bytes + 3 * 4))


def kv8_bytes_per_token(spec: ModelSpec) -> int:
    """An 8-bit KV's bytes per token: int8 codes and one scale per KV head, keys and values."""
    return 2 * spec.layers * spec.kv_heads * (spec.head_dim + KV8_SCALE_BYTES)


def chunk_key_bytes(spec: ModelSpec, context: int, chunk: int, dtype_bytes: int) -> int:
    """The retrieval scores' input: one mean key per chunk, layer and KV head."""
    return math.ceil(context / chunk) * spec.layers * spec.kv_heads * spec.head_dim * dtype_bytes


def uses_draft(pair: ModelPair, mode: str) -> bool:
    return pair.draft is not None and mode != "plain"


def prefill_chunks(profile: HardwareProfile, kv_on_chip: bool) -> tuple[int, ...]:
    if not profile.gpus:
        return (PREFILL_CHUNK_CPU,)
    return (PREFILL_CHUNK_GPU,) if kv_on_chip else PREFILL_CHUNKS_OFFLOADED


def compute_dtype(profile: HardwareProfile, spec: ModelSpec) -> str:
    """bf16 on GPUs that have it (fp16 on older ones); on a CPU the published dtype."""
    if profile.gpus:
        return "bfloat16" if all(gpu.bf16 for gpu in profile.gpus) else "float16"
    return spec.dtype


class Layout:
    """Where every byte of one candidate (quantization, KV place and storage, draft place, prefill
    chunk) goes, and whether it fits. Built once per candidate, read by assemble.finish.

    `kv_int8`: the full KV in 8 bits, on the GPUs or offloaded (streamed as stored, so half the
    bytes cross the link), dequantized a layer at a time for attention. The retrieval cache and
    chunk keys stay in the compute dtype.

    `kv_partial` (with the KV offloaded, on one GPU): the layers whose KV fits in what the GPU has
    left keep it there (`kv_resident_layers`, at least one and not all: else the layout is another
    candidate's), and only the others' is pinned and streamed (kv/offload.py)."""

    def __init__(self, profile, pair, context, mode, budget, overrides, quantization, kv_on_chip, with_draft,
                 prefill_chunk, head_quantized=False, embedding_on_cpu=False, kv_int8=False, kv_partial=False):
        self.profile, self.pair, self.context, self.mode, self.overrides = profile, pair, context, mode, overrides
        self.quantization, self.kv_on_chip = quantization, kv_on_chip
        self.head_quantized, self.embedding_on_cpu = head_quantized, embedding_on_cpu
        self.prefill_chunk = prefill_chunk
        target = pair.target
        self.dtype = compute_dtype(profile, target)
        self.dtype_bytes = DTYPE_BYTES[self.dtype]
        self.kv_per_token = target.kv_bytes_per_token(self.dtype_bytes)  # the compute dtype's
        self.kv_int8 = kv_int8
        self.kv_dtype = "int8" if self.kv_int8 else self.dtype
        self.full_kv_per_token = kv8_bytes_per_token(target) if self.kv_int8 else self.kv_per_token
        self.full_kv = context * self.full_kv_per_token
        self.kv_partial = kv_partial and not kv_on_chip
        self.kv_resident_layers = 0  # of an offloaded KV: set by `_place_gpus` for a partial offload
        self.retrieval = (budget, RETRIEVAL_CHUNK_ON_CHIP if kv_on_chip else RETRIEVAL_CHUNK_OFFLOADED) \
            if mode == "triforce" else None
        # With a GPU the draft goes on the (last) GPU or is left out: on the CPU it would draft
        # slower than the GPU verifies. Without a GPU everything is on the CPU anyway.
        self.draft = pair.draft if uses_draft(pair, mode) and with_draft else None
        self.draft_left_out = uses_draft(pair, mode) and not with_draft
        self.draft_window = overrides.draft_window or DRAFT_WINDOW
        self.items: list[MemoryItem] = []
        self.target_devices: tuple[str, ...] = ()
        self.target_layers: tuple[int, ...] = ()
        self.gpu_bytes_needed = 0
        if profile.gpus:
            self._place_gpus()
        self._place_cpu()
        self.devices = budgets(profile, self.items)
        # An offloaded KV is page-locked: past what the OS lets CUDA pin (half the RAM on Windows)
        # the allocation fails however much RAM is free.
        self.pinned_bytes = self.pinned_kv if profile.gpus and not self.kv_on_chip else 0
        # The streamer stages layers on the device a forward starts on (kv/offload.py): an
        # offloaded KV goes with a target on one GPU.
        self.split_offload = bool(profile.gpus) and not kv_on_chip and len(self.target_devices) > 1
        self.fits = (all(device.headroom_bytes >= 0 for device in self.devices)
                     and self.pinned_bytes <= profile.pinnable_bytes and not self.split_offload
                     and (not self.kv_partial or self.kv_resident_layers > 0))

    # -- what each part weighs

    def weights(self) -> tuple[int, int, int]:
        """The target's (embedding, output head, decoder layers) bytes."""
        return weight_parts(self.pair.target, self.quantization, self.dtype_bytes, self.head_quantized)

    @property
    def resident_kv(self) -> int:
        """Bytes of the full KV on the GPUs: all of it on chip, the resident layers' of a partial
        offload, none offloaded (or on a machine without a GPU)."""
        if self.kv_on_chip:
            return self.full_kv
        return self.full_kv // self.pair.target.layers * self.kv_resident_layers

    @property
    def streamed_kv(self) -> int:
        """Bytes of the full KV a verification streams over the link (on a GPU machine)."""
        return self.full_kv - self.resident_kv

    @property
    def pinned_kv(self) -> int:
        """What the streamed layers' KV pins: each one's keys and values packed into blocks whose
        sizes are powers of two (kv/slabs.py), at the context's capacity."""
        layers = self.pair.target.layers
        return pinned_bytes(self.full_kv // layers // 2, 2 * (layers - self.kv_resident_layers))

    def _layer_bytes(self) -> int:
        """One target layer's share on a GPU: weights, its full KV when on-chip, its retrieval
        cache and chunk keys."""
        body = self.weights()[2]
        share = body + (self.full_kv if self.kv_on_chip else 0) + self._retrieval_bytes()
        return math.ceil(share / self.pair.target.layers)

    def _retrieval_bytes(self) -> int:
        if self.retrieval is None:
            return 0
        budget, chunk = self.retrieval
        return (min(budget, self.context) * self.kv_per_token
                + chunk_key_bytes(self.pair.target, self.context, chunk, self.dtype_bytes))

    def _dequantized_bytes(self) -> int:
        """An 8-bit layer is attended through a copy of its keys and values in the compute dtype."""
        return math.ceil(self.context * self.kv_per_token / self.pair.target.layers) if self.kv_int8 else 0

    def draft_device(self) -> str | None:
        if self.draft is None:
            return None
        return f"cuda:{self.profile.gpus[-1].index}" if self.profile.gpus else "cpu"

    def draft_dtype(self) -> str | None:
        """Unquantized always: its weights are small, and quantizing it would only cost acceptance.
        The compute dtype on a GPU, the published one on the CPU."""
        if self.draft is None:
            return None
        return self.draft.dtype if self.draft_device() == "cpu" else compute_dtype(self.profile, self.draft)

    def _draft_items(self, where: str) -> list[MemoryItem]:
        draft, dtype = self.draft, self.draft_dtype()
        size = DTYPE_BYTES[dtype]
        tokens = min(self.context, DRAFT_SINKS + self.draft_window)
        return [MemoryItem(f"draft weights ({dtype})", where, int(draft.params_b * 1e9 * size)),
                MemoryItem(f"draft StreamingLLM cache ({tokens:,} tokens)", where, tokens * draft.kv_bytes_per_token(size)),
                MemoryItem("draft activations", where, activation_bytes(draft, self.prefill_chunk, size))]

    # -- placement

    def _place_gpus(self) -> None:
        """Fill the GPUs with the target's layers in order, the embedding on the first, the output
        head (and the draft, if on a GPU) on the last, which takes whatever layers are left (the
        budgets then tell whether they fit)."""
        target, gpus = self.pair.target, self.profile.gpus
        names = [f"cuda:{gpu.index}" for gpu in gpus]
        embedding, head, _ = self.weights()
        per_layer = self._layer_bytes()
        staging = 0 if self.kv_on_chip else 2 * math.ceil(self.full_kv / target.layers)
        running = activation_bytes(target, self.prefill_chunk, self.dtype_bytes) + staging + self._dequantized_bytes()
        fixed = {name: [] for name in names}
        if self.embedding_on_cpu:
            self.items.append(MemoryItem("target embedding (on the CPU)", "cpu", embedding))
        else:
            fixed[names[0]].append(MemoryItem("target embedding", names[0], embedding))
        head_label = f" ({self.quantization})" if self.head_quantized else ""
        fixed[names[-1]].append(MemoryItem(f"target output head{head_label}", names[-1], head))
        if self.draft is not None:
            fixed[names[-1]] += self._draft_items(names[-1])
        self.gpu_bytes_needed = (per_layer * target.layers + running + CUDA_CONTEXT_BYTES
                                 + sum(item.bytes for items in fixed.values() for item in items))
        remaining, first = target.layers, 0
        layers_on: list[tuple[str, int, int]] = []  # (device, first layer, count)
        for gpu, name in zip(gpus, names):
            room = _usable(gpu) - CUDA_CONTEXT_BYTES - sum(item.bytes for item in fixed[name]) - running
            count = min(remaining, max(0, room // per_layer)) if name != names[-1] else remaining
            if count:
                layers_on.append((name, first, count))
                first, remaining = first + count, remaining - count
            if self.kv_partial and len(gpus) == 1:  # the streamer runs on one device
                spare = room - per_layer * target.layers
                self.kv_resident_layers = min(target.layers - 1, max(0, spare // (self.full_kv // target.layers)))
        for name, start, count in layers_on:
            self.items += self._layer_items(name, start, count, per_layer, staging)
        for name in names:
            if fixed[name] or any(device == name for device, _, _ in layers_on):
                self.items += fixed[name] + [MemoryItem("CUDA context and allocator slack", name, CUDA_CONTEXT_BYTES)]
        self.target_devices = tuple(name for name, _, _ in layers_on)
        self.target_layers = tuple(count for _, _, count in layers_on)

    def _layer_items(self, name: str, start: int, count: int, per_layer: int, staging: int) -> list[MemoryItem]:
        target, share = self.pair.target, count / self.pair.target.layers
        span = f"target layers {start}-{start + count - 1}"
        label = self.dtype if self.quantization == "none" else self.quantization
        body = self.weights()[2]
        items = [MemoryItem(f"{span}: weights ({label})", name, int(body * share))]
        bits = ", 8-bit" if self.kv_int8 else ""
        if self.kv_on_chip:
            items.append(MemoryItem(f"{span}: full KV ({self.context:,} tokens{bits})", name, int(self.full_kv * share)))
        elif self.kv_resident_layers:
            items.append(MemoryItem(f"{span}: full KV of {self.kv_resident_layers} of them ({self.context:,} "
                                    f"tokens{bits}; the others' streamed)", name, self.resident_kv))
        if self.retrieval is not None:
            budget, chunk = self.retrieval
            items.append(MemoryItem(f"{span}: retrieval cache ({min(budget, self.context):,} tokens) and "
                                    f"chunk keys ({chunk}-token chunks)", name, int(self._retrieval_bytes() * share)))
        if staging:
            items.append(MemoryItem(f"{span}: KV staging buffers (2 layers{bits}, double buffering)", name, staging))
        if self.kv_int8:
            items.append(MemoryItem(f"{span}: one layer's KV dequantized for attention ({self.dtype})", name,
                                    self._dequantized_bytes()))
        items.append(MemoryItem(f"{span}: activations (prefill chunk {self.prefill_chunk:,}, MLP or attention)",
                                name, activation_bytes(target, self.prefill_chunk, self.dtype_bytes)))
        return items

    def _place_cpu(self) -> None:
        target = self.pair.target
        if not self.profile.gpus:
            label = self.dtype if self.quantization == "none" else self.quantization
            self.items += [
                MemoryItem(f"target weights ({label})", "cpu", sum(self.weights())),
                MemoryItem(f"full KV ({self.context:,} tokens)", "cpu", self.full_kv),
                MemoryItem(f"target activations (prefill chunk {self.prefill_chunk:,}, MLP or attention)", "cpu",
                           activation_bytes(target, self.prefill_chunk, self.dtype_bytes))]
            if self.retrieval is not None:
                self.items.append(MemoryItem(f"retrieval cache and chunk keys ({self.retrieval[1]}-token chunks)",
                                             "cpu", self._retrieval_bytes()))
            self.target_devices, self.target_layers = ("cpu",), (target.layers,)
        elif not self.kv_on_chip:
            layers = target.layers
            streamed = f"{layers - self.kv_resident_layers} of {layers} layers, " if self.kv_resident_layers else ""
            self.items.append(MemoryItem(f"full KV ({streamed}{self.context:,} tokens, pinned)", "cpu", self.pinned_kv))
        if self.draft is not None and not self.profile.gpus:
            self.items += self._draft_items("cpu")

    # -- reporting

    def weights_label(self) -> str:
        return self.dtype if self.quantization == "none" else self.quantization

    def curve_key(self) -> str:
        """The name of the target's measured t(n) in this placement (the loader uses the same)."""
        target = self.pair.target
        return curve_key(target.repo, target.revision, self.weights_label(),
                         kv_label(self.kv_int8, bool(self.profile.gpus) and not self.kv_on_chip, self.kv_resident_layers))

    def head_label(self) -> str:
        return self.quantization if self.head_quantized else self.dtype

    def embedding_device(self) -> str:
        return "cpu" if self.embedding_on_cpu else self.target_devices[0]

    def kv_device(self) -> str:
        if not self.profile.gpus:
            return "cpu"
        return "+".join(self.target_devices) if self.kv_on_chip else "cpu-pinned"

    def shortfall(self) -> str:
        """Why this (the last, smallest) candidate does not fit, with the figures."""
        over = [device for device in self.devices if device.headroom_bytes < 0]
        if self.pinned_bytes > self.profile.pinnable_bytes and not over:
            return (f"its offloaded KV would pin {human_size(self.pinned_bytes)} of RAM, and "
                    f"{self.profile.os or 'this OS'} lets CUDA pin at most {human_size(self.profile.pinnable_bytes)} "
                    f"(half the RAM)")
        if self.split_offload and not over:
            return (f"{self.weights_label()} weights need {len(self.target_devices)} GPUs, and an offloaded KV is "
                    f"streamed to one; its {human_size(self.full_kv)} do not fit beside them on the GPUs")
        if self.profile.gpus and (not over or over[0].device != "cpu"):
            usable = sum(_usable(gpu) for gpu in self.profile.gpus)
            head = " (the output head too)" if self.head_quantized else ""
            embedding = " and the embedding on the CPU" if self.embedding_on_cpu else ""
            return (f"{self.weights_label()} weights{head} need about {human_size(self.gpu_bytes_needed)} of GPU "
                    f"memory even with the KV offloaded{embedding}; the GPUs offer {human_size(usable)} after the "
                    f"margin")
        device = over[0]
        return (f"with {self.weights_label()} weights it needs {human_size(device.used_bytes)} of RAM; "
                f"{human_size(device.capacity_bytes - device.margin_bytes)} of {human_size(device.capacity_bytes)} "
                f"is usable")


def budgets(profile: HardwareProfile, items: list[MemoryItem]) -> tuple[DeviceMemory, ...]:
    """Every GPU's and the RAM's budget with `items` on them."""
    budgets = []
    for gpu in profile.gpus:
        name = f"cuda:{gpu.index}"
        budgets.append(DeviceMemory(name, gpu.vram_total_bytes, gpu.vram_total_bytes - _usable(gpu),
                                    sum(item.bytes for item in items if item.where == name)))
    ram = profile.ram_total_bytes
    budgets.append(DeviceMemory("cpu", ram, int(ram * RAM_MARGIN_SHARE),
                                sum(item.bytes for item in items if item.where == "cpu")))
    return tuple(budgets)


def _usable(gpu) -> int:
    """VRAM the plan may fill: all but the margin (10%, or what others already hold if more)."""
    margin = max(int(gpu.vram_total_bytes * VRAM_MARGIN_SHARE), gpu.vram_total_bytes - gpu.vram_free_bytes)
    return gpu.vram_total_bytes - margin


def slowest(layout: Layout, rate: str) -> float | None:
    """The slowest GPU's measured rate among those holding the target (None if unmeasured)."""
    rates = [getattr(gpu, rate) for gpu in layout.profile.gpus if f"cuda:{gpu.index}" in layout.target_devices]
    return None if not rates or None in rates else min(rates)
