"""The plan: how a model pair runs on a machine, every choice with a one-line reason.

`make_plan(profile, pair, context)` is pure: the same HardwareProfile (measured or synthetic),
pair and context always give the same plan, so it is tested against synthetic cards. The order of
the decisions is the order of what matters to a user:

1. The mode (algorithms.md sections 2, 5): on a GPU, a context much longer than the retrieval
   budget runs TriForce's hierarchy (the retrieval cache makes drafting cheap however long the
   context); otherwise chain or tree speculation, a tree only when the hardware-aware optimizer
   (measured t(n) and an acceptance vector) says it beats a chain.
2. Weights: as precise as fits. Unquantized (bf16 on GPUs), else bitsandbytes 8-bit, else 4-bit
   nf4, else nf4 with the output head quantized too; "fits" always allows the full KV to be
   offloaded and the embedding table to stay in RAM, so precision is never traded for speed.
3. The full KV on the GPUs with its layers when it fits, else in pinned CPU memory, streamed layer
   by layer (one full verification then costs its bytes over the measured host-to-device bandwidth).
   The embedding table on the GPU when it fits, else in RAM (host_embedding.py): given up first,
   as it costs a few KB over the link per token.
4. The draft on the GPU when it fits, else on the CPU.
5. Gammas, retrieval chunk size and prefill chunk from the measured bandwidths.
6. DSI (algorithms.md section 6) instead, with two or more GPUs that each hold a whole target at
   those weights: one target instance per GPU, verifying while the drafter drafts. Chosen where
   its cost model (speculative/dsi_cost.py) predicts it beats 1-5's plan by DSI_MARGIN, with the plan's
   own step times: a verification reads the weights and the KV at the card's memory rate, or
   streams an offloaded KV over the card's own link, so W instances verify side by side without
   sharing bandwidth.

Memory arithmetic uses the registry's shapes (layers, KV heads, head dim, vocabulary, hidden size,
parameters), never a per-card figure. GPU memory left unplanned (the margin): 10% of each card,
or what other processes already hold when that is more. CPU memory left unplanned: 20% of the
RAM, as pinned pages cannot be swapped out and the OS and this app need room.

Several GPUs: the target's layers are split across them in order (each layer's KV lives with the
layer, so the full KV stays on-chip twice as long), the output head and the draft go on the last.
Under DSI (6) each holds a whole target with a KV of its own instead, the draft beside the last.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from .errors import InputError
from .files import human_size
from .hardware import HardwareProfile, curve_key
from .modes import MODES
from .speculative.dsi_cost import dsi_lookahead, dsi_seconds_per_token, si_seconds_per_token
from .speculative.lookahead import MAX_DRAFT  # pure: no torch, as this module must stay
from .registry import DTYPE_BYTES, ModelPair, ModelSpec, Registry

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

RETRIEVAL_BUDGET = 4096  # TriForce's budget for 128K contexts (algorithms.md section 5)
RETRIEVAL_CHUNK_ON_CHIP = 8  # finer chunks retrieve more precisely
RETRIEVAL_CHUNK_OFFLOADED = 16  # the chunk keys are then the GPU's only copy of K: half of 8's
LONG_CONTEXT_FACTOR = 2  # TriForce pays once the context is this many retrieval budgets long
DRAFT_SINKS = 4  # StreamingLLM's attention sinks
DRAFT_WINDOW = 1020  # recent tokens the draft attends: 1024 slots with the sinks
GAMMA1 = 2  # TriForce's optimum for the draft -> retrieval stage (Llama2-7B-128K on an A100)
DEFAULT_GAMMA2 = 6  # TriForce's optimum, when the bandwidths are not measured
MAX_GAMMA2 = 64
RETRIEVAL_ACCEPTANCE = 0.9  # TriForce measured above 0.9 for the retrieval stage, also at T = 1
# Unconditional chance that the k-th child (by rank) is the one the full verification accepts, for
# the retrieval stage (the target itself over a retrieval cache): mostly its first choice. A stated
# default until measured per pair.
RETRIEVAL_SIBLING_ACCEPTANCE = (0.9, 0.04, 0.02, 0.01)
DRAFT_ACCEPTANCE = 0.8  # the small draft against the retrieval stage, until calibrated (assumed)
LOOKUP_ACCEPTANCE = 0.5  # prompt lookup's per-token acceptance, assumed (the lookahead's prior)
# DSI must be predicted this much faster: the model leaves out what its instances add (a process
# hop per task, prefill on every instance, cancelled work competing for the drafter's card).
DSI_MARGIN = 1.10
DEFAULT_TREE = (16, 4)
MAX_TREE_DEPTH = 12
PREFILL_CHUNK_CPU = 1024  # as the engine's prefill
PREFILL_CHUNK_GPU = 2048
PREFILL_CHUNKS_OFFLOADED = (8192, 4096, 2048, 1024)  # largest first: each chunk re-streams the KV so far


class PlanRefused(InputError):
    """Nothing fits; `alternatives` holds what does, nearest first (the message names them)."""

    def __init__(self, message: str, alternatives: tuple[Alternative, ...]):
        super().__init__(message)
        self.alternatives = alternatives


@dataclass(frozen=True)
class Overrides:
    """What a user may fix; None leaves the choice to the plan."""

    quantization: str | None = None  # one of QUANTIZATIONS
    mode: str | None = None  # one of MODES
    retrieval_budget: int | None = None  # tokens
    draft_window: int | None = None  # tokens after the sinks
    acceptance: tuple[float, ...] | None = None  # the draft's positional acceptance vector (calibrate)
    draft_cost: float | None = None  # draft step / target step, when no draft curve is measured
    retrieval_acceptance: float | None = None  # the retrieval stage's per-token acceptance rate


@dataclass(frozen=True)
class Alternative:
    """A request that plans: the same pair at a shorter context or in 4-bit, or another pair."""

    pair_id: str
    context: int
    quantization: str | None
    summary: str


@dataclass(frozen=True)
class MemoryItem:
    what: str
    where: str  # "cuda:0", "cpu"
    bytes: int


@dataclass(frozen=True)
class DeviceMemory:
    device: str
    capacity_bytes: int  # all of it
    margin_bytes: int  # left unplanned
    used_bytes: int  # the plan's items on it

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.margin_bytes - self.used_bytes


@dataclass(frozen=True)
class Plan:
    pair_id: str
    context: int  # tokens: prompt and answer together
    mode: str  # one of MODES
    weights: str  # the target's: bfloat16, float16, float32, int8 or nf4
    target_devices: tuple[str, ...]  # in layer order
    target_layers: tuple[int, ...]  # layers on each of target_devices
    draft_device: str | None  # None: no draft model (self-drafting or plain)
    draft_weights: str | None
    kv_device: str  # "cuda:0", "cuda:0+cuda:1" (with the layers), "cpu-pinned" (offloaded) or "cpu"
    retrieval_budget: int | None  # tokens; None outside TriForce
    retrieval_chunk: int | None
    draft_sinks: int | None
    draft_window: int | None
    gamma1: int | None  # draft tokens per verification (chain), or per retrieval verification (TriForce)
    gamma2: int | None  # tokens per full verification (TriForce)
    tree_size: int  # n for tree mode, root included
    tree_depth: int
    prefill_chunk: int
    memory: tuple[MemoryItem, ...]
    devices: tuple[DeviceMemory, ...]
    reasons: dict[str, str] = field(default_factory=dict)  # choice -> one line
    # TriForce's final verification: "chain" (gamma2 tokens) or "tree" (the tree_size/tree_depth
    # Sequoia tree, grown by the retrieval stage).
    triforce_verify: str = "chain"
    # DSI: one target instance per device, the first the engine's own target (target_devices,
    # whose copy it is: the memory counts one target per device). Empty outside dsi mode.
    dsi_devices: tuple[str, ...] = ()
    # DSI's draft tokens per verification task until the instances' measured latencies choose
    # (speculative/dsi_cost.py's dsi_lookahead with the plan's step times); None outside dsi mode.
    dsi_lookahead: int | None = None
    # The target's output head: as `weights`, or unquantized ("bfloat16", ...) beside quantized layers.
    head_weights: str = ""
    # The target's input embedding: with its first layers (target_devices[0]), or "cpu" on a GPU
    # machine short of memory (a token's row is read there, a hidden vector crosses the link).
    embedding_device: str = ""

    def to_dict(self) -> dict:
        data = asdict(self)
        for device, entry in zip(self.devices, data["devices"]):
            entry["headroom_bytes"] = device.headroom_bytes
        return data


# ---- memory arithmetic from the registry's shapes ------------------------------------------


def weight_parts(spec: ModelSpec, quantization: str, dtype_bytes: int,
                 head_quantized: bool = False) -> tuple[int, int, int]:
    """(embedding, output head, decoder layers) bytes. bitsandbytes quantizes linear layers only,
    and by default not the output head: the embedding (and the head) stay in the compute dtype.
    The registry does not say whether a model ties them, so both are counted: exact for untied
    models, an upper bound for tied ones."""
    matrix = spec.vocab_size * spec.hidden_size
    body_params = max(0.0, spec.params_b * 1e9 - 2 * matrix)
    bits = {"none": 8 * dtype_bytes, "int8": 8 + 32 / spec.hidden_size, "nf4": NF4_BITS}[quantization]
    head = int(matrix * bits / 8) if head_quantized else matrix * dtype_bytes
    return matrix * dtype_bytes, head, int(body_params * bits / 8)


def activation_bytes(spec: ModelSpec, chunk: int, dtype_bytes: int) -> int:
    """A prefill chunk's hidden-sized tensors plus the fp32 logits of the largest verification."""
    return chunk * spec.hidden_size * dtype_bytes * ACTIVATION_WIDTHS + MAX_VERIFY_TOKENS * spec.vocab_size * 4


