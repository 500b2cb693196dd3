"""Token-level decoding: prefill, then one target forward per `Step`, for each decoding mode.

A decoder's `step` runs exactly one target forward and commits one or more tokens. Invariant
between steps: the cache holds every committed token but the last, whose logits come next.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Generator, Iterator

import torch

from .interrupt import stop_between_layers
from .kv.cache import KVCache
from .model import CausalLM
from .sampling import sample, warp
from .speculative.drafters import PromptLookupDrafter, QueryBlind
from .speculative.hierarchy import KeptReading, ModelDrafter, RetrievalStage
from .speculative.lookahead import MAX_DRAFT, CostModelLookahead, FixedLookahead, Lookahead
from .speculative.step_times import default_relative
from .speculative.tree import Tree
from .speculative.suffix_drafter import SuffixDrafter
from .speculative.tree_drafters import ModelTreeDrafter, RetrievalTreeDrafter, TreeProposal
from .speculative.types import Decoder, DecodeState, Drafter, Step, StepsOnly, TreeDrafter
from .speculative.verify import verify_chain, verify_tree


class PlainDecoder(StepsOnly):
    drafter_wants_queries = False

    def observe_queries(self, queries: dict[int, torch.Tensor]) -> None:
        pass

    def stage_counts(self) -> dict[str, dict[str, int]]:
        return {}

    def step(self, state: DecodeState, budget: int) -> Step:
        position = state.ids.shape[0] - 1
        logits = state.model.forward(state.ids[-1:], torch.tensor([position]), state.cache)
        token = sample(warp(logits[0], state.params, state.counts()), state.generator)
        state.commit([token])
        return Step([token])


class ChainDecoder(StepsOnly):
    """Speculative decoding on a chain: the drafter proposes, one target forward verifies.

    `lookahead` chooses how many tokens to draft each time (the cost model, or TriForce's fixed
    gamma2); a step with no proposal is a plain step, so drafting that finds nothing costs nothing.
    """

    def __init__(self, drafter: Drafter, lookahead: Lookahead):
        self.drafter = drafter
        self.lookahead = lookahead
        self._plain = PlainDecoder()

    def step(self, state: DecodeState, budget: int) -> Step:
        # The forward yields one token beyond the draft, so draft at most budget - 1.
        most = self.lookahead.most(budget - 1)
        proposal = self.drafter.draft(state, state.ids, most) if most else None
        if proposal is not None:
            proposal = proposal.first(self.lookahead.choose(len(proposal), state.ids.shape[0], proposal.kind))
        observe = self.drafter.wants_queries
        if (proposal is None or len(proposal) == 0) and not observe:
            return self._plain.step(state, budget)
        draft = proposal.tokens if proposal is not None else state.ids[:0]
        start = state.ids.shape[0] - 1
        inputs = torch.cat([state.ids[-1:], draft])
        positions = torch.arange(start, start + inputs.shape[0])
        if observe:
            logits, queries = state.model.forward_with_queries(inputs, positions, state.cache)
        else:
            logits = state.model.forward(inputs, positions, state.cache)
        p = warp(logits, state.params, state.chain_counts(draft))  # each row with its own prefix
        if draft.numel():
            verdict = verify_chain(draft, proposal.q, p, state.generator)
            accepted, next_token = verdict.accepted, verdict.next_token
        else:
            accepted, next_token = 0, sample(p[0], state.generator)
        state.cache.trim(start + 1 + accepted)
        if observe:
            # The queries of the last committed token that ran: the retrieval stage scores with them.
            self.drafter.observe_queries({layer: q[0, :, accepted] for layer, q in queries.items()})
        tokens = draft[:accepted].tolist() + [next_token]
        state.commit(tokens)
        if proposal is not None:
            self.lookahead.observe(len(draft), accepted, proposal.kind)
        last = "plain" if not draft.numel() else "bonus" if accepted == len(draft) else "recovered"
        return Step(tokens, drafted=len(draft), accepted=accepted, depth=len(draft), last=last,
                    verified=inputs.shape[0])

    def stage_counts(self) -> dict[str, dict[str, int]]:
        """Forwards and acceptance of the stages below the target (TriForce), for the stats."""
        return self.drafter.counts()

    @property
    def drafter_wants_queries(self) -> bool:
        return self.drafter.wants_queries

    def observe_queries(self, queries: dict[int, torch.Tensor]) -> None:
        self.drafter.observe_queries(queries)

    def read_prompt(self, ids: torch.Tensor, end: int) -> None:
        self.drafter.read_prompt(ids, end)


class TreeDecoder(StepsOnly):
    """Sequoia: the drafter grows a token tree, one target forward scores every node through a
    tree attention mask, verification walks down it; the cache keeps the accepted path."""

    def __init__(self, drafter: TreeDrafter):
        self.drafter = drafter
        self._plain = PlainDecoder()

    def step(self, state: DecodeState, budget: int) -> Step:
        self.drafter.prepare(state)
        proposal = self.drafter.propose_tree(state, budget)
        observe = self.drafter.wants_queries
        if proposal is None or proposal.tree.size == 1:
            if not observe:
                return self._plain.step(state, budget)
            proposal = TreeProposal(Tree((-1,)), state.ids[-1:], None)  # a plain step, queries recorded
        tree, start = proposal.tree, state.ids.shape[0] - 1
        positions, mask = tree.positions(start), tree.attention_mask(start)
        if observe:
            logits, queries = state.model.forward_with_queries(proposal.tokens, positions, state.cache, mask=mask)
        else:
            logits = state.model.forward(proposal.tokens, positions, state.cache, mask=mask)
        p = warp(logits, state.params, state.tree_counts(proposal.tokens, tree.ancestors))  # each node's own path
        verdict = verify_tree(tree, proposal.tokens, p, proposal.q, state.generator)
        state.cache.keep(torch.cat([torch.arange(start), start + torch.tensor([0] + verdict.path)]))
        if observe:
            last = verdict.path[-1] if verdict.path else 0  # the last committed token that ran
            self.drafter.observe_queries({layer: q[0, :, last] for layer, q in queries.items()})
        self.drafter.accept(verdict.path)
        tokens = proposal.tokens[verdict.path].tolist() + [verdict.next_token]
        state.commit(tokens)
        end = verdict.path[-1] if verdict.path else 0
        last = "plain" if tree.size == 1 else "recovered" if tree.children[end] else "bonus"
        return Step(tokens, drafted=tree.size - 1, accepted=len(verdict.path), depth=tree.depth, last=last,
                    verified=tree.size)

    def stage_counts(self) -> dict[str, dict[str, int]]:
        return self.drafter.counts()

    @property
    def drafter_wants_queries(self) -> bool:
        return self.drafter.wants_queries

    def observe_queries(self, queries: dict[int, torch.Tensor]) -> None:
        self.drafter.observe_queries(queries)


@dataclass(frozen=True)
class TriforceSettings:
    """TriForce's knobs (algorithms.md section 5). `draft`: the first stage, "lookup" (prompt
    lookup), "skipN" (the target's first N layers) or "pair" (the pair's draft model), each but
    lookup over a StreamingLLM cache of `sinks` + `window`; "" for none (the retrieval stage
    drafts by itself)."""
    draft: str = "lookup"
    gamma1: int = 2  # first-stage tokens per retrieval-stage verification
    gamma2: int = 6  # retrieval-stage tokens per full verification
    budget: int = 1024  # retrieval cache positions
    chunk_size: int = 8
    recent: int = 64  # newest positions always in the retrieval cache
    stride: int = 1  # committed tokens between retrieval rebuilds (1: after every full verification)
    sinks: int = 4
    window: int = 256
    tree: Tree | None = None  # the final verification checks this Sequoia tree, grown by the retrieval stage


def triforce_decoder(target: CausalLM, settings: TriforceSettings, pair_draft: CausalLM | None = None, *,
                     prefill_chunk: int, kept: KeptReading | None = None) -> ChainDecoder | TreeDecoder:
    """draft -> target over a retrieval cache -> target over the full cache (the final chain);
    with `settings.tree`, the retrieval stage grows that tree and the full cache verifies it.
    `kept`: the pair draft's reading of the last conversation, which a follow-up continues."""
    if settings.tree is not None:
        return TreeDecoder(RetrievalTreeDrafter(target, settings.tree, settings.budget, settings.chunk_size,
                                                settings.recent))
    return ChainDecoder(triforce_drafter(target, settings, pair_draft, prefill_chunk=prefill_chunk, kept=kept),
                        FixedLookahead(settings.gamma2))


