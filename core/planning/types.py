"""What a plan is: the choices, the bytes on every device, a reason for each choice; and what a
user may fix (`Overrides`) or is offered when nothing fits (`Alternative`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import InputError
from ..hardware import kv_label


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
    # "auto": the placement with the least predicted time to an answer, quantized weights and an
    # 8-bit KV included; "exact": the model's own weights and KV dtype, quantized only where
    # nothing else fits (precision.py).
    precision: str = "auto"


@dataclass(frozen=True)
class Alternative:
    """A request that plans: the same pair at a shorter context, in 4-bit or at another precision
    (`precision`: None when as asked), or another pair."""

    pair_id: str
    context: int
    quantization: str | None
    summary: str
    precision: str | None = None


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
    # (speculative/dsi/cost.py's dsi_lookahead with the plan's step times); None outside dsi mode.
    dsi_lookahead: int | None = None
    # The target's output head: as `weights`, or unquantized ("bfloat16", ...) beside quantized layers.
    head_weights: str = ""
    # The target's input embedding: with its first layers (target_devices[0]), or "cpu" on a GPU
    # machine short of memory (a token's row is read there, a hidden vector crosses the link).
    embedding_device: str = ""
    # The full KV's storage: the compute dtype ("bfloat16", "float16", "float32"), or "int8" (codes
    # and a float32 scale per token and KV head, on the GPUs).
    kv_dtype: str = ""
    # Of an offloaded KV (kv_device "cpu-pinned"), the layers whose KV stays on the GPU: a partial
    # offload streams only the others' (kv/offload.py). 0: all streamed, or not offloaded.
    kv_resident_layers: int = 0
    precision: str = "auto"  # the setting it was planned under (Overrides.precision)
    # Predictions (cost.py; None where the bandwidths are not measured, as on a CPU-only machine):
    # decode at the planned context with the chosen speculation, and plain decoding of these weights.
    predicted_tokens_per_second: float | None = None
    plain_tokens_per_second: float | None = None
    predicted_prefill_seconds: float | None = None  # a prompt filling the context less the answer
    # The exact placement's predicted decode, for comparison (None where it does not fit).
    exact_tokens_per_second: float | None = None

    def resident_words(self) -> str:
        """Where a partial offload keeps its resident layers' KV ("cuda:0 for 14 of 32 layers"); "" otherwise."""
        if not self.kv_resident_layers:
            return ""
        return f"{self.target_devices[0]} for {self.kv_resident_layers} of {sum(self.target_layers)} layers"

    def kv_label(self) -> str:
        """How the KV is held where it changes t(n), for the target's curve key (hardware.kv_label)."""
        return kv_label(self.kv_dtype == "int8", self.kv_device == "cpu-pinned", self.kv_resident_layers)

    def to_dict(self) -> dict:
        data = asdict(self)
        for device, entry in zip(self.devices, data["devices"]):
            entry["headroom_bytes"] = device.headroom_bytes
        return data