def chunk_key_bytes(spec: ModelSpec, context: int, chunk: int, dtype_bytes: int) -> int:
    """The retrieval scores' input: one mean key per chunk, layer and KV head."""
    return math.ceil(context / chunk) * spec.layers * spec.kv_heads * spec.head_dim * dtype_bytes


# ---- the plan ------------------------------------------------------------------------------


def make_plan(profile: HardwareProfile, pair: ModelPair, context: int, overrides: Overrides | None = None,
              registry: Registry | None = None) -> Plan:
    """The plan for `pair` at `context` tokens on `profile`'s machine, or PlanRefused naming the
    nearest request that plans (a shorter context, 4-bit weights, or a smaller pair of `registry`)."""
    overrides = overrides or Overrides()
    _check_request(context, overrides)
    plan = _try_plan(profile, pair, context, overrides)
    if isinstance(plan, Plan):
        return plan
    alternatives = _alternatives(profile, pair, context, overrides, registry)
    nearest = ("; nearest that fits: " + "; or ".join(a.summary for a in alternatives)) if alternatives else \
        "; nothing smaller fits this machine either"
    raise PlanRefused(f"{pair.id} at {context:,} tokens does not fit: {plan}{nearest}", alternatives)


def _check_request(context: int, overrides: Overrides) -> None:
    if not isinstance(context, int) or context < 1:
        raise InputError(f"the context must be a positive number of tokens, got {context!r}")
    if overrides.quantization not in (None, *QUANTIZATIONS):
        raise InputError(f"unknown quantization {overrides.quantization!r}: choose from {', '.join(QUANTIZATIONS)}")
    if overrides.mode not in (None, *MODES):
        raise InputError(f"unknown mode {overrides.mode!r}: choose from {', '.join(MODES)}")
    for name in ("retrieval_budget", "draft_window"):
        value = getattr(overrides, name)
        if value is not None and value < 1:
            raise InputError(f"{name.replace('_', ' ')} must be at least 1 token, got {value}")
    if overrides.retrieval_acceptance is not None and not 0 < overrides.retrieval_acceptance < 1:
        raise InputError("the retrieval acceptance rate must be between 0 and 1")