def triforce_drafter(target: CausalLM, settings: TriforceSettings, pair_draft: CausalLM | None = None, *,
                     prefill_chunk: int, kept: KeptReading | None = None) -> Drafter:
    """The hierarchy below the full verification: the first stage, verified by the target over
    a retrieval cache. A draft model reads the prompt `prefill_chunk` tokens per forward."""
    first: Drafter
    if settings.draft == "lookup":
        first = PromptLookupDrafter()
    elif settings.draft.startswith("skip"):
        layers = int(settings.draft[len("skip"):])
        first = ModelDrafter(target.truncated(layers), settings.sinks, settings.window, True, settings.draft,
                             prefill_chunk)
    elif settings.draft == "pair":
        if pair_draft is None:
            raise ValueError("the triforce draft 'pair' needs a pair with a draft model")
        first = ModelDrafter(pair_draft, settings.sinks, settings.window, False, "pair", prefill_chunk, kept)
    elif settings.draft == "":
        first = _NoDraft()
    else:
        raise ValueError(f"unknown triforce draft {settings.draft!r}: lookup, skipN, pair or none")
    return RetrievalStage(first, target, settings.gamma1, settings.budget,
                          settings.chunk_size, settings.recent, settings.stride)


class _NoDraft(QueryBlind):
    """No first stage: the retrieval stage samples its own tokens, one forward each."""

    def draft(self, state, seq, max_tokens):
        return None

    def counts(self):
        return {}


