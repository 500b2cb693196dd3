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

from .decoding import MODES, DecodeState, decode, make_decoder, prefill
from .errors import InputError
from .model import CausalLM
from .sampling import SamplingParams, make_generator
from .spec.tree import Tree
from .textstream import TextStream

REQUEST_MODES = MODES + ("auto",)
PREFILL_CHUNK = 1024


@dataclass
class Stats:
    target_forwards: int = 0  # target forwards that produced tokens (the prefill counts once)
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    tree_size: int = 0  # most tokens in one verification (draft tokens + 1; a chain is a tree too)
    tree_depth: int = 0  # most draft levels in one verification
    mean_accepted_per_forward: float = 0.0  # tokens committed per target forward; plain = 1
    tokens_per_second: float = 0.0  # new tokens / decode_seconds
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # from the end of prefill to the last token


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


@dataclass(frozen=True)
class Finished:
    result: Result


Event = PrefillProgress | TextDelta | Finished


def resolve_mode(mode: str) -> str:
    """`auto` picks the mode for this machine; until the planner exists that is chain speculation
    with prompt lookup, which falls back to plain steps when nothing matches (measured faster
    than plain on documents on this CPU; see README)."""
    if mode not in REQUEST_MODES:
        raise InputError(f"unknown mode {mode!r}: choose from {', '.join(REQUEST_MODES)}")
    return "chain" if mode == "auto" else mode


class Engine:
    def __init__(self, model: CausalLM, tokenizer, name: str, draft: CausalLM | None = None, draft_name: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.draft, self.draft_name = draft, draft_name  # a pair's separate draft model, if any
        self.stop_ids = _stop_ids(tokenizer, model)
        self.tree_draft: tuple[CausalLM, Tree] | None = None  # tree mode's draft model and shape
        self._lock = threading.Lock()  # one generation at a time per loaded model

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
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """Stream events for one answer. Raises `InputError` before any work for a bad request."""
        mode = resolve_mode(mode)
        max_new_tokens = self._check_request(prompt_ids, max_new_tokens)
        with self._lock:
            yield from self._generate(prompt_ids, max_new_tokens, sampling, mode, cancel)

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

    def _generate(self, prompt_ids, max_new_tokens, sampling, mode, cancel) -> Iterator[Event]:
        cancel = cancel or threading.Event()
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        state = DecodeState(self.model, self.model.new_cache(), ids, sampling, make_generator(sampling.seed))
        decoder = make_decoder(mode, self.model.vocab_size, self.tree_draft)
        stats = Stats()

        started = time.perf_counter()
        chunks = prefill(self.model, state.cache, ids, PREFILL_CHUNK)
        while True:
            try:
                done = next(chunks)
            except StopIteration as end:
                first_logits = end.value
                break
            yield PrefillProgress(done, len(prompt_ids))
            if cancel.is_set():
                yield Finished(Result("", [], len(prompt_ids), 0, mode, "cancelled", Stats()))
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
            yield TextDelta(stream.add(tokens), tokens, replace(stats))
            if finish_reason == "stop":
                break
            if cancel.is_set():
                finish_reason = "cancelled"
                break
        tail = stream.finish()
        if tail:
            yield TextDelta(tail, [], replace(stats))
        result = Result(stream.text, new_ids, len(prompt_ids), len(new_ids), mode, finish_reason, stats)
        yield Finished(result)


def _update_rates(stats: Stats, committed: int, new_tokens: int, decode_seconds: float) -> None:
    stats.decode_seconds = decode_seconds
    stats.mean_accepted_per_forward = committed / stats.target_forwards
    stats.tokens_per_second = new_tokens / decode_seconds if decode_seconds > 0 else 0.0


def _stop_ids(tokenizer, model: CausalLM) -> set[int]:
    """End-of-turn tokens: the tokenizer's EOS and any the model's generation config adds."""
    ids = set(getattr(model, "eos_token_ids", ()))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