def _try_plan(profile: HardwareProfile, pair: ModelPair, context: int, overrides: Overrides) -> Plan | str:
    """The plan, or a one-line reason why nothing fits."""
    if context > pair.context_length:
        return f"the pair supports at most {pair.context_length:,} tokens"
    reasons: dict[str, str] = {}
    budget = overrides.retrieval_budget or RETRIEVAL_BUDGET
    mode = _mode(profile, context, budget, overrides, reasons)
    tried = []
    # Outer loops hold what matters most: precision, then the KV on the GPU, the draft on the GPU,
    # a large prefill chunk; the embedding table on the GPU matters least (on the CPU a token's
    # row is read there and a few KB go over the link).
    tiers = [tier for tier in WEIGHT_TIERS if overrides.quantization in (None, tier[0])]
    for quantization, head_quantized in tiers:
        for kv_on_chip in (True, False) if profile.gpus else (False,):
            for with_draft in (True, False) if _uses_draft(pair, mode) and profile.gpus else (True,):
                for prefill_chunk in _prefill_chunks(profile, kv_on_chip):
                    for embedding_on_cpu in (False, True) if profile.gpus else (False,):
                        layout = _Layout(profile, pair, context, mode, budget, overrides, quantization,
                                         kv_on_chip, with_draft, prefill_chunk, head_quantized, embedding_on_cpu)
                        if layout.fits:
                            return _finish(layout, tried, reasons)
                        tried.append(layout)
    return tried[-1].shortfall()


def _uses_draft(pair: ModelPair, mode: str) -> bool:
    return pair.draft is not None and mode != "plain"


def _mode(profile: HardwareProfile, context: int, budget: int, overrides: Overrides,
          reasons: dict) -> str:
    """TriForce, plain or "speculate" (chain or tree, settled once the weights are known)."""
    if overrides.mode:
        reasons["mode"] = f"{overrides.mode}: as requested"
        return overrides.mode
    if profile.gpus and context > LONG_CONTEXT_FACTOR * budget:
        reasons["mode"] = (f"triforce: {context:,} tokens are over {LONG_CONTEXT_FACTOR}x the {budget:,}-token "
                           f"retrieval budget, so drafting against a retrieval cache reads a fraction of the full KV")
        return "triforce"
    return "speculate"


def _prefill_chunks(profile: HardwareProfile, kv_on_chip: bool) -> tuple[int, ...]:
    if not profile.gpus:
        return (PREFILL_CHUNK_CPU,)
    return (PREFILL_CHUNK_GPU,) if kv_on_chip else PREFILL_CHUNKS_OFFLOADED


def _compute_dtype(profile: HardwareProfile, spec: ModelSpec) -> str:
    """bf16 on GPUs that have it (fp16 on older ones); on a CPU the published dtype."""
    if profile.gpus:
        return "bfloat16" if all(gpu.bf16 for gpu in profile.gpus) else "float16"
    return spec.dtype


class _Layout:
    """Where every byte of one candidate (quantization, KV place, draft place, prefill chunk)
    goes, and whether it fits. Built once per candidate, read by `_finish`."""

    def __init__(self, profile, pair, context, mode, budget, overrides, quantization, kv_on_chip, with_draft,
                 prefill_chunk, head_quantized=False, embedding_on_cpu=False):
        self.profile, self.pair, self.context, self.mode, self.overrides = profile, pair, context, mode, overrides
        self.quantization, self.kv_on_chip = quantization, kv_on_chip
        self.head_quantized, self.embedding_on_cpu = head_quantized, embedding_on_cpu
        self.prefill_chunk = prefill_chunk
        target = pair.target
        self.dtype = _compute_dtype(profile, target)
        self.dtype_bytes = DTYPE_BYTES[self.dtype]
        self.kv_per_token = target.kv_bytes_per_token(self.dtype_bytes)
        self.full_kv = context * self.kv_per_token
        self.retrieval = (budget, RETRIEVAL_CHUNK_ON_CHIP if kv_on_chip else RETRIEVAL_CHUNK_OFFLOADED) \
            if mode == "triforce" else None
        # With a GPU the draft goes on the (last) GPU or is left out: on the CPU it would draft
        # slower than the GPU verifies. Without a GPU everything is on the CPU anyway.
        self.draft = pair.draft if _uses_draft(pair, mode) and with_draft else None
        self.draft_left_out = _uses_draft(pair, mode) and not with_draft
        self.draft_window = overrides.draft_window or DRAFT_WINDOW
        self.items: list[MemoryItem] = []
        self.target_devices: tuple[str, ...] = ()
        self.target_layers: tuple[int, ...] = ()
        self.gpu_bytes_needed = 0
        if profile.gpus:
            self._place_gpus()
        self._place_cpu()
        self.devices = _budgets(profile, self.items)
        self.fits = all(device.headroom_bytes >= 0 for device in self.devices)

    # -- what each part weighs

    def weights(self) -> tuple[int, int, int]:
        """The target's (embedding, output head, decoder layers) bytes."""
        return weight_parts(self.pair.target, self.quantization, self.dtype_bytes, self.head_quantized)

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

    def draft_device(self) -> str | None:
        if self.draft is None:
            return None
        return f"cuda:{self.profile.gpus[-1].index}" if self.profile.gpus else "cpu"

    def draft_dtype(self) -> str | None:
        """Unquantized always: its weights are small, and quantizing it would only cost acceptance.
        The compute dtype on a GPU, the published one on the CPU."""
        if self.draft is None:
            return None
        return self.draft.dtype if self.draft_device() == "cpu" else _compute_dtype(self.profile, self.draft)

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
        running = activation_bytes(target, self.prefill_chunk, self.dtype_bytes) + staging
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
        if self.kv_on_chip:
            items.append(MemoryItem(f"{span}: full KV ({self.context:,} tokens)", name, int(self.full_kv * share)))
        if self.retrieval is not None:
            budget, chunk = self.retrieval
            items.append(MemoryItem(f"{span}: retrieval cache ({min(budget, self.context):,} tokens) and "
                                    f"chunk keys ({chunk}-token chunks)", name, int(self._retrieval_bytes() * share)))
        if staging:
            items.append(MemoryItem(f"{span}: KV staging buffers (2 layers, double buffering)", name, staging))
        items.append(MemoryItem(f"{span}: activations (prefill chunk {self.prefill_chunk:,})", name,
                                activation_bytes(target, self.prefill_chunk, self.dtype_bytes)))
        return items

    def _place_cpu(self) -> None:
        target = self.pair.target
        if not self.profile.gpus:
            label = self.dtype if self.quantization == "none" else self.quantization
            self.items += [
                MemoryItem(f"target weights ({label})", "cpu", sum(self.weights())),
                MemoryItem(f"full KV ({self.context:,} tokens)", "cpu", self.full_kv),
                MemoryItem(f"target activations (prefill chunk {self.prefill_chunk:,})", "cpu",
                           activation_bytes(target, self.prefill_chunk, self.dtype_bytes))]
            if self.retrieval is not None:
                self.items.append(MemoryItem(f"retrieval cache and chunk keys ({self.retrieval[1]}-token chunks)",
                                             "cpu", self._retrieval_bytes()))
            self.target_devices, self.target_layers = ("cpu",), (target.layers,)
        elif not self.kv_on_chip:
            self.items.append(MemoryItem(f"full KV ({self.context:,} tokens, pinned)", "cpu", self.full_kv))
        if self.draft is not None and not self.profile.gpus:
            self.items += self._draft_items("cpu")

    # -- reporting

    def weights_label(self) -> str:
        return self.dtype if self.quantization == "none" else self.quantization

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


