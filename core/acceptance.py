"""Positional acceptance vectors for Sequoia's tree DP, measured offline (algorithms.md sections 2-4).

Vocabulary: at a tree node the draft proposes `width` children drawn without replacement from its
warped distribution Q (at temperature 0, its top-`width` tokens), and the verifier tests them in
rank order against the target's P (`verify.verify_node`). This module stores

    p_k = P(children 1..k-1 rejected and child k accepted)      (unconditional, sum_k p_k <= 1)

because that is what the DP's F(T) = sum over nodes of prod p_rank along the path needs: a node
of rank k is reached only if its elder siblings were rejected and it was accepted. algorithms.md
words p_k as the conditional rate r_k = P(child k accepted | 1..k-1 rejected); the two convert as
p_k = r_k * prod_{j<k} (1 - r_j).

Measurement is by teacher forcing: calibration sequences (prompt + a continuation the target
generated, `calibration_sequences`) go through the target and the draft once each; every
continuation context becomes one node, verified with the real verifier and fresh uniforms, and
p_k = (contexts whose rank-k child was accepted) / contexts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .decoding import PlainDecoder, decode, prefill_all
from .files import write_atomically
from .model import CausalLM
from .sampling import SamplingParams, apply_penalties, chain_counts, sample_without_replacement, warp
from .speculative.types import DecodeState
from .speculative.verify import verify_node

FORMAT_VERSION = 1  # bump when the file format or the meaning of p changes


class AcceptanceFileError(ValueError):
    """An acceptance file is unreadable, from another format version, or for other settings."""


@dataclass(frozen=True)
class AcceptanceVector:
    accepted: tuple[int, ...]  # [width] contexts whose rank-k child was the accepted one
    positions: int  # contexts measured (each counts once, accepted or not)
    temperature: float
    top_k: int
    top_p: float
    models: str = ""  # which draft and target, e.g. "SmolLM2-135M[:10] -> SmolLM2-135M"

    def __post_init__(self):
        if (not self.accepted or self.positions < 1 or min(self.accepted) < 0
                or sum(self.accepted) > self.positions):
            raise ValueError(f"inconsistent acceptance counts {self.accepted} over "
                             f"{self.positions} positions")

    @property
    def p(self) -> tuple[float, ...]:
        """p_1..p_width (fp64): the unconditional probability that rank k is the accepted child."""
        return tuple(count / self.positions for count in self.accepted)

    @property
    def width(self) -> int:
        return len(self.accepted)

    def matches(self, params: SamplingParams) -> bool:
        """Measured under the same warping as `params` (the seed does not matter; nor do the
        repetition penalties: they move P and Q alike, and the vector only shapes the tree)."""
        return (self.temperature, self.top_k, self.top_p) == (
            params.temperature, params.top_k, params.top_p)

    def save(self, path: Path | str) -> None:
        """Write as JSON via a temporary file and a rename: readers never see half a file."""
        path = Path(path)
        record = {"version": FORMAT_VERSION, "accepted": list(self.accepted),
                  "positions": self.positions, "temperature": self.temperature,
                  "top_k": self.top_k, "top_p": self.top_p, "models": self.models,
                  "p": list(self.p)}  # for people reading the file; recomputed on load
        write_atomically(path, json.dumps(record, indent=1))

    @classmethod
    def load(cls, path: Path | str, params: SamplingParams | None = None,
             models: str | None = None) -> "AcceptanceVector":
        """Read a saved vector; with `params` / `models`, also require that it was measured for
        them. Raises AcceptanceFileError for a corrupt, outdated or mismatched file (a missing
        file raises FileNotFoundError)."""
        text = Path(path).read_text()
        try:
            record = json.loads(text)
            if record["version"] != FORMAT_VERSION:
                raise ValueError(f"format version {record['version']}, expected {FORMAT_VERSION}")
            vector = cls(tuple(_exact_int(count) for count in record["accepted"]),
                         _exact_int(record["positions"]), float(record["temperature"]),
                         _exact_int(record["top_k"]), float(record["top_p"]), str(record["models"]))
        except (ValueError, KeyError, TypeError) as error:
            raise AcceptanceFileError(f"{path} is not a valid acceptance file: {error}") from error
        if params is not None and not vector.matches(params):
            raise AcceptanceFileError(
                f"{path} was measured at temperature {vector.temperature}, top-k {vector.top_k}, "
                f"top-p {vector.top_p}, not temperature {params.temperature}, "
                f"top-k {params.top_k}, top-p {params.top_p}")
        if models is not None and vector.models != models:
            raise AcceptanceFileError(f"{path} was measured for {vector.models!r}, not {models!r}")
        return vector


def _exact_int(value) -> int:
    """An int from JSON, refusing floats and booleans that int() would quietly accept."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def measure_acceptance(target: CausalLM, draft: CausalLM, sequences: list[torch.Tensor],
                       prompt_lengths: list[int], params: SamplingParams, width: int,
                       generator: torch.Generator, models: str = "") -> AcceptanceVector:
    """The positional acceptance vector of `draft` for `target` under `params`, `width` ranks.

    sequences [L_i] token ids (prompt + continuation); the contexts measured in sequence i are
    those ending at positions prompt_lengths[i] - 1 .. L_i - 2, i.e. those that produced the
    continuation's tokens. At temperature 0 the children are the draft's top-`width` tokens
    (deterministic, point-mass proposals), otherwise Gumbel-top-k draws from the warped Q.
    """
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.vocab_size}) differs from the "
                         f"target's ({target.vocab_size})")
    accepted, positions = [0] * width, 0
    for ids, prompt_length in zip(sequences, prompt_lengths):
        if not 1 <= prompt_length <= ids.shape[0]:
            raise ValueError(f"prompt length {prompt_length} outside 1..{ids.shape[0]}")
        # Each context penalized for the continuation before it, as the decoders verify.
        counts = (chain_counts(torch.zeros(target.vocab_size), ids[prompt_length:-1]) if params.penalized
                  else None)  # [m, vocab]
        p = warp(_context_logits(target, ids, prompt_length), params, counts)  # [m, vocab]
        draft_logits = _context_logits(draft, ids, prompt_length)  # [m, vocab]
        q = None if params.greedy else warp(draft_logits, params, counts)  # [m, vocab]
        if q is None and counts is not None:  # greedy children: the top tokens after the penalties
            draft_logits = apply_penalties(draft_logits, counts, params)
        for row in range(p.shape[0]):
            if q is None:
                children = draft_logits[row].topk(min(width, draft_logits.shape[1])).indices
            else:
                children = sample_without_replacement(q[row], width, generator)  # [<= width]
            uniforms = torch.rand(children.shape[0], generator=generator).tolist()
            rank, _ = verify_node(p[row], None if q is None else q[row], children.tolist(), uniforms)
            if rank is not None:
                accepted[rank] += 1
        positions += p.shape[0]
    if positions == 0:
        raise ValueError("no continuation tokens to measure acceptance on")
    return AcceptanceVector(tuple(accepted), positions, params.temperature, params.top_k,
                            params.top_p, models)


