"""TriForce's hierarchy as a composition of stages (algorithms.md section 5; seed 004).

A drafter proposes draft tokens with the distributions Q they were drawn from. A `VerifiedStage`
is a model with a cache of its own that verifies a drafter's tokens by speculative sampling
(`verify_chain`: accept with min(1, P/Q), else a recovered token from the residual; TriForce's
reference samples P there, which is not lossless) until it holds enough tokens, and is itself a
drafter for the next stage: every token it emits is distributed exactly as its own P, so P is
the Q it hands on. The last stage is the target with the full cache (`ChainDecoder`), so the
text is distributed exactly as the target's, whatever the stages below it do.

    small draft (StreamingLLM cache) -> target (retrieval cache) -> target (full cache)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kv.retrieval import RetrievalCache
from ..kv.streaming import StreamingCache
from ..model import CausalLM
from ..sampling import sample, warp
from .drafters import Proposal, QueryBlind
from .token_cache import TokenCache, common_prefix
from .verify import verify_chain

if TYPE_CHECKING:
    from .types import DecodeState, Drafter



class KeptReading:
    """A separate draft model's reading of the conversation answered last, kept for the next
    answer: a follow-up's prompt extends it, so the draft reads only the new tokens (its cache is
    sinks and a window, small whatever the document's length)."""

    def __init__(self):
        self.follower: TokenCache | None = None


class ModelDrafter(QueryBlind):
    """A draft model sampling one token per forward from its warped distribution, over a
    StreamingLLM cache (sinks and a recent window).

    `shares_target_kv`: the draft is the target's first layers (layer-skip), whose KV over the
    committed text is the target's own, so its cache starts as a streaming view of the target's
    full cache; otherwise the draft reads the prompt itself, in chunks beside the target's
    prefill (`read_prompt`), compacting as it goes, into `kept`'s cache when one is given.
    """

    def __init__(self, model: CausalLM, sinks: int, window: int, shares_target_kv: bool, name: str,
                 prefill_chunk: int, kept: KeptReading | None = None):
        self.model = model
        self.prefill_chunk = prefill_chunk  # a separate draft reads the prompt in chunks this long
        self.sinks, self.window = sinks, window
        self.shares_target_kv = shares_target_kv
        self.name = name
        self.kept = kept if kept is not None else KeptReading()
        self.follower: TokenCache | None = None
        self._forwards_before = 0  # the kept cache's forwards in earlier answers
        self._prompt_read = False

    def read_prompt(self, ids: torch.Tensor, end: int) -> None:
        """Read `ids` up to `end` (never the last prompt token, whose logits the first draft
        needs), from the longest prefix the cache still holds, a chunk per forward."""
        if self.shares_target_kv:
            return  # its cache is a view of the target's, taken at the first draft
        if self.follower is None:
            if self.kept.follower is None:
                self.kept.follower = TokenCache(self.model, StreamingCache(self.model.config, self.sinks, self.window))
            self.follower = self.kept.follower
            self._forwards_before = self.follower.forwards
        upto = min(end, ids.shape[0] - 1)
        follower = self.follower
        follower.cache.trim(common_prefix(follower.ids, ids[:-1]))  # it may have read further than `end`
        follower.ids = ids[:follower.cache.length]
        chunk_ends = range(follower.cache.length + self.prefill_chunk, upto + self.prefill_chunk, self.prefill_chunk)
        try:
            for chunk_end in chunk_ends:
                follower.read(ids[:min(chunk_end, upto)])
                follower.cache.compact()
        except BaseException:
            self.kept.follower = None  # a forward that failed may have filled some layers: never keep that
            raise
        self._prompt_read = upto == ids.shape[0] - 1
        if self._prompt_read and chunk_ends:
            follower.cache = follower.cache.fitted()  # kept between answers at the plan's size

    def draft(self, state: DecodeState, seq: torch.Tensor, max_tokens: int) -> Proposal | None:
        if max_tokens < 1:
            return None
        if self.follower is None or not self._prompt_read:
            self._start(state)
        tokens: list[int] = []
        rows = []
        for _ in range(max_tokens):
            current = torch.cat([seq, torch.tensor(tokens, dtype=torch.long)])
            logits = self.follower.logits(current, 1)[-1]
            if not tokens:
                self.follower.cache.compact()  # between drafts only: rollback stays within the window
            rows.append(warp(logits, state.params, state.counts(current)))
            tokens.append(sample(rows[-1], state.generator))
        return Proposal(torch.tensor(tokens), torch.stack(rows))

    def counts(self) -> dict[str, dict[str, int]]:
        return {self.name: {"forwards": self.follower.forwards - self._forwards_before if self.follower else 0}}

    def _start(self, state: DecodeState) -> None:
        if not self.shares_target_kv:
            self.read_prompt(state.ids, state.ids.shape[0])  # the rest of what the prefill did not read
            return
        cache = StreamingCache.from_cache(self.model.config, state.cache, self.sinks, self.window, self.model.device,
                                          count=self.model.num_layers)
        self.follower = TokenCache(self.model, cache, state.ids[:state.cache.length])
        self._prompt_read = True


