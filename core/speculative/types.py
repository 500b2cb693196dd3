"""The decode step's types and the interfaces every decoding mode is built from: a `Decoder` runs
one target forward per `step` and commits what it verified; a `Drafter` proposes a chain, a
`TreeDrafter` a token tree. The decoders (core/decoding.py) and the DSI orchestrator build on
these, so nothing below the engine needs core.decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..kv.cache import KVCache
from ..model import CausalLM
from ..sampling import SamplingParams, chain_counts, path_counts, token_counts

if TYPE_CHECKING:
    from .drafters import Proposal
    from .tree_drafters import TreeProposal


@dataclass(frozen=True)
class Step:
    """What one target forward committed."""
    tokens: list[int]  # accepted draft tokens, then the recovered or bonus (or plain) token
    drafted: int = 0  # draft tokens this forward verified
    accepted: int = 0  # of which accepted
    depth: int = 0  # draft levels verified (a chain of g tokens: g)
    verified: int = 1  # tokens the target forward ran (drafted + 1, or 1 for a plain step)
    last: str = "plain"  # how the last token came: "plain" (nothing drafted), "recovered" (sampled
    #                      after a rejection) or "bonus" (after every draft level was accepted)

    def origins(self) -> list[str]:
        """Each token's origin, for the app's coloring: accepted drafts, then the last token."""
        return ["draft"] * self.accepted + [self.last]


@dataclass
class DecodeState:
    """One answer's state: the target, its full cache, the text so far and how to sample. Unlike a
    `TokenCache` (token_cache.py), `ids` runs one token past the cache: the last committed token
    is read by the next step's forward.

    The repetition penalties count the answer's tokens (`ids` from `answer_start`): `counts` and
    its chain and tree forms give each scored position the counts of its own prefix, or None when
    the sampling has no penalties (then nothing is counted)."""

    model: CausalLM
    cache: KVCache
    ids: torch.Tensor  # [L] prompt and committed tokens
    params: SamplingParams
    generator: torch.Generator
    answer_start: int = -1  # where the answer starts in `ids`; -1: after the ids given (the prompt)

    def __post_init__(self):
        if self.answer_start < 0:
            self.answer_start = self.ids.shape[0]

    def commit(self, tokens: list[int]) -> None:
        self.ids = torch.cat([self.ids, torch.tensor(tokens, dtype=self.ids.dtype)])

    def counts(self, seq: torch.Tensor | None = None) -> torch.Tensor | None:
        """[vocab] the answer's token counts in `seq` (default: the committed text), for the
        position after it."""
        if not self.params.penalized:
            return None
        seq = self.ids if seq is None else seq
        return token_counts(seq[self.answer_start:], self.model.vocab_size, self.model.device)  # where the logits are

    def chain_counts(self, draft: torch.Tensor, seq: torch.Tensor | None = None) -> torch.Tensor | None:
        """[g + 1, vocab] for the positions after `seq` (default: the committed text) and after
        each of the draft tokens [g] that follow it."""
        base = self.counts(seq)
        return None if base is None else chain_counts(base, draft)

    def tree_counts(self, tokens: torch.Tensor, on_path: torch.Tensor) -> torch.Tensor | None:
        """[m, vocab] for nodes of a token tree rooted at the last committed token (tokens [n];
        on_path [m, n], rows of `Tree.ancestors`)."""
        base = self.counts()
        return None if base is None else path_counts(base, tokens, on_path)


class Decoder(Protocol):
    drafter_wants_queries: bool  # its drafter scores with the target's queries (see `prefill`)

    def step(self, state: DecodeState, budget: int) -> Step:
        """One target forward; commits at most `budget` tokens' worth of work (>= 1)."""
        ...

    def observe_queries(self, queries: dict[int, torch.Tensor]) -> None:
        """The last prompt token's queries, from the prefill."""
        ...

    def stage_counts(self) -> dict[str, dict[str, int]]:
        """Forwards and acceptance of the stages below the target (TriForce), for the stats."""
        ...

    def begin(self, state: DecodeState) -> None:
        """Before the prefill: start what can run beside it (DSI's instances read the prompt)."""
        ...

    def read_prompt(self, ids: torch.Tensor, end: int) -> None:
        """The target has read the prompt `ids` up to `end`: a draft model with a cache of its
        own reads as far, so its read counts (and stops) as the prefill's."""
        ...

    def close(self) -> None:
        """After the answer: release what runs beside the steps (DSI's drafting thread)."""
        ...


class StepsOnly:
    """A decoder whose work all happens inside `step`: nothing to start early or release."""

    def begin(self, state: DecodeState) -> None:
        pass

    def read_prompt(self, ids: torch.Tensor, end: int) -> None:
        pass

    def close(self) -> None:
        pass


class Drafter(Protocol):
    wants_queries: bool  # scores with the full verification's queries (TriForce's retrieval stage)

    def observe_queries(self, queries: dict[int, torch.Tensor]) -> None:
        """The full verification's queries of the last committed token it ran, per layer."""
        ...

    def draft(self, state: DecodeState, seq: torch.Tensor, max_tokens: int) -> Proposal | None:
        """Up to `max_tokens` draft tokens continuing `seq` (the committed text, then any tokens
        of stages above), or None. `state` holds the committed text, sampling and generator."""
        ...

    def counts(self) -> dict[str, dict[str, int]]:
        """Per stage: forwards run, draft tokens verified, accepted (for the stats)."""
        ...

    def read_prompt(self, ids: torch.Tensor, end: int) -> None:
        """As `Decoder.read_prompt`: nothing for a drafter without a model of its own."""
        ...


class TreeDrafter(Protocol):
    wants_queries: bool  # scores with the verification's queries (TriForce's retrieval stage)

    def observe_queries(self, queries: dict[int, torch.Tensor]) -> None: ...

    def prepare(self, state: DecodeState) -> None:
        """Before each proposal: bring the drafter's own state up to the committed text."""
        ...

    def propose_tree(self, state: DecodeState, budget: int) -> TreeProposal | None:
        """A tree rooted at the committed text's last token, sampled with `state`'s params and
        generator (the penalties' counts from its answer)."""
        ...

    def accept(self, path: list[int]) -> None: ...

    def counts(self) -> dict[str, dict[str, int]]: ...
