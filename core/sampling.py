"""Logits warping and sampling: pure functions over tensors.

Vocabulary: `warp` turns logits into the distribution a decoder samples from. The target's and
the draft's logits go through the same warp, so that speculative verification compares P and Q
as the user configured them. Temperature 0 is greedy: the warped distribution is the one-hot of
the argmax, which makes greedy verification a special case of the sampling rule.

Repetition controls are part of the warp, applied first: each row's logits are penalized by the
counts of the tokens seen before that row's position (`apply_penalties`). A speculative step
scores many positions at once, each with its own prefix, so it passes one row of counts per
position (`chain_counts`, `path_counts`): the processed distribution is then the same whichever
forward computed the row, and speculation stays exact.

Everything here runs on the device the logits are on (a GPU's logits never cross to the host
whole): random numbers are drawn there, from a generator seeded by the answer's own
(`on_device`), and a sampled token is the one number that comes back.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

MAX_REPETITION_PENALTY = 2.0  # beyond it the penalty wrecks text (NVIDIA NIM's OpenAI API caps it there too)
MAX_COUNT_PENALTY = 2.0  # OpenAI's range for the frequency and presence penalties: [-2, 2]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    # Seen: the answer's own tokens, never the prompt's, so a summary may quote its document (OpenAI's rule).
    repetition_penalty: float = 1.0  # HF / llama.cpp: a seen token's logit / it if > 0, * it if < 0
    frequency_penalty: float = 0.0  # OpenAI: logit -= frequency * count
    presence_penalty: float = 0.0  # OpenAI: logit -= presence * (count > 0)
    # End the answer once it repeats itself (core/repeats.py): a stop condition, no distribution
    # change; here so that every front end building the sampling can ask for it (as in vLLM).
    stop_repeats: bool = False

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be between 0 and 2**63 - 1, got {self.seed}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                             f"got {self.repetition_penalty}")
        for name in ("frequency", "presence"):
            value = getattr(self, f"{name}_penalty")
            if not (math.isfinite(value) and abs(value) <= MAX_COUNT_PENALTY):
                raise ValueError(f"{name} penalty must be in [-{MAX_COUNT_PENALTY:g}, {MAX_COUNT_PENALTY:g}] "
                                 f"(0 = off), got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Some repetition control is on: `warp` then needs each row's counts of seen tokens."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., vocab] penalized by how often each token was seen before each row, counts
    [..., vocab] (float): the repetition penalty, then the frequency and presence penalties.

    Only the columns some row has seen are computed (an answer's few hundred tokens of a
    vocabulary of 49-128K): an unseen token's logit is left as it is, which is what the penalties
    do to it, and every seen one gets the same arithmetic as over the whole row."""
    if not params.penalized:
        return logits
    counts = counts.to(logits.device)  # a draft's logits may be on another GPU than the target's counts
    columns = (counts > 0).reshape(-1, counts.shape[-1]).any(0).nonzero().squeeze(1)  # [seen]
    if columns.numel() == 0:
        return logits
    penalized = logits.clone()
    penalized[..., columns] = _penalties(logits[..., columns], counts[..., columns], params)
    return penalized