def make_decoder(mode: str, relative_time: Callable[[int, int], float] = default_relative,
                 chain_drafts: int = MAX_DRAFT, tree_draft: tuple[CausalLM, Tree] | None = None,
                 suffix: SuffixDrafter | None = None) -> Decoder:
    """A decoder for one answer in a mode that needs no models but the target's: chain mode
    drafts by prompt lookup as long as the cost model (`relative_time`, t(n) at a context) says
    pays; tree mode grows `tree_draft`'s template with its draft model when one is given, else
    `suffix`'s trees of what followed the longest earlier match (the engine's drafter, kept across
    answers so that a follow-up indexes only its new tokens; default: a fresh one of 16 nodes).
    (TriForce and DSI: `triforce_decoder` here, the engine's DsiRuntime.)

    Which drafter where (bench/2026-11-28-cpu-yardstick.json, tokens per target forward): the
    voting lookup chain beats the suffix chain; the suffix tree beats the lookup tree."""
    if mode == "plain":
        return PlainDecoder()
    if mode == "chain":
        # Unigram matches too: their drafts are rarely accepted, but the cost model keeps them
        # short or drops them, and on hardware where a few more tokens verify for free they pay.
        return ChainDecoder(PromptLookupDrafter(min_ngram=1), CostModelLookahead(relative_time, chain_drafts))
    if mode == "tree" and tree_draft is not None:
        return TreeDecoder(ModelTreeDrafter(*tree_draft))
    if mode == "tree":
        return TreeDecoder(suffix if suffix is not None else SuffixDrafter(max_nodes=16))
    raise ValueError(f"{mode!r} is not a prompt-lookup mode (plain, chain or tree)")


def prefill(model: CausalLM, cache: KVCache, ids: torch.Tensor, chunk_size: int, decoder: Decoder | None = None,
            cancel: threading.Event | None = None) -> Generator[int, None, torch.Tensor]:
    """Run the prompt through the model in chunks, after the prefix `cache` already holds,
    yielding the positions done after each; returns the last position's logits [vocab].

    A `decoder` that scores with queries (TriForce's retrieval stage) gets the last prompt
    token's, so its first step already speculates. Once `cancel` is set, a chunk stops between
    two layers where the cache can be rolled back (interrupt.py), raising `Cancelled` with the
    cache holding the chunks before it; elsewhere the chunk runs to its end."""
    if cache.length >= ids.shape[0]:
        raise ValueError(f"the cache holds {cache.length} positions; the last prompt token must still run")
    observe = decoder is not None and decoder.drafter_wants_queries
    for start in range(cache.length, ids.shape[0], chunk_size):
        end = min(ids.shape[0], start + chunk_size)
        with stop_between_layers(model, cache, cancel):
            if observe and end == ids.shape[0]:  # the last prompt token's queries
                logits, queries = model.forward_with_queries(ids[start:end], torch.arange(start, end), cache,
                                                             last_only=True)
            else:
                logits = model.forward(ids[start:end], torch.arange(start, end), cache, last_only=True)
        if decoder is not None:
            decoder.read_prompt(ids, end)  # a draft model of its own reads beside, as part of the prefill
        yield end
    if observe:
        decoder.observe_queries({layer: q[0, :, -1] for layer, q in queries.items()})
    return logits[-1]


def prefill_all(model: CausalLM, cache: KVCache, ids: torch.Tensor, chunk_size: int,
                decoder: Decoder | None = None) -> torch.Tensor:
    """`prefill` for callers that need no progress: the last position's logits [vocab]."""
    chunks = prefill(model, cache, ids, chunk_size, decoder)
    while True:
        try:
            next(chunks)
        except StopIteration as end:
            return end.value


def decode(state: DecodeState, decoder: Decoder, first_logits: torch.Tensor,
           max_new_tokens: int) -> Iterator[Step]:
    """Steps until `max_new_tokens` are committed; the caller stops earlier on EOS or cancel,
    and closes this generator then (which closes the decoder).

    The first step is the token sampled from the prefill's last logits: the prefill is the
    forward that produced it.
    """
    first = sample(warp(first_logits, state.params, state.counts()), state.generator)
    state.commit([first])
    yield Step([first])
    produced = 1
    try:
        while produced < max_new_tokens:
            step = decoder.step(state, max_new_tokens - produced)
            produced += len(step.tokens)
            yield step
    finally:
        decoder.close()