def _budgets(profile: HardwareProfile, items: list[MemoryItem]) -> tuple[DeviceMemory, ...]:
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


# ---- the choices that follow from the layout -----------------------------------------------


def _finish(layout: _Layout, tried: list[_Layout], reasons: dict) -> Plan:
    pair, context = layout.pair, layout.context
    reasons["weights"] = _weights_reason(layout, tried)
    reasons["placement"] = _placement_reason(layout)
    reasons["kv"] = _kv_reason(layout)
    mode, gamma1, gamma2, tree, verify, seconds = _speculation(layout, reasons)
    dsi = _dsi(layout, mode, seconds, reasons)
    if dsi is not None:
        return _dsi_plan(layout, dsi, tree, reasons)
    if layout.retrieval is not None:
        budget, chunk = layout.retrieval
        reasons["retrieval"] = (f"{budget:,}-token retrieval cache in {chunk}-token chunks: TriForce's budget; "
                                + ("8-token chunks retrieve more precisely and their keys are cheap next to the "
                                   "on-chip KV" if layout.kv_on_chip else "16-token chunks halve the mean keys "
                                   "kept on the GPU, its only copy of K"))
    if layout.draft is not None:
        reasons["draft_cache"] = _draft_cache_reason(layout)
    reasons["prefill_chunk"] = _prefill_reason(layout)
    _kv_attention_reason(layout, reasons)
    return Plan(
        pair_id=pair.id, context=context, mode=mode, weights=layout.weights_label(),
        target_devices=layout.target_devices, target_layers=layout.target_layers,
        draft_device=layout.draft_device(), draft_weights=layout.draft_dtype(),
        kv_device=layout.kv_device(),
        retrieval_budget=layout.retrieval[0] if layout.retrieval else None,
        retrieval_chunk=layout.retrieval[1] if layout.retrieval else None,
        draft_sinks=DRAFT_SINKS if layout.draft is not None else None,
        draft_window=layout.draft_window if layout.draft is not None else None,
        gamma1=gamma1, gamma2=gamma2, tree_size=tree[0], tree_depth=tree[1],
        prefill_chunk=layout.prefill_chunk, memory=tuple(layout.items), devices=layout.devices, reasons=reasons,
        triforce_verify=verify, head_weights=layout.head_label(),
        embedding_device=layout.embedding_device())


def _draft_cache_reason(layout: _Layout) -> str:
    return (f"StreamingLLM: {DRAFT_SINKS} attention sinks + the last {layout.draft_window:,} tokens, so a draft step "
            f"costs the same at any context length")


def _weights_reason(layout: _Layout, tried: list[_Layout]) -> str:
    sizes = f"target {human_size(sum(layout.weights()))}"
    if layout.quantization == "none":
        where = "in RAM" if not layout.profile.gpus else "with room for the caches"
        return f"{layout.weights_label()}: unquantized weights ({sizes}) fit {where}"
    head = (f", the output head quantized too (lossless against this quantized target; "
            f"{human_size(layout.weights()[1])} instead of "
            f"{human_size(weight_parts(layout.pair.target, 'none', layout.dtype_bytes)[1])})"
            if layout.head_quantized else "")
    tier = (layout.quantization, layout.head_quantized)
    finer = [candidate for candidate in tried if (candidate.quantization, candidate.head_quantized) != tier]
    if not finer:
        return f"{layout.weights_label()}{head}: as requested ({sizes})"
    # The last candidate of each tier is its smallest: KV offloaded, no draft, embedding on the CPU.
    smallest = {(candidate.quantization, candidate.head_quantized): candidate for candidate in finer}
    return f"{layout.weights_label()}{head} ({sizes}): " + "; ".join(
        candidate.shortfall() for candidate in smallest.values())


def _placement_reason(layout: _Layout) -> str:
    if not layout.profile.gpus:
        return "no CUDA GPU: everything runs on the CPU (decode is bound by reading the weights: slow for large models)"
    spread = ", ".join(f"{count} layers on {name}" for name, count in zip(layout.target_devices, layout.target_layers))
    text = f"target: {spread}"
    if layout.embedding_on_cpu:
        text += (f"; its embedding table ({human_size(layout.weights()[0])}) on the CPU: each token's row is read "
                 f"there and {layout.pair.target.hidden_size * layout.dtype_bytes:,} bytes go to the GPU")
    if len(layout.target_devices) > 1:
        held = "weights and KV" if layout.kv_on_chip else "weights"
        text += f" (split in layer order: each GPU holds its layers' {held}; one hop between them per forward)"
    if layout.draft is not None:
        last = layout.draft_device()
        alone = last not in layout.target_devices
        text += f"; draft on {last}" + (" (the target keeps the other GPU to itself)" if alone else "")
    elif layout.draft_left_out:
        drafter = "the retrieval cache drafts alone" if layout.retrieval else "prompt lookup drafts"
        text += (f"; no draft model: {layout.pair.draft.repo} does not fit next to the target and its caches, "
                 f"and on the CPU it would draft slower than the GPU verifies, so {drafter}")
    return text


def _kv_reason(layout: _Layout) -> str:
    size = human_size(layout.full_kv)
    if not layout.profile.gpus:
        return f"full KV ({size}) in RAM with the model"
    if layout.kv_on_chip:
        return f"full KV ({size}) on {layout.kv_device()} with its layers"
    h2d = _slowest(layout, "host_to_device_bytes_per_s")
    cost = f", about {layout.full_kv / h2d:.2f} s per full verification at the measured {human_size(h2d)}/s" \
        if h2d else ""
    return (f"full KV ({size}) offloaded to pinned CPU memory and streamed layer by layer: it does not fit "
            f"next to the weights{cost}")


