"""The plan: how a model pair runs on a machine, every choice with a one-line reason.

Pure and torch-free (tests/test_planning_imports.py imports it with torch blocked): a function of
a HardwareProfile, a pair and a context. plan.py orders the decisions; memory.py places the
bytes; speculation.py and dsi.py are the cost models; reasons.py words the choices.
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
    weight_parts,
)
from .dsi import DSI_MARGIN
from .plan import make_plan
from .speculation import RETRIEVAL_SIBLING_ACCEPTANCE
from .types import Alternative, DeviceMemory, MemoryItem, Overrides, Plan, PlanRefused

__all__ = [
    "DRAFT_SINKS", "DSI_MARGIN", "NF4_BITS", "PREFILL_CHUNK_CPU", "PREFILL_CHUNK_GPU", "QUANTIZATIONS", "RAM_MARGIN_SHARE",
    "RETRIEVAL_CHUNK_OFFLOADED", "RETRIEVAL_SIBLING_ACCEPTANCE", "VRAM_MARGIN_SHARE", "Alternative",
    "DeviceMemory", "MemoryItem", "Overrides", "Plan", "PlanRefused", "activation_bytes", "make_plan",
    "weight_parts",
]
