"""The plan: how a model pair runs on a machine, every choice with a one-line reason.

Pure and torch-free (tests/test_architecture.py plans with torch blocked): a function of a
HardwareProfile, a pair, a context and the precision. plan.py orders the decisions; candidates.py
scores the automatic precision's placements; memory.py places the bytes; cost.py (with
efficiency.py), speculation.py and dsi.py are the cost models; assemble.py finishes a layout as a
plan; reasons.py and precision.py word the choices.
"""

from .memory import (
    DRAFT_SINKS,
    NF4_BITS,
    PREFILL_CHUNK_CPU,
    PREFILL_CHUNK_GPU,
    QUANTIZATIONS,
    RAM_MARGIN_SHARE,
    RETRIEVAL_CHUNK_OFFLOADED,
    VRAM_MARGIN_SHARE,
    activation_bytes,
    kv8_bytes_per_token,
    weight_parts,
)
from .candidates import candidates, ranking_seconds, time_to_answer
from .cost import ANSWER_TOKENS, answer_tokens
from .dsi import DSI_MARGIN
from .plan import make_plan
from .precision import PRECISION_ENV, PRECISIONS, precision_setting
from .speculation import RETRIEVAL_SIBLING_ACCEPTANCE
from .types import Alternative, DeviceMemory, MemoryItem, Overrides, Plan, PlanRefused

__all__ = [
    "ANSWER_TOKENS", "DRAFT_SINKS", "DSI_MARGIN", "NF4_BITS", "PRECISIONS", "PRECISION_ENV", "PREFILL_CHUNK_CPU",
    "PREFILL_CHUNK_GPU", "QUANTIZATIONS", "RAM_MARGIN_SHARE", "RETRIEVAL_CHUNK_OFFLOADED",
    "RETRIEVAL_SIBLING_ACCEPTANCE", "VRAM_MARGIN_SHARE", "Alternative", "DeviceMemory", "MemoryItem", "Overrides",
    "Plan", "PlanRefused", "activation_bytes", "answer_tokens", "candidates", "kv8_bytes_per_token", "make_plan", "precision_setting",
    "ranking_seconds", "time_to_answer", "weight_parts",
]