def _kv_attention_reason(layout: _Layout, reasons: dict) -> None:
    """An offloaded KV is always streamed to the GPU: the plan chooses only paths measured end to
    end, and attention on the CPU where the KV lies was not one of them (bench/2026-11-22-h100-offload.json)."""
    if layout.profile.gpus and not layout.kv_on_chip:
        reasons["kv_attention"] = ("offloaded KV streamed to the GPU for attention: attending on the CPU where it lies "
                                   "measured 17.8x slower end to end (H100, 128K), against 1.01x the link's floor")


def _slowest(layout: _Layout, rate: str) -> float | None:
    """The slowest GPU's measured rate among those holding the target (None if unmeasured)."""
    rates = [getattr(gpu, rate) for gpu in layout.profile.gpus if f"cuda:{gpu.index}" in layout.target_devices]
    return None if not rates or None in rates else min(rates)


def _prefill_reason(layout: _Layout) -> str:
    chunk = layout.prefill_chunk
    act = human_size(activation_bytes(layout.pair.target, chunk, layout.dtype_bytes))
    if not layout.profile.gpus:
        return f"{chunk:,} tokens per forward, as the engine's prefill; activations about {act}"
    if layout.kv_on_chip:
        return f"{chunk:,} tokens per forward keep the GPU busy; activations about {act}"
    # Chunk i streams the KV of the i chunks before it: C^2 / (2 P) tokens' KV in all.
    moved = layout.context ** 2 / (2 * chunk) * layout.kv_per_token
    h2d = _slowest(layout, "host_to_device_bytes_per_s")
    time = f", about {moved / h2d:.1f} s at the measured bandwidth" if h2d else ""
    return (f"{chunk:,} tokens per forward, the largest that fits: every chunk re-streams the offloaded KV "
            f"written before it ({human_size(moved)} in all{time}); activations about {act}")


def _speculation(layout: _Layout, reasons: dict) -> tuple[str, int | None, int | None, tuple[int, int], str,
                                                          float | None]:
    """(mode, gamma1, gamma2, (tree n, d), TriForce's final verification, predicted seconds per
    token) with their reasons."""
    tree, tree_pays, chain = _tree(layout, reasons)
    seconds = _verification_seconds(layout)  # plain decoding's token
    mode = layout.mode
    if mode == "speculate":
        if tree_pays and (chain is None or tree_pays.speedup > chain.speedup):
            mode = "tree"
            reasons["mode"] = f"tree: the optimizer's tree beats the best chain ({tree_pays.reason})"
        else:
            mode = "chain"
            reasons["mode"] = "chain: " + (chain.reason if chain else
                                           "prompt lookup drafts from the document and the conversation, for free")
    if mode in ("chain", "tree") and seconds is not None:
        choice = tree_pays if mode == "tree" else chain  # the optimizer's, from measured t(n)
        seconds = seconds / choice.speedup if choice else _chain_seconds(layout, seconds)
    gamma1 = gamma2 = None
    verify = "chain"
    if mode == "chain":
        gamma1 = MAX_DRAFT
        reasons["gammas"] = (f"up to {gamma1} draft tokens per verification, each length chosen as the answer goes "
                             f"by the cost model, from the answer's acceptance so far and " + _step_times_source(layout))
    elif mode == "triforce":
        gamma1 = GAMMA1 if layout.draft is not None else None
        gamma2, why, costs = _gamma2(layout)
        first = f"gamma1 = {GAMMA1} (TriForce's optimum) draft tokens per retrieval verification; " \
            if gamma1 else "no draft model: the retrieval stage drafts alone; "
        reasons["gammas"] = first + why
        verify, tree, rate = _triforce_verify(layout, costs, gamma2, tree, reasons)
        if costs is not None:  # tokens per full verification's time: measured t(n), else t(n) = 1
            t_mid, t_full = costs
            rate = rate or _expected_tokens(gamma2, _retrieval_acceptance(layout)) / (gamma2 * t_mid / t_full + 1)
            seconds = t_full / rate
    elif mode == "dsi":  # asked for: no single-card figure to compare with
        seconds = None
    return mode, gamma1, gamma2, tree, verify, seconds


def _triforce_verify(layout: _Layout, costs: tuple[float, float] | None, gamma2: int, tree: tuple[int, int],
                     reasons: dict) -> tuple[str, tuple[int, int], float | None]:
    """A Sequoia tree as TriForce's final verification where the optimizer's tree beats the
    gamma2 chain: Speedup = G(n, d) / (t(n) + d c), c = one middle-stage token / one full
    verification, against E(gamma2) / (t(gamma2 + 1) + gamma2 c) for the chain (both in full
    verifications' time; the chosen one's is returned, None without measured t(n))."""
    from .speculative.optimizer import choose_tree

    target = layout.pair.target
    curves = layout.profile.curves_for(curve_key(target.repo, target.revision, layout.weights_label()))
    if costs is None or curves is None:
        reasons["triforce_verify"] = ("chain: a tree needs t(n) and the bandwidths measured on this machine "
                                      "(the first use calibrates)")
        return "chain", tree, None
    t_mid, t_full = costs
    times, c = curves.at(layout.context), t_mid / t_full
    a2 = _retrieval_acceptance(layout)
    chain = _expected_tokens(gamma2, a2) / (times.relative(gamma2 + 1) + gamma2 * c)
    choice = choose_tree(list(RETRIEVAL_SIBLING_ACCEPTANCE), times, c, max(2, times.sizes[-1]), MAX_TREE_DEPTH)
    if choice.size > 1 and choice.speedup > chain:
        reasons["triforce_verify"] = f"tree n={choice.size}, d={choice.depth}: beats the chain's {chain:.2f}x ({choice.reason})"
        return "tree", (choice.size, choice.depth), choice.speedup
    reasons["triforce_verify"] = f"chain: {chain:.2f}x over plain, the best tree {choice.speedup:.2f}x ({choice.reason})"
    return "chain", tree, chain


