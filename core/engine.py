"""The engine: a loaded model, a chat template, and `generate` as a stream of events.

Layers (as in mlx-lm): `decoding` yields token steps; this file turns them into text deltas with
live statistics and a final result. Callers consume events and never touch models or caches.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator

import torch

from .decoding import MODES, DecodeState, TriforceSettings, decode, make_decoder, prefill, triforce_decoder
from .errors import InputError, SpecchatError
from .kv.document_store import DocumentStore
from .kv.full import FullCache
from .kv.prefix_store import PrefixStore
from .model import CausalLM
from .sampling import SamplingParams, make_generator
from .spec.tree import Tree
from .textstream import TextStream

REQUEST_MODES = MODES + ("auto",)
PREFILL_CHUNK = 1024


def default_prefix_budget() -> int:
    """Memory for the KV of recent answers: a quarter of the RAM, at most 8 GB (until the
    planner sets it per machine)."""
    import psutil

    return min(8 * 10**9, psutil.virtual_memory().total // 4)


@dataclass
class Stats:
    target_forwards: int = 0  # target forwards that produced tokens (the prefill counts once)
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    tree_size: int = 0  # most tokens in one verification (draft tokens + 1; a chain is a tree too)
    tree_depth: int = 0  # most draft levels in one verification
    mean_accepted_per_forward: float = 0.0  # tokens committed per target forward; plain = 1
    tokens_per_second: float = 0.0  # new tokens / decode_seconds
    prefill_seconds: float = 0.0  # from the request to the first token's logits, cache lookup included
    decode_seconds: float = 0.0  # from the end of prefill to the last token
    reused_prompt_tokens: int = 0  # prompt tokens whose KV came from an earlier turn or a saved document
    reused_from: str = ""  # "memory" (an earlier answer), "disk" (a saved document cache) or ""
    # TriForce: per stage below the target, its forwards, draft tokens verified, accepted, builds.
    stages: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    new_tokens: int
    mode: str
    finish_reason: str  # "stop" (end of turn), "length", or "cancelled"
    stats: Stats = field(default_factory=Stats)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PrefillProgress:
    done: int
    total: int


@dataclass(frozen=True)
class TextDelta:
    text: str
    token_ids: list[int]
    stats: Stats
    # (text, origin) for each of `token_ids`, origin "draft" (an accepted draft token),
    # "recovered", "bonus" or "plain" (see `decoding.Step`); text held back for an incomplete
    # character goes to the token that completes it. The final flush has text but no tokens.
    pieces: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Finished:
    result: Result


@dataclass(frozen=True)
class Notice:
    """Something the user should know that does not stop the answer (a bad saved cache, say)."""
    text: str


Event = PrefillProgress | TextDelta | Finished | Notice


def resolve_mode(mode: str, auto: str = "chain") -> str:
    """`auto` is the mode the plan chose for this machine (`Engine.auto_mode`); without a plan
    (a local model directory) it is chain speculation with prompt lookup, which falls back to
    plain steps when nothing matches."""
    if mode not in REQUEST_MODES:
        raise InputError(f"unknown mode {mode!r}: choose from {', '.join(REQUEST_MODES)}")
    return auto if mode == "auto" else mode


class Engine:
    def __init__(self, model: CausalLM, tokenizer, name: str, prefixes: PrefixStore | None = None,
                 documents: DocumentStore | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.draft: CausalLM | None = None  # a pair's separate draft model, if any
        self.draft_name = ""
        self.prefixes = prefixes if prefixes is not None else PrefixStore(default_prefix_budget())  # recent answers
        self.documents = documents  # saved document caches on disk (None: off)
        self.stop_ids = _stop_ids(tokenizer, model)
        self.tree_draft: tuple[CausalLM, Tree] | None = None  # tree mode's draft model and shape
        self.triforce = TriforceSettings()  # triforce mode's stages and budgets
        self.plan = None  # core.plan.Plan for this machine, when the model is a registry pair
        self.auto_mode = "chain"  # what `auto` means here: the plan's mode
        # One step at a time (a prefill chunk, a decoding step, the prefix store's bookkeeping):
        # two answers driven from two threads interleave step by step, each on its own cache and
        # decoder. The app runs every answer on one engine thread (app/engine_queue.py) anyway.
        self._lock = threading.Lock()

    @property
    def context_length(self) -> int:
        return self.model.context_length

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation ([{"role", "content"}]) ready for the assistant's turn."""
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return list(ids)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, prompt_ids: list[int], max_new_tokens: int = 256,
                 sampling: SamplingParams = SamplingParams(), mode: str = "auto",
                 cancel: threading.Event | None = None, document_tokens: int = 0) -> Iterator[Event]:
        """Stream events for one answer. Raises `InputError` before any work for a bad request.

        `document_tokens`: the prompt's first tokens hold a document whose KV should be saved to
        disk for later runs (needs a document store).
        """
        mode = resolve_mode(mode, self.auto_mode)
        max_new_tokens = self._check_request(prompt_ids, max_new_tokens)
        events = self._generate(prompt_ids, max_new_tokens, sampling, mode, cancel, document_tokens)
        # The lock is held while the engine computes, never across a yield: a caller that stops
        # listening without closing this generator cannot keep the engine from others.
        try:
            while True:
                with self._lock:
                    try:
                        event = next(events)
                    except StopIteration:
                        return
                yield event
        finally:
            with self._lock:
                events.close()  # the answer's KV is kept for the next turn now, not when collected

    def _check_request(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        if not prompt_ids:
            raise InputError("the prompt is empty: type a question or give a prompt file")
        if max_new_tokens < 1:
            raise InputError(f"max new tokens must be at least 1, got {max_new_tokens}")
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise InputError(
                f"the prompt is {len(prompt_ids)} tokens but {self.name} reads at most "
                f"{self.context_length}: shorten the document or question by at least "
                f"{1 - room} tokens")
        return min(max_new_tokens, room)

    def _generate(self, prompt_ids, max_new_tokens, sampling, mode, cancel, document_tokens) -> Iterator[Event]:
        """One answer on a cache that starts from the longest reusable prefix; afterwards the
        cache is kept for the next turn (also when the answer was stopped: at every event the
        cache is consistent), and the document prefix is saved to disk when asked."""
        started = time.perf_counter()
        cache, reused, source = self._reusable_cache(prompt_ids)
        if self.documents is not None:
            for problem in self.documents.take_problems():
                yield Notice(problem)
        state = DecodeState(self.model, cache, torch.tensor(prompt_ids, dtype=torch.long), sampling,
                            make_generator(sampling.seed))
        finished, answering = False, False
        try:
            for event in self._run(state, max_new_tokens, mode, cancel or threading.Event(), started, reused, source):
                answering = answering or isinstance(event, TextDelta)
                yield event
            finished = True
        except GeneratorExit:
            finished = True  # the caller stopped listening between two events
            raise
        except torch.OutOfMemoryError:
            pass  # handled below, once this frame no longer holds the traceback's tensors
        finally:
            if finished:
                if document_tokens and self.documents is not None and state.cache.length >= document_tokens:
                    self.documents.save_once(prompt_ids[:document_tokens], state.cache)
                self.prefixes.put(state.ids[:state.cache.length].tolist(), state.cache)
        if not finished:  # out of memory: this answer's KV goes, never kept for reuse
            del state, cache
            _free_accelerator_memory()
            doing = "writing the answer" if answering else "reading the prompt"
            raise SpecchatError(f"the GPU ran out of memory while {doing}: try a shorter "
                                f"{'answer' if answering else 'document'} or a smaller pair")

    def _reusable_cache(self, prompt_ids: list[int]) -> tuple[FullCache, int, str]:
        """A cache already holding the longest available prefix of the prompt: from a recent
        answer in memory, or a saved document on disk when that is longer."""
        in_memory = self.prefixes.best_length(prompt_ids)
        if self.documents is not None and in_memory < len(prompt_ids) - 1:  # the disk could offer more
            loaded = self.documents.load(prompt_ids, self.model.new_cache(), at_least=in_memory)
            if loaded is not None:
                return loaded.cache, loaded.length, "disk"
        taken = self.prefixes.take(prompt_ids)
        if taken is not None:
            return taken[0], taken[1], "memory"
        return self.model.new_cache(), 0, ""

    def _run(self, state: DecodeState, max_new_tokens: int, mode: str, cancel: threading.Event,
             started: float, reused: int, source: str) -> Iterator[Event]:
        prompt_length = state.ids.shape[0]
        decoder = make_decoder(mode, self.model.vocab_size, self.tree_draft,
                               lambda: triforce_decoder(self.model, self.triforce, self.draft))
        stage_counts = getattr(decoder, "stage_counts", None)
        stats = Stats(reused_prompt_tokens=reused, reused_from=source)
        chunks = prefill(self.model, state.cache, state.ids, PREFILL_CHUNK, decoder)
        while True:
            try:
                done = next(chunks)
            except StopIteration as end:
                first_logits = end.value
                break
            yield PrefillProgress(done, prompt_length)
            if cancel.is_set():
                yield Finished(Result("", [], prompt_length, 0, mode, "cancelled", stats))
                return
        decode_started = time.perf_counter()
        stats.prefill_seconds = decode_started - started

        stream = TextStream(self.tokenizer)
        new_ids: list[int] = []
        committed = 0  # tokens the target committed, the end-of-turn token included
        finish_reason = "length"
        for step in decode(state, decoder, first_logits, max_new_tokens):
            tokens = step.tokens
            stop_at = next((i for i, t in enumerate(tokens) if t in self.stop_ids), None)
            if stop_at is not None:
                tokens = tokens[:stop_at]
                finish_reason = "stop"
            new_ids.extend(tokens)
            committed += len(tokens) + (stop_at is not None)  # what counts ends at the end of turn
            stats.target_forwards += 1
            stats.drafted_tokens += step.drafted
            stats.accepted_draft_tokens += step.accepted
            if step.drafted:
                stats.tree_size = max(stats.tree_size, step.drafted + 1)
                stats.tree_depth = max(stats.tree_depth, step.depth)
            _update_rates(stats, committed, len(new_ids), time.perf_counter() - decode_started)
            if stage_counts is not None:
                stats.stages = stage_counts()
            pieces = tuple((stream.add([token]), origin) for token, origin in zip(tokens, step.origins()))
            yield TextDelta("".join(text for text, _ in pieces), tokens, replace(stats), pieces)
            if finish_reason == "stop":
                break
            if cancel.is_set():
                finish_reason = "cancelled"
                break
        tail = stream.finish()
        if tail:
            yield TextDelta(tail, [], replace(stats), ((tail, "plain"),))
        result = Result(stream.text, new_ids, prompt_length, len(new_ids), mode, finish_reason, stats)
        yield Finished(result)


def _update_rates(stats: Stats, committed: int, new_tokens: int, decode_seconds: float) -> None:
    stats.decode_seconds = decode_seconds
    stats.mean_accepted_per_forward = committed / stats.target_forwards
    stats.tokens_per_second = new_tokens / decode_seconds if decode_seconds > 0 else 0.0


def _free_accelerator_memory() -> None:
    """Give the memory of a failed answer back to the GPU, so the next request has it."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _stop_ids(tokenizer, model: CausalLM) -> set[int]:
    """End-of-turn tokens: the tokenizer's EOS and any the model's generation config adds."""
    ids = set(getattr(model, "eos_token_ids", ()))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