def _context_logits(model: CausalLM, ids: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Logits [L - prompt_length, vocab] after positions prompt_length - 1 .. L - 2 of ids [L],
    from a fresh cache. The prompt's earlier positions go first with `last_only`, which spares
    a [prompt_length, vocab] logits tensor for long (document) prompts."""
    cache, start, end = model.new_cache(), prompt_length - 1, ids.shape[0] - 1
    if start > 0:
        model.forward(ids[:start], torch.arange(start), cache, last_only=True)
    if end == start:
        return torch.empty(0, model.vocab_size)
    return model.forward(ids[start:end], torch.arange(start, end), cache)


def calibration_sequences(model: CausalLM, prompts: list[torch.Tensor], params: SamplingParams,
                          generator: torch.Generator, max_new_tokens: int,
                          stop_ids: frozenset[int] | set[int] = frozenset(),
                          chunk_size: int = 1024) -> list[torch.Tensor]:
    """Each prompt [L_i] followed by up to `max_new_tokens` tokens of plain decoding with `model`
    (greedy or sampled per `params`), ending early after a stop token, which is kept: the context
    that produced it is one the decoder really verifies. -> [L_i + new_i] per prompt."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    sequences = []
    for prompt in prompts:
        state = DecodeState(model, model.new_cache(), prompt, params, generator)
        first_logits = prefill_all(model, state.cache, prompt, chunk_size)
        for step in decode(state, PlainDecoder(), first_logits, max_new_tokens):
            if step.tokens[-1] in stop_ids:
                break
        sequences.append(state.ids)
    return sequences
