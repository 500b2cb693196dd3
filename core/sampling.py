"""Logits warping and sampling: pure functions over tensors.

Vocabulary: `warp` turns logits into the distribution a decoder samples from. The target's and
the draft's logits go through the same warp, so that speculative verification compares P and Q
as the user configured them. Temperature 0 is greedy: the warped distribution is the one-hot of
the argmax, which makes greedy verification a special case of the sampling rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be between 0 and 2**63 - 1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., vocab] -> fp32 probabilities [..., vocab]: temperature, then top-k, then top-p."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Shifted so the largest logit is 0 before dividing (softmax is shift-invariant, so the same
    # distribution): the others go to -inf, never NaN, however small the temperature. Divided in
    # float64, because a float32 temperature below 1e-45 rounds to 0 (and 0 / 0 is NaN).
    logits = ((logits - logits.amax(-1, keepdim=True)).double() / params.temperature).float()
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p`, renormalized."""
    sorted_probs, order = probs.sort(-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from `probs` [vocab]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_without_replacement(probs: torch.Tensor, k: int,
                               generator: torch.Generator | None) -> torch.Tensor:
    """Up to k distinct token ids [m] drawn without replacement from `probs` [vocab], in draw order.

    Gumbel-top-k: the top k of log P + Gumbel noise are distributed exactly as k sequential draws
    without replacement (the first ~ P, the second ~ P without the first, renormalized, ...); this
    is how Sequoia draws a node's children, the order being their rank. Only tokens with nonzero
    probability are ever returned, so when fewer than k tokens have mass, all of them come back
    (m = their count < k) and filling the missing children is the caller's choice.
    """
    # The noise is float64: a float32 uniform's 2**-24 granularity caps Gumbel noise near 16.6,
    # which some token of a 100k vocabulary would exceed in about 0.6% of draws, biasing them.
    uniform = torch.rand(probs.shape, generator=generator, dtype=torch.float64, device=probs.device)
    # Clamped away from 0 so the noise is finite: a token with mass always outranks one without.
    gumbel = -(-uniform.clamp(min=torch.finfo(torch.float64).tiny).log()).log()  # [vocab]
    has_mass = probs > 0  # [vocab]
    keys = torch.where(has_mass, probs.double().log() + gumbel, float("-inf"))  # [vocab]
    return keys.topk(min(k, int(has_mass.sum()))).indices


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else torch.seed())
    return generator