def _step_times_source(layout: _Layout) -> str:
    """Where the cost model's t(n) comes from: measured here, or the stated default."""
    target = layout.pair.target
    curves = layout.profile.curves_for(curve_key(target.repo, target.revision, layout.weights_label()))
    if curves is None:
        return "a stated t(n) until the first use calibrates this machine (`specchat calibrate`)"
    times = curves.at(min(layout.context, 2048))
    shown = ", ".join(f"t({n}) = {times.relative(n):.2f}" for n in (2, 4, 8) if n <= times.sizes[-1])
    return f"t(n) measured on this machine ({shown} at {times.context:,} tokens of context)"


def _tree(layout: _Layout, reasons: dict):
    """((n, d) for tree mode, the optimizer's tree choice or None, its chain choice or None)."""
    from .speculative.optimizer import chain_choice, choose_tree

    target, profile = layout.pair.target, layout.profile
    overrides_acceptance, draft_cost = _acceptance(layout)
    curves = profile.curves_for(curve_key(target.repo, target.revision, layout.weights_label()))
    if curves is None or overrides_acceptance is None or draft_cost is None:
        missing = [what for what, value in (("the target's t(n) on this machine", curves),
                                            ("the draft's acceptance vector", overrides_acceptance),
                                            ("the draft's cost", draft_cost)) if value is None]
        reasons["tree"] = (f"n={DEFAULT_TREE[0]}, d={DEFAULT_TREE[1]}: a stated default until the optimizer has "
                           f"what it needs (missing: {', '.join(missing)})")
        return DEFAULT_TREE, None, None
    times = curves.at(layout.context)
    max_size = max(2, times.sizes[-1])
    tree = choose_tree(list(overrides_acceptance), times, draft_cost, max_size, MAX_TREE_DEPTH)
    chain = chain_choice(list(overrides_acceptance), times, draft_cost, min(max_size - 1, MAX_TREE_DEPTH))
    reasons["tree"] = f"n={tree.size}, d={tree.depth}: {tree.reason}"
    return (tree.size, tree.depth), (tree if tree.size > 1 else None), chain


def _acceptance(layout: _Layout) -> tuple[tuple[float, ...] | None, float | None]:
    """(acceptance vector, draft cost c): the cost from the draft's and target's measured
    1-token times when both curves exist, else the override."""
    overrides = layout.overrides
    draft = layout.draft
    cost = overrides.draft_cost
    if cost is None and draft is not None:
        target = layout.pair.target
        target_curves = layout.profile.curves_for(curve_key(target.repo, target.revision, layout.weights_label()))
        draft_curves = layout.profile.curves_for(curve_key(draft.repo, draft.revision, layout.draft_dtype()))
        if target_curves and draft_curves:
            window = DRAFT_SINKS + layout.draft_window
            cost = (draft_curves.at(window).one_token_seconds
                    / target_curves.at(layout.context).one_token_seconds)
    return overrides.acceptance, cost


def _gamma2(layout: _Layout) -> tuple[int, str, tuple[float, float] | None]:
    """Tokens per full verification g maximizing E(g, a2) / (g T_mid + T_full), E(g, a) =
    (1 - a^(g+1)) / (1 - a) (algorithms.md section 1).

    T_full reads the weights and the whole KV (on-chip), or streams the KV over PCIe while the
    weights are read (offloaded; double buffering overlaps the two). T_mid is the cost of one
    middle-stage token: a retrieval-cache target forward plus gamma1 draft steps, shared by the
    E(gamma1, a1) tokens each such verification yields (one forward per token without a draft).
    Memory-bound forwards: bytes read / the measured on-device rate."""
    memory_rate = _slowest(layout, "memory_bytes_per_s")
    h2d = _slowest(layout, "host_to_device_bytes_per_s")
    t_full = _verification_seconds(layout)
    if t_full is None:
        return (DEFAULT_GAMMA2, f"gamma2 = {DEFAULT_GAMMA2}: TriForce's optimum (bandwidths not measured on this machine)",
                None)
    _, head, body = layout.weights()
    weights = head + body
    t_mid = (weights + layout.retrieval[0] * layout.kv_per_token) / memory_rate
    middle = f"{t_mid * 1e3:.1f} ms per retrieval-cache forward"
    if layout.draft is not None:
        a1 = layout.overrides.acceptance[0] if layout.overrides.acceptance else DRAFT_ACCEPTANCE
        draft_step = layout.draft.params_b * 1e9 * DTYPE_BYTES[layout.draft_dtype()] / memory_rate
        per_verification = _expected_tokens(GAMMA1, a1)
        t_mid = (t_mid + GAMMA1 * draft_step) / per_verification
        middle += (f" and {draft_step * 1e3:.1f} ms per draft step, over {per_verification:.2f} tokens each "
                   f"(draft acceptance {a1:.2f}): {t_mid * 1e3:.1f} ms per token")
    if layout.kv_on_chip:
        full = f"reads weights and {human_size(layout.full_kv)} of KV at {human_size(memory_rate)}/s"
    else:
        full = f"streams {human_size(layout.full_kv)} of KV at {human_size(h2d)}/s"
    a2 = _retrieval_acceptance(layout)
    best = max(range(1, MAX_GAMMA2 + 1), key=lambda g: _expected_tokens(g, a2) / (g * t_mid + t_full))
    # A plain step costs what a full verification does: the same weights and KV are read.
    speedup = _expected_tokens(best, a2) * t_full / (best * t_mid + t_full)
    return best, (f"gamma2 = {best}: a full verification ({full}) costs {t_full * 1e3:.0f} ms against {middle}; "
                  f"at retrieval acceptance {a2:.2f}, {best} tokens per full verification give the most tokens "
                  f"per second, about {speedup:.2f}x plain decoding"), (t_mid, t_full)


def _retrieval_acceptance(layout: _Layout) -> float:
    return layout.overrides.retrieval_acceptance or RETRIEVAL_ACCEPTANCE


def _verification_seconds(layout: _Layout) -> float | None:
    """One target forward of a few tokens at the full context, memory-bound (a plain step costs
    the same): it reads the weights and the whole KV on the GPUs (on-chip), or streams the KV over
    the link while the weights are read (offloaded; double buffering overlaps the two). None when
    the bandwidths are not measured (or there is no GPU)."""
    memory_rate = _slowest(layout, "memory_bytes_per_s")
    h2d = _slowest(layout, "host_to_device_bytes_per_s")
    if memory_rate is None or (not layout.kv_on_chip and h2d is None):
        return None
    _, head, body = layout.weights()
    if layout.kv_on_chip:
        return (head + body + layout.full_kv) / memory_rate
    return max(layout.full_kv / h2d, (head + body) / memory_rate)