def _penalties(logits: torch.Tensor, counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    seen = counts > 0
    if params.repetition_penalty != 1.0:
        penalty = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    if params.frequency_penalty != 0.0:
        logits = logits - params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * seen.to(logits.dtype)
    return logits


def token_counts(tokens: torch.Tensor, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """How often each token id occurs in `tokens` [m] -> [vocab] float, on `device`."""
    return torch.bincount(tokens.to(device), minlength=vocab)[:vocab].float()


def path_counts(base: torch.Tensor, tokens: torch.Tensor, on_path: torch.Tensor) -> torch.Tensor:
    """Counts for nodes of a token tree scored in one forward -> [m, vocab] (on `base`'s device):
    `base` [vocab] (the committed text's, the root included) plus the tokens on each node's path.
    tokens [n], with tokens[0] the root; on_path [m, n] bool, True where node j is row i's node or
    above it (rows of `Tree.ancestors`): row i predicts what follows them."""
    rows, nodes = on_path[:, 1:].nonzero(as_tuple=True)
    counts = base.expand(on_path.shape[0], -1).clone()
    counts.index_put_((rows.to(base.device), tokens.to(base.device)[nodes.to(base.device) + 1]),
                      torch.ones(rows.shape[0], device=base.device), accumulate=True)
    return counts


def chain_counts(base: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """Counts for a chain: row i predicts after the first i of the draft tokens [g] -> [g + 1, vocab]."""
    length = draft.shape[0] + 1
    tokens = torch.cat([draft.new_zeros(1), draft])  # the root's token is in `base` already
    return path_counts(base, tokens, torch.ones(length, length, dtype=torch.bool).tril())


def warp(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [..., vocab] -> fp32 probabilities [..., vocab]: the penalties (with `counts`
    [..., vocab], each row's seen tokens; needed when `params.penalized`), then temperature, top-k
    and top-p."""
    logits = logits.float()
    if params.penalized:
        if counts is None:
            raise ValueError("repetition penalties need each row's counts of the tokens seen before it")
        logits = apply_penalties(logits, counts, params)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Shifted so the largest logit is 0 before dividing (softmax is shift-invariant, so the same
    # distribution): the others go to -inf, never NaN, however small the temperature. Divided in
    # float64 only where the temperature rounds to 0 in float32 (below about 1e-45; 0 / 0 is NaN):
    # float64 costs 20x the division over a whole vocabulary.
    shifted = logits - logits.amax(-1, keepdim=True)
    if torch.tensor(params.temperature, dtype=torch.float32) > 0:
        logits = shifted / params.temperature
    else:
        logits = (shifted.double() / params.temperature).float()
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p`, renormalized.

    Sought among the k most likely tokens, k = 64, 512, 4096, ... until their mass reaches
    `top_p` in every row: no token past them can be kept then (the mass before it is at least
    theirs), and the first k of a full sort are the same tokens in the same order. A full sort of
    the vocabulary was most of a sampled step's cost on a CPU."""
    vocab = probs.shape[-1]
    k = min(64, vocab)
    while True:
        top, order = probs.topk(k, dim=-1)  # [..., k] descending
        mass = top.cumsum(-1)
        if k == vocab or bool((mass[..., -1] >= top_p).all()):
            break
        k = min(vocab, 8 * k)
    top = top.masked_fill(mass - top >= top_p, 0.0)  # the mass before each token reached top_p
    filtered = torch.zeros_like(probs).scatter(-1, order, top)
    return filtered / filtered.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from `probs` [vocab], on its device (one number comes back)."""
    return int(draw(probs, generator))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`sample`, left on the device: [1] token id, for a caller that reads it with other numbers."""
    return torch.multinomial(probs, 1, generator=on_device(generator, probs.device))


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
    uniform = torch.rand(probs.shape, generator=on_device(generator, probs.device), dtype=torch.float64,
                         device=probs.device)
    # Clamped away from 0 so the noise is finite: a token with mass always outranks one without.
    gumbel = -(-uniform.clamp(min=torch.finfo(torch.float64).tiny).log()).log()  # [vocab]
    has_mass = probs > 0  # [vocab]
    keys = torch.where(has_mass, probs.double().log() + gumbel, float("-inf"))  # [vocab]
    return keys.topk(min(k, int(has_mass.sum()))).indices


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else torch.seed())
    return generator


# Each answer's generator (a host one) and the generators it seeded on other devices.
_companions: weakref.WeakKeyDictionary[torch.Generator, dict[torch.device, torch.Generator]] = (
    weakref.WeakKeyDictionary())


def on_device(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """The generator that draws `generator`'s random numbers for tensors on `device`: itself
    where it lives there; else one generator per device, seeded once from it (a seeded answer is
    then reproducible on a GPU too), so that distributions on a GPU are sampled there instead of
    crossing to the host. Its stream is independent of the host generator's (another algorithm,
    Philox, or another seed per GPU), so draws from the two never correlate."""
    device = torch.device(device)
    if generator is None or generator.device == device or (
            device.type == generator.device.type == "cpu"):
        return generator
    per_device = _companions.setdefault(generator, {})
    if device not in per_device:
        companion = torch.Generator(device)
        companion.manual_seed((generator.initial_seed() + (device.index or 0) + 1) % 2**63)
        per_device[device] = companion
    return per_device[device]
