"""Calibration: measure a draft's positional acceptance vector for the loaded target, on a few
built-in prompts, and keep it on disk with the pair and sampling settings it was measured for."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .embedded import cache_root
from .engine import Engine
from .sampling import SamplingParams, make_generator
from .spec.acceptance import AcceptanceVector, calibration_sequences, measure_acceptance

CALIBRATION_PROMPTS = (
    "Explain why the sky is blue in a short paragraph.",
    "List five everyday uses of copper and say why copper suits each.",
    "Summarize the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    "What should someone check before signing a rental agreement?",
)


def acceptance_path(target: str, draft_layers: int, params: SamplingParams, width: int) -> Path:
    name = re.sub(r"[^A-Za-z0-9.]+", "-", target).strip("-")
    return (cache_root() / "acceptance" /
            f"{name}-skip{draft_layers}-t{params.temperature:g}-k{params.top_k}-p{params.top_p:g}-w{width}.json")


def calibrate(engine: Engine, draft_layers: int, params: SamplingParams, width: int = 8,
              max_new_tokens: int = 48) -> tuple[AcceptanceVector, Path]:
    """Acceptance of the target's first `draft_layers` layers (a layer-skip self-draft) as a
    draft for the whole target, saved under the user cache; returns the vector and its file."""
    draft = engine.model.truncated(draft_layers)
    generator = make_generator(params.seed if params.seed is not None else 0)
    prompts = [torch.tensor(engine.chat_ids([{"role": "user", "content": text}])) for text in CALIBRATION_PROMPTS]
    sequences = calibration_sequences(engine.model, prompts, params, generator, max_new_tokens, engine.stop_ids)
    vector = measure_acceptance(engine.model, draft, sequences, [p.shape[0] for p in prompts], params, width,
                                generator, models=f"{engine.name}[:{draft_layers}] -> {engine.name}")
    path = acceptance_path(engine.name, draft_layers, params, width)
    vector.save(path)
    return vector, path