class VerifiedStage(QueryBlind):
    """A model over its own cache verifies `drafter`'s tokens, `gamma` at a time, and hands on
    what it accepted and recovered, with its own P as their distributions."""

    def __init__(self, drafter: Drafter, follower: TokenCache, gamma: int, name: str):
        if gamma < 1:
            raise ValueError(f"gamma must be at least 1, got {gamma}")
        self.drafter = drafter
        self.follower = follower
        self.gamma = gamma
        self.name = name
        self.drafted = self.accepted = 0

    def draft(self, state: DecodeState, seq: torch.Tensor, max_tokens: int) -> Proposal | None:
        if max_tokens < 1 or not self.prepare(state, seq):
            return None
        tokens: list[int] = []
        rows = []
        while len(tokens) < max_tokens:
            current = torch.cat([seq, torch.tensor(tokens, dtype=torch.long)])
            # This stage's forward yields one token beyond the draft: draft at most remaining - 1.
            proposal = self.drafter.draft(state, current, min(self.gamma, max_tokens - len(tokens) - 1))
            draft_tokens = proposal.tokens if proposal is not None else current[:0]
            # [g + 1, vocab], each row penalized for its own prefix: the Q the next stage checks
            p = warp(self.follower.logits(torch.cat([current, draft_tokens]), draft_tokens.shape[0] + 1),
                     state.params, state.chain_counts(draft_tokens, current))
            if proposal is None or len(proposal) == 0:
                tokens.append(sample(p[0], state.generator))
                rows.append(p[:1])
                continue
            verdict = verify_chain(proposal.tokens, proposal.q, p, state.generator)
            tokens += proposal.tokens[:verdict.accepted].tolist() + [verdict.next_token]
            rows.append(p[:verdict.accepted + 1])
            self.drafted += len(proposal)
            self.accepted += verdict.accepted
        return Proposal(torch.tensor(tokens), torch.cat(rows))

    def read_prompt(self, ids: torch.Tensor, end: int) -> None:
        self.drafter.read_prompt(ids, end)

    def prepare(self, state: DecodeState, seq: torch.Tensor) -> bool:
        """Called before each proposal; the retrieval stage refreshes its cache here. False: this
        stage cannot draft after `seq` now (no proposal)."""
        return True

    def counts(self) -> dict[str, dict[str, int]]:
        own = {self.name: {"forwards": self.follower.forwards, "drafted": self.drafted, "accepted": self.accepted}}
        return {**self.drafter.counts(), **own}


class RetrievalStage(VerifiedStage):
    """The target over a retrieval cache of `budget` positions of its full cache.

    The cache is rebuilt from the full cache when `stride` tokens have been committed since the
    last build, and sooner when fewer than `min_acceptance` of this stage's recent tokens survive
    the full verification. It scores with the queries the full verification just computed
    (`observe_queries`), so a rebuild costs no forward; the first build uses the last prompt
    token's, recorded during the prefill (without them the first step is a plain one). Between
    builds the tokens it verifies are appended after the retrieved slots.
    """

    def __init__(self, drafter: Drafter, model: CausalLM, gamma: int, budget: int, chunk_size: int,
                 recent: int, stride: int, min_acceptance: float = 0.5, name: str = "retrieval"):
        super().__init__(drafter, TokenCache(model, None), gamma, name)
        self.budget, self.chunk_size, self.recent = budget, chunk_size, recent
        self.stride, self.min_acceptance = stride, min_acceptance
        self.builds = 0
        self._queries: dict[int, torch.Tensor] | None = None  # per layer [heads, head_dim]
        self._survival = 1.0  # moving average of the share of its tokens the full stage accepted
        self._offered: tuple[int, torch.Tensor] | None = None  # (committed length, tokens handed on)

    wants_queries = True

    def observe_queries(self, queries: dict[int, torch.Tensor]) -> None:
        self._queries = queries

    def draft(self, state: DecodeState, seq: torch.Tensor, max_tokens: int) -> Proposal | None:
        if self._queries is None:
            return None
        proposal = super().draft(state, seq, max_tokens)
        if proposal is not None:
            self._offered = (seq.shape[0], proposal.tokens)
        return proposal

    def prepare(self, state: DecodeState, seq: torch.Tensor) -> bool:
        self._track_survival(seq)
        cache = self.follower.cache
        committed = seq.shape[0] - 1  # the full cache holds all committed tokens but the last
        full = state.cache
        # DSI drafts from its own thread while plain steps extend the full cache: a cache built
        # past the text drafted from cannot roll back to it (nor can one be built from there), so
        # this stage drafts nothing until the text catches up.
        if (cache is None or committed - cache.base_length >= self.stride or committed < cache.base_length
                or self._survival < self.min_acceptance) and full.length <= committed:
            self.follower.cache = RetrievalCache.from_full(full, self._queries, self.budget, self.chunk_size,
                                                           self.recent, self.follower.model.device, cache)
            self.follower.ids = seq[:full.length]
            self.builds += 1
            self._survival = 1.0
        return self.follower.cache is not None and self.follower.cache.base_length <= committed

    def counts(self) -> dict[str, dict[str, int]]:
        counts = super().counts()
        counts[self.name]["builds"] = self.builds
        return counts

    def _track_survival(self, seq: torch.Tensor) -> None:
        if self._offered is None:
            return
        start, offered = self._offered
        survived = common_prefix(seq[start:], offered)
        self._survival = 0.7 * self._survival + 0.3 * survived / offered.shape[0]
        self._offered = None