def _drafter(layout: _Layout, draft: ModelSpec | None) -> tuple[float, float]:
    """(seconds per draft token, per-token acceptance) of `draft` next to `layout`'s target: the
    stated or measured cost c times a verification, else its weights read once per step (its
    StreamingLLM cache is small); the calibrated acceptance, else DRAFT_ACCEPTANCE. No draft
    model: prompt lookup, free, at LOOKUP_ACCEPTANCE. Only called with the bandwidths measured."""
    if draft is None:
        return 0.0, LOOKUP_ACCEPTANCE
    acceptance = layout.overrides.acceptance[0] if layout.overrides.acceptance else DRAFT_ACCEPTANCE
    cost = _acceptance(layout)[1]
    if cost is not None:
        return cost * _verification_seconds(layout), acceptance
    size = DTYPE_BYTES[_compute_dtype(layout.profile, draft)]
    return draft.params_b * 1e9 * size / _slowest(layout, "memory_bytes_per_s"), acceptance


def _chain_seconds(layout: _Layout, verification: float) -> float:
    """A chain on this layout with its own drafter, at its best length (SI's formula; 0 drafts is
    a plain step, as the engine's cost model may choose)."""
    draft, acceptance = _drafter(layout, layout.draft)
    return min(si_seconds_per_token(verification, draft, acceptance, k) for k in range(MAX_DRAFT + 1))


def _expected_tokens(gamma: int, acceptance: float) -> float:
    """Tokens per verification of a chain of `gamma` drafts, each accepted with `acceptance`."""
    return sum(acceptance ** i for i in range(gamma + 1))


# ---- DSI: a whole target on each GPU -------------------------------------------------------


@dataclass(frozen=True)
class _Dsi:
    cards: tuple[_Layout, ...]  # one instance each, a whole target; the last also holds the draft, if any
    items: tuple[MemoryItem, ...]
    devices: tuple[DeviceMemory, ...]
    lookahead: int | None  # None: not measured, the engine's first guess


def _dsi(layout: _Layout, mode: str, seconds: float | None, reasons: dict) -> _Dsi | None:
    """DSI over the GPUs that each hold a whole target, where its cost model predicts it beats
    the faster of `mode` on `layout` (`seconds` per token) and a chain there by DSI_MARGIN, or
    where asked for; reasons["dsi"] says why not (chosen: reasons["mode"] says why). Never with
    another mode asked for, and not considered with one GPU."""
    asked = layout.overrides.mode == "dsi"
    if layout.overrides.mode and not asked:
        return None
    if len(layout.profile.gpus) < 2:
        if asked:
            reasons["dsi"] = "fewer than two GPUs: the engine's CPU worker processes stand in for the instances"
        return None
    found = _dsi_cards(layout)
    if isinstance(found, str):
        reasons["dsi"] = f"{found}: the engine's CPU worker processes stand in" if asked else f"not chosen: {found}"
        return None
    cards, items, devices = found
    names = ", ".join(card.target_devices[0] for card in cards)
    over = f"over {len(cards)} GPUs ({names}) that each hold a whole target"
    verifications = [_verification_seconds(card) for card in cards]
    if None in verifications or (seconds is None and not asked):
        reasons["dsi"] = (f"{over}: the lookahead follows the measured latencies" if asked else
                          "not chosen: its cost model needs the GPUs' bandwidths measured "
                          "(`specchat profile --refresh`)")
        return _Dsi(cards, items, devices, None) if asked else None
    target = max(verifications)  # the slowest instance's
    draft, acceptance = _drafter(layout, cards[-1].draft)
    lookahead = dsi_lookahead(target, draft, len(cards), MAX_DRAFT)
    predicted = dsi_seconds_per_token(target, draft, acceptance, lookahead, len(cards))
    assumed = "" if cards[-1].draft and layout.overrides.acceptance else " assumed"
    drafter = (f"a draft step {draft / target:.1%} of a verification, draft acceptance {acceptance:.2f}{assumed}"
               if cards[-1].draft else f"prompt lookup drafts, acceptance {acceptance:.2f}{assumed}")
    link = "" if cards[0].kv_on_chip else ", each instance streaming its KV over its own link"
    how = f"lookahead {lookahead}, {drafter}; a verification {target * 1e3:.1f} ms{link}"
    if asked:
        reasons["dsi"] = f"{over}: predicted {predicted * 1e3:.1f} ms per token ({how})"
        return _Dsi(cards, items, devices, lookahead)
    # DSI's gain is its parallelism only against the best this layout does, a chain included:
    # by its own figures the chosen mode can be the slower one (TriForce at a moderate context).
    chain = _chain_seconds(layout, _verification_seconds(layout))
    if chain < seconds:
        mode, seconds = "chain", chain
    gain = seconds / predicted
    versus = (f"{gain:.2f}x a {mode} on {'+'.join(layout.target_devices)}",
              f"({predicted * 1e3:.1f} against {seconds * 1e3:.1f} ms per token; {how})")
    if gain >= DSI_MARGIN:
        reasons["mode"] = f"dsi {over}: predicted {versus[0]} {versus[1]}"
        return _Dsi(cards, items, devices, lookahead)
    reasons["dsi"] = (f"not chosen: DSI {over} is predicted {versus[0]}, under the {DSI_MARGIN:.2f}x it needs "
                      f"{versus[1]}")
    return None


