"""Calibration: measure a draft's positional acceptance vector for the loaded target, on a few
built-in prompts, and keep it on disk with the pair and sampling settings it was measured for."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .embedded import cache_root
from .engine import Engine
from .model import CausalLM
from .sampling import SamplingParams, make_generator
from .acceptance import AcceptanceVector, calibration_sequences, measure_acceptance
from .speculative.forward_times import ForwardTimes
from .speculative.optimizer import TreeChoice, choose_tree, measure_forward_times
from .speculative.tree import Tree
from .speculative.tree_dp import cached_best_tree

WIDTH = 8  # children measured per node: the most a tree node may get
VERIFY_SIZES = [1, 2, 4, 8, 16, 32, 64]  # t(n) is measured at these sizes

CALIBRATION_PROMPTS = (
    "Explain why the sky is blue in a short paragraph.",
    "List five everyday uses of copper and say why copper suits each.",
    "Summarize the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    "What should someone check before signing a rental agreement?",
)


@dataclass(frozen=True)
class Draft:
    """A draft model for the loaded target, and the name its acceptance vector is filed under."""
    model: CausalLM
    name: str


def layer_skip_draft(engine: Engine, layers: int) -> Draft:
    """The target's first `layers` layers (a layer-skip self-draft, sharing the target's weights)."""
    return Draft(engine.model.truncated(layers), f"skip{layers}")


def pair_draft(engine: Engine) -> Draft | None:
    """The separate draft model of a registry pair, when the engine has one."""
    return Draft(engine.draft, engine.draft_name) if engine.draft is not None else None


def acceptance_path(target: str, draft: str, params: SamplingParams, width: int) -> Path:
    name = "-".join(re.sub(r"[^A-Za-z0-9.]+", "-", part).strip("-") for part in (target, draft))
    return (cache_root() / "acceptance" /
            f"{name}-t{params.temperature:g}-k{params.top_k}-p{params.top_p:g}-w{width}.json")


def calibrate(engine: Engine, draft: Draft, params: SamplingParams, width: int = WIDTH,
              max_new_tokens: int = 48) -> tuple[AcceptanceVector, Path]:
    """Acceptance of `draft` as a draft for the target, saved under the user cache; returns the
    vector and its file."""
    generator = make_generator(params.seed if params.seed is not None else 0)
    prompts = [torch.tensor(engine.chat_ids([{"role": "user", "content": text}])) for text in CALIBRATION_PROMPTS]
    sequences = calibration_sequences(engine.model, prompts, params, generator, max_new_tokens, engine.stop_ids)
    vector = measure_acceptance(engine.model, draft.model, sequences, [p.shape[0] for p in prompts], params, width,
                                generator, models=f"{draft.name} -> {engine.name}")
    path = acceptance_path(engine.name, draft.name, params, width)
    vector.save(path)
    return vector, path


@dataclass(frozen=True)
class TreeDraftPlan:
    """Everything the hardware-aware choice of a draft tree rests on, and the choice."""
    acceptance: AcceptanceVector
    times: ForwardTimes  # the target's measured t(n) at this context
    draft_cost: float  # one draft step / one target step, measured
    choice: TreeChoice
    tree_draft: tuple[CausalLM, Tree] | None  # None: speculation with this draft does not pay

    @property
    def template(self) -> Tree:
        """The DP tree for the choice (a small one when the choice is plain decoding)."""
        p = self.acceptance.p
        return cached_best_tree(p, *((self.choice.size, self.choice.depth) if self.choice.size > 1 else (8, 3)))


def plan_tree_draft(engine: Engine, draft: Draft, params: SamplingParams, context: int,
                    max_size: int = 64, max_depth: int = 8) -> TreeDraftPlan:
    """Sequoia's hardware-aware choice for `draft` at this context: the saved
    acceptance vector (measured now if there is none), t(n) and the draft's cost measured on
    this machine, then speedup(n, d) = G(n, d) / (t(n) + d c) maximized over the grid."""
    try:
        acceptance = AcceptanceVector.load(acceptance_path(engine.name, draft.name, params, WIDTH), params)
    except FileNotFoundError:
        acceptance, _ = calibrate(engine, draft, params)
    sizes = [n for n in VERIFY_SIZES if n <= max_size]
    times = measure_forward_times(engine.model, context, sizes, repeats=3)
    draft_cost = measure_forward_times(draft.model, context, [1], repeats=3).one_token_seconds / times.one_token_seconds
    choice = choose_tree(list(acceptance.p), times, draft_cost, max_size, max_depth)
    plan = TreeDraftPlan(acceptance, times, draft_cost, choice, None)
    if choice.size == 1:
        return plan
    return TreeDraftPlan(acceptance, times, draft_cost, choice, (draft.model, plan.template))
