"""One answer's request to the engine, validated once where it is made: the answer limit, the
sampling, the decoding mode and that mode's own options as one typed field.

The CLI, the terminal chat, the page and the API all build a `Request`; `Engine.generate` then
only checks what needs the engine (the prompt against the context).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from .decoding import TriforceSettings
from .errors import InputError
from .modes import MAX_DSI_WORKERS, REQUEST_MODES
from .sampling import SamplingParams
from .speculative.tree import Tree

if TYPE_CHECKING:
    from .model import CausalLM


@dataclass(frozen=True)
class TreeDraft:
    """Tree mode with a draft model growing `template` (default: prompt-lookup branches)."""

    model: CausalLM
    template: Tree


@dataclass(frozen=True)
class DsiOptions:
    workers: int | None = None  # CPU processes standing in for GPUs where the plan names none (default 2)
    plain_steps: bool = True  # False: every token from the instances, even where plain steps are faster

    def __post_init__(self):
        if self.workers is not None and not 1 <= self.workers <= MAX_DSI_WORKERS:
            raise InputError(f"dsi mode runs 1 to {MAX_DSI_WORKERS} worker processes, not {self.workers}")


ModeOptions = Union[TriforceSettings, TreeDraft, DsiOptions]
# The mode each kind of options belongs to. `auto` takes TriforceSettings too: they apply when the
# plan's mode is TriforceSettings', and are unused otherwise.
OPTIONS_MODE = {TriforceSettings: "triforce", TreeDraft: "tree", DsiOptions: "dsi"}


@dataclass(frozen=True)
class Request:
    max_new_tokens: int = 256  # the answer limit (the engine also stops at the end of the context)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    mode: str = "auto"  # one of REQUEST_MODES; auto: the plan's mode for this machine
    options: ModeOptions | None = None  # the mode's own options (default: the engine's settings)
    # The prompt's first tokens hold a document whose KV is saved to disk for later runs.
    document_tokens: int = 0
    # The conversation the answer belongs to (a stable id; "": none named, as from the API): the
    # engine keeps one KV in memory per conversation (its next answer takes it back, never copies
    # it), and lists the document files it saves or reuses as used by it (`kv/document_owners`).
    conversation: str = ""

    def __post_init__(self):
        if self.mode not in REQUEST_MODES:
            raise InputError(f"unknown mode {self.mode!r}: choose from {', '.join(REQUEST_MODES)}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InputError(f"max new tokens must be at least 1, got {self.max_new_tokens}")
        if self.document_tokens < 0:
            raise InputError(f"document tokens cannot be negative, got {self.document_tokens}")
        if self.options is not None:
            belongs = OPTIONS_MODE.get(type(self.options))
            if belongs is None:
                raise InputError(f"unknown mode options {type(self.options).__name__}")
            if self.mode not in (belongs, "auto") or (self.mode == "auto" and belongs != "triforce"):
                raise InputError(f"{type(self.options).__name__} is for {belongs} mode, not {self.mode}")

    def options_for(self, mode: str) -> ModeOptions | None:
        """The options if they belong to `mode` (the mode `auto` resolved to), else None."""
        return self.options if OPTIONS_MODE.get(type(self.options)) == mode else None