def _dsi_cards(layout: _Layout) -> tuple[tuple[_Layout, ...], tuple[MemoryItem, ...], tuple[DeviceMemory, ...]] | str:
    """A whole target at the plan's weights on each GPU that holds one (two at least), or why
    not. The instances load alike (the plan's load options), so the KV stays with the layers on
    every card or is offloaded for all; as in `_try_plan`, the KV on-chip comes before the draft,
    which goes beside the last card's copy (without it prompt lookup drafts)."""
    profile, pair = layout.profile, layout.pair
    for kv_on_chip in (True, False):
        for with_draft in (True, False) if _uses_draft(pair, "dsi") else (False,):
            for chunk in _prefill_chunks(profile, kv_on_chip):
                cards = [card for card in (_card(layout, gpu, kv_on_chip, False, chunk) for gpu in profile.gpus)
                         if card.fits]
                if len(cards) < 2:
                    continue
                if with_draft:
                    cards[-1] = _card(layout, cards[-1].profile.gpus[0], kv_on_chip, True, chunk)
                # Each instance offloads a KV of its own: name whose each pinned copy is.
                items = tuple(replace(item, what=f"{item.what}, for the instance on {card.target_devices[0]}")
                              if item.where == "cpu" else item for card in cards for item in card.items)
                devices = _budgets(profile, list(items))
                if all(device.headroom_bytes >= 0 for device in devices):
                    return tuple(cards), items, devices
    # The last candidate tried is the smallest: KV offloaded, smallest chunk, no draft.
    holders = [card.target_devices[0] for card in cards]
    if len(holders) >= 2:  # each card fits alone: only the RAM is shared
        return f"one offloaded KV per instance ({len(holders)} x {human_size(layout.full_kv)}) does not fit in RAM"
    size = human_size(sum(layout.weights()))
    return (f"no two GPUs each hold a whole target ({layout.weights_label()} weights, {size}) even with its KV "
            f"offloaded" + (f"; only {holders[0]} does" if holders else "")
            + (", so its layers are split across them" if len(layout.target_devices) > 1 else ""))


def _card(layout: _Layout, gpu, kv_on_chip: bool, with_draft: bool, prefill_chunk: int) -> _Layout:
    """`layout`'s target alone on `gpu`: one DSI instance."""
    return _Layout(replace(layout.profile, gpus=(gpu,)), layout.pair, layout.context, "dsi", None, layout.overrides,
                   layout.quantization, kv_on_chip, with_draft, prefill_chunk, layout.head_quantized,
                   layout.embedding_on_cpu)


def _dsi_plan(layout: _Layout, dsi: _Dsi, tree: tuple[int, int], reasons: dict) -> Plan:
    """The plan with one instance per card: the engine's own target is the first card's copy,
    the draft beside the last's. The reasons of the layout it replaces are rewritten, or dropped
    where they belong to its speculation (gammas, TriForce's verification)."""
    first, last = dsi.cards[0], dsi.cards[-1]
    names = tuple(card.target_devices[0] for card in dsi.cards)
    for stale in ("gammas", "triforce_verify"):
        reasons.pop(stale, None)
    size = human_size(sum(layout.weights()))
    drafter = (f"draft on {last.draft_device()}" if last.draft else
               "no draft model fits beside a copy: prompt lookup drafts")
    reasons["placement"] = (f"a whole target ({size}) on each of {', '.join(names)}: one DSI instance per GPU, the "
                            f"engine's own on {names[0]}; {drafter}")
    kv = human_size(layout.full_kv)
    reasons["kv"] = (f"each instance's full KV ({kv}) on its GPU with its layers" if first.kv_on_chip else
                     f"each instance's full KV ({kv}) offloaded to pinned CPU memory ({len(names)} copies) and "
                     f"streamed to its GPU over its own link: it does not fit next to the weights")
    if last.draft is not None:
        reasons["draft_cache"] = _draft_cache_reason(last)
    reasons["prefill_chunk"] = _prefill_reason(first)
    if not first.kv_on_chip:
        reasons["kv_attention"] = ("offloaded KV streamed to the GPUs: each instance over its own link, side by side "
                                   "(on the CPU the instances would share its memory bandwidth)")
    return Plan(
        pair_id=layout.pair.id, context=layout.context, mode="dsi", weights=layout.weights_label(),
        target_devices=first.target_devices, target_layers=first.target_layers,
        draft_device=last.draft_device(), draft_weights=last.draft_dtype(), kv_device=first.kv_device(),
        retrieval_budget=None, retrieval_chunk=None,
        draft_sinks=DRAFT_SINKS if last.draft is not None else None,
        draft_window=last.draft_window if last.draft is not None else None,
        gamma1=None, gamma2=None, tree_size=tree[0], tree_depth=tree[1], prefill_chunk=first.prefill_chunk,
        memory=dsi.items, devices=dsi.devices, reasons=reasons, dsi_devices=names,
        dsi_lookahead=dsi.lookahead, head_weights=first.head_label(), embedding_device=first.embedding_device())


# ---- refusals ------------------------------------------------------------------------------


def _alternatives(profile: HardwareProfile, pair: ModelPair, context: int, overrides: Overrides,
                  registry: Registry | None) -> tuple[Alternative, ...]:
    """What does plan, nearest first: 4-bit weights at this context (when the user fixed a finer
    quantization), the longest context this pair fits, a smaller pair of the registry."""
    found = []
    if overrides.quantization not in (None, "nf4") and \
            isinstance(_try_plan(profile, pair, context, replace(overrides, quantization="nf4")), Plan):
        found.append(Alternative(pair.id, context, "nf4", f"{pair.id} at {context:,} tokens with 4-bit (nf4) weights"))
    shorter = _longest_context(profile, pair, min(context, pair.context_length + 1) - 1, overrides)
    if shorter:
        found.append(Alternative(pair.id, shorter, overrides.quantization, f"{pair.id} at {shorter:,} tokens"))
    if registry is not None:
        smaller = sorted((other for other in registry.pairs.values()
                          if other.id != pair.id and _weight_params(other) < _weight_params(pair)),
                         key=_weight_params, reverse=True)
        for other in smaller:  # the largest first: the nearest to what was asked for
            free = replace(overrides, quantization=None)
            at = min(context, other.context_length)
            if not isinstance(_try_plan(profile, other, at, free), Plan):
                at = _longest_context(profile, other, at - 1, free)
            if at:
                found.append(Alternative(other.id, at, None, f"the smaller pair {other.id} at {at:,} tokens"))
                break
    return tuple(found)


def _weight_params(pair: ModelPair) -> float:
    return sum(model.params_b for model in pair.models)


def _longest_context(profile: HardwareProfile, pair: ModelPair, most: int, overrides: Overrides) -> int | None:
    """The longest whole number of 1,024-token blocks up to `most` that plans (binary search:
    memory only grows with the context), or None."""
    low, high = 0, most // 1024  # low plans (0 = none found), high + 1 does not
    while low < high:
        middle = (low + high + 1) // 2
        if isinstance(_try_plan(profile, pair, middle * 1024, overrides), Plan):
            low = middle
        else:
            high = middle - 1
    return low * 1024 or None
