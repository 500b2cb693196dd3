"""The engine: a loaded model, a chat template, and `generate` as a stream of events.

Layers (as in mlx-lm): `decoding` yields token steps; this file turns them into text deltas with
live statistics and a final result. Callers consume events and never touch models or caches.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Generator, Iterator

import torch

from .chat_text import inert_control_tokens
from .decoding import TriforceSettings, decode, make_decoder, prefill, triforce_decoder
from .errors import InputError, SpecchatError
from .interrupt import Cancelled
from .kv.conversation_slot import ConversationSlot
from .memory_release import release_gpu_memory
from .kv.document_store import DocumentStore
from .kv.full import FullCache
from .kv.prefix_store import PrefixStore
from .model import CausalLM
from .prediction import AnswerPrediction
from .repeats import RepeatGuard
from .request import ModeOptions, Request
from .runtime import EngineSettings
from .sampling import make_generator
from .speculative.dsi.runtime import DsiRuntime
from .speculative.hierarchy import KeptReading
from .speculative.suffix_drafter import AnswerHistory, SuffixDrafter
from .speculative.step_times import StepTimes, default_relative
from .speculative.types import DecodeState, Decoder
from .textstream import TextStream


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
    # The cost model's tok/s for the steps this answer took (measured t(n) at each step's context,
    # with the stages' forwards); None without a calibration of this model on this machine.
    predicted_tokens_per_second: float | None = None
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
    finish_reason: str  # "stop" (end of turn), "length", "cancelled" or "repeating" (the repeat guard)
    stats: Stats = field(default_factory=Stats)
    # "length" because no room was left in the model's context, not (only) the answer limit.
    context_full: bool = False

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


class Engine:
    """Built once from its settings (runtime.py) and never reconfigured but for step times that
    an idle calibration measures after the build (`use_step_times`): per-answer choices are a
    `Request` to `generate`."""

    def __init__(self, model: CausalLM, tokenizer, name: str,
                 prefixes: PrefixStore | ConversationSlot | None = None, documents: DocumentStore | None = None,
                 settings: EngineSettings = EngineSettings(), draft: CausalLM | None = None, draft_name: str = "",
                 plan=None, calibration_key: str = "", target_loader: Callable[[str], CausalLM] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.settings = settings
        self.draft = draft  # a pair's separate draft model, if any
        self.draft_name = draft_name
        # An offloaded KV (pinned host memory) is held once, never copied per prefix: however the
        # engine was built (runtime.py plans keep_prefixes=False for one). Saved documents are
        # read into that one cache (`_empty_cache`).
        if not settings.keep_prefixes or getattr(model, "offload_capacity", None) is not None:
            prefixes = ConversationSlot()
        self.prefixes = prefixes if prefixes is not None else PrefixStore(default_prefix_budget())  # recent answers
        self.documents = documents  # saved document caches on disk (None: off)
        self.answers = AnswerHistory()  # recent answers' tokens, where the tree mode's drafter also looks
        self._draft_reading = KeptReading()  # the pair draft's reading of the last conversation (TriForce)
        # Tree mode's suffix drafter, kept across answers: a follow-up indexes only its new tokens
        # (indexing a 128K prompt anew took about a second).
        self._suffix = SuffixDrafter(self.answers, max_nodes=settings.tree_size)
        self.stop_ids = _stop_ids(tokenizer, model)
        self.plan = plan  # core.planning.Plan for this machine, when the model is a registry pair
        self.calibration_key = calibration_key  # its step times' name in the machine's profile ("": none)
        self.idle_calibration = None  # the app's first-use calibration, run between answers (step_calibration.py)
        # One step at a time (a prefill chunk, a decoding step, the prefix store's bookkeeping):
        # two answers driven from two threads interleave step by step, each on its own cache and
        # decoder. The app runs every answer on one engine thread (app/engine_queue.py) anyway.
        self._lock = threading.Lock()
        # DSI's target instances, each a copy of the target that `target_loader` builds on a device.
        self.dsi = DsiRuntime(model, target_loader, name, settings.prefill_chunk, draft, settings.dsi_devices,
                              (settings.triforce.sinks, settings.triforce.window), settings.dsi_lookahead)
        # What builds each mode's decoder for one answer, from the request's options for that mode.
        self._decoders: dict[str, Callable[[ModeOptions | None], Decoder]] = {
            "plain": self._lookup_decoder("plain"), "chain": self._lookup_decoder("chain"),
            "tree": self._lookup_decoder("tree"), "triforce": self._triforce_decoder, "dsi": self._dsi_decoder}

    def use_step_times(self, times: StepTimes | None) -> None:
        """Answer by `times` from the next answer on (an idle calibration has ended); called on
        the thread that runs the answers."""
        self.settings = replace(self.settings, step_times=times)

    @property
    def auto_mode(self) -> str:
        """What `auto` means here: the plan's mode."""
        return self.settings.auto_mode

    @property
    def context_length(self) -> int:
        """The most tokens a prompt and its answer take: the model's, or less where the plan was
        made for less (the memory is sized for the plan's)."""
        return min(self.model.context_length, self.plan.context) if self.plan is not None else self.model.context_length

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation ([{"role", "content"}]) ready for the assistant's turn; a
        control token written in a message stays text (`chat_text`)."""
        encoded = self.tokenizer.apply_chat_template(inert_control_tokens(messages, self.tokenizer),
                                                     add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return list(ids)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def resolve_mode(self, mode: str) -> str:
        """The mode a request's `mode` runs in here: `auto` is the plan's."""
        return self.auto_mode if mode == "auto" else mode

    def generate(self, prompt_ids: list[int], request: Request = Request(),
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """Stream events for one answer; `cancel` set stops it at the next step (or between two
        layers of the prefill). Raises `InputError` before any work for a prompt that does not fit."""
        mode = self.resolve_mode(request.mode)
        options = request.options_for(mode)
        max_new_tokens = self._check_request(prompt_ids, request.max_new_tokens)
        decoder = self._decoders[mode](options)
        triforce = options if isinstance(options, TriforceSettings) else self.settings.triforce
        # DSI's instances run in parallel: t(n) of one forward after another does not price it.
        times = None if decoder is self.dsi.answering else self.settings.step_times
        events = self._generate(prompt_ids, max_new_tokens, request.sampling, mode, decoder,
                                AnswerPrediction(times, self.model, triforce), cancel, request.document_tokens,
                                request.conversation)
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
                self.dsi.release(decoder)

    def forget(self, conversation: str) -> None:
        """Free the KV kept in memory for `conversation` (deleted): not left to the budget's eviction."""
        with self._lock:
            self.prefixes.drop(conversation)

    def _check_request(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        if not prompt_ids:
            raise InputError("the prompt is empty: type a question or give a prompt file")
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise InputError(
                f"the prompt is {len(prompt_ids)} tokens but {self.name} reads at most "
                f"{self.context_length}: shorten the document or question by at least "
                f"{1 - room} tokens")
        return min(max_new_tokens, room)

    def _lookup_decoder(self, mode: str) -> Callable[[ModeOptions | None], Decoder]:
        """Plain, chain or tree (suffix-tree branches, or the request's tree draft)."""
        def build(tree_draft) -> Decoder:
            settings = self.settings
            relative = settings.step_times.relative if settings.step_times else default_relative
            draft = (tree_draft.model, tree_draft.template) if tree_draft is not None else None
            return make_decoder(mode, relative, settings.chain_drafts, draft, self._suffix)
        return build

    def _triforce_decoder(self, settings: TriforceSettings | None) -> Decoder:
        return triforce_decoder(self.model, settings or self.settings.triforce, self.draft,
                                prefill_chunk=self.settings.prefill_chunk, kept=self._draft_reading)

    def _dsi_decoder(self, options) -> Decoder:
        return self.dsi.decoder(options.workers, options.plain_steps) if options else self.dsi.decoder()

    def _generate(self, prompt_ids, max_new_tokens, sampling, mode, decoder, prediction, cancel,
                  document_tokens, conversation) -> Iterator[Event]:
        """One answer on a cache that starts from the longest reusable prefix; afterwards the
        cache is kept for the next turn (also when the answer was stopped: at every event the
        cache is consistent) as `conversation`'s, and the document prefix is saved to disk when
        asked (listed as used by `conversation`)."""
        started = time.perf_counter()
        cache, reused, source = self._reusable_cache(prompt_ids, conversation)
        if self.documents is not None:
            for problem in self.documents.take_problems():
                yield Notice(problem)
        state = DecodeState(self.model, cache, torch.tensor(prompt_ids, dtype=torch.long), sampling,
                            make_generator(sampling.seed))
        finished, answering = False, False
        try:
            for event in self._run(state, max_new_tokens, mode, decoder, prediction, cancel or threading.Event(),
                                   started, reused, source):
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
                    self.documents.save_once(prompt_ids[:document_tokens], state.cache, owner=conversation)
                self.prefixes.put(state.ids[:state.cache.length].tolist(), state.cache, conversation)
                self.answers.add(state.ids[len(prompt_ids):].tolist())
        if not finished:  # out of memory: this answer's KV goes, never kept for reuse
            del state, cache
            release_gpu_memory()  # a failed answer's memory, for the next request
            doing = "writing the answer" if answering else "reading the prompt"
            raise SpecchatError(f"the GPU ran out of memory while {doing}: try a shorter "
                                f"{'answer' if answering else 'document'} or a smaller pair")

    def _reusable_cache(self, prompt_ids: list[int], conversation: str = "") -> tuple[FullCache, int, str]:
        """A cache already holding the longest available prefix of the prompt: from a recent
        answer in memory (`conversation`'s own is taken back, not copied), or a saved document on
        disk when that is longer."""
        in_memory = self.prefixes.best_length(prompt_ids)
        emptied: list = []  # the cache a chosen file was read into, kept if the file proves unreadable
        if self.documents is not None and in_memory < len(prompt_ids) - 1:  # the disk could offer more
            loaded = self.documents.load(prompt_ids, lambda: emptied.append(self._empty_cache()) or emptied[0],
                                         at_least=in_memory, device=self.model.device)
            if loaded is not None:
                return loaded.cache, loaded.length, "disk"
        taken = self.prefixes.take(prompt_ids, conversation)
        if taken is not None:
            return taken[0], taken[1], "memory" if taken[1] else ""
        if emptied:  # an offloaded slot's memory, emptied for that file: never allocated twice
            emptied[0].trim(0)
            return emptied[0], 0, ""
        return self.model.new_cache(), 0, ""

    def _empty_cache(self):
        """A cache holding nothing: the conversation slot's own, emptied (an offloaded KV is never
        allocated twice), else a new one."""
        spare = self.prefixes.spare()
        return spare if spare is not None else self.model.new_cache()

    def _run(self, state: DecodeState, max_new_tokens: int, mode: str, decoder, prediction: AnswerPrediction,
             cancel: threading.Event, started: float, reused: int, source: str) -> Iterator[Event]:
        prompt_length = state.ids.shape[0]
        stats = Stats(reused_prompt_tokens=reused, reused_from=source)
        decoder.begin(state)
        try:
            first_logits = yield from self._prefill(state, decoder, cancel)
        except BaseException:  # the caller left mid-read, or the read failed
            decoder.close()  # `decode` closes it once it runs; until then this does (DSI's tasks stop)
            raise
        if first_logits is None:
            decoder.close()
            yield Finished(Result("", [], prompt_length, 0, mode, "cancelled", stats))
            return
        decode_started = time.perf_counter()
        stats.prefill_seconds = decode_started - started

        stream = TextStream(self.tokenizer)
        new_ids: list[int] = []
        committed = 0  # tokens the target committed, the end-of-turn token included
        finish_reason = "length"
        guard = RepeatGuard() if state.params.stop_repeats else None
        steps = decode(state, decoder, first_logits, max_new_tokens)
        try:
            for step in steps:
                context = state.ids.shape[0] - len(step.tokens)  # cached when the step began, plus its root
                tokens = step.tokens
                stop_at = next((i for i, t in enumerate(tokens) if t in self.stop_ids), None)
                if stop_at is not None:
                    tokens = tokens[:stop_at]
                    finish_reason = "stop"
                # Token by token, so that every mode stops at the same one however many a step commits.
                repeated = guard.feed(tokens) if guard is not None else None
                if repeated is not None:
                    tokens, finish_reason = tokens[:repeated], "repeating"
                new_ids.extend(tokens)
                committed += len(tokens) + (finish_reason == "stop")  # what counts ends at the end of turn
                stats.target_forwards += 1
                stats.drafted_tokens += step.drafted
                stats.accepted_draft_tokens += step.accepted
                if step.drafted:
                    stats.tree_size = max(stats.tree_size, step.drafted + 1)
                    stats.tree_depth = max(stats.tree_depth, step.depth)
                _update_rates(stats, committed, len(new_ids), time.perf_counter() - decode_started)
                stats.stages = decoder.stage_counts()
                stats.predicted_tokens_per_second = prediction.add(step, context, stats.stages, len(new_ids))
                pieces = tuple((stream.add([token]), origin) for token, origin in zip(tokens, step.origins()))
                yield TextDelta("".join(text for text, _ in pieces), tokens, replace(stats), pieces)
                if finish_reason in ("stop", "repeating"):
                    break
                if cancel.is_set():
                    finish_reason = "cancelled"
                    break
        finally:
            steps.close()  # stops DSI's drafting thread at once, also when the caller stopped listening
        tail = stream.finish()
        if tail:
            yield TextDelta(tail, [], replace(stats), ((tail, "plain"),))
        # The answer limit was clamped to the room left (`_check_request`): at its end the context is full.
        context_full = finish_reason == "length" and prompt_length + len(new_ids) >= self.context_length
        result = Result(stream.text, new_ids, prompt_length, len(new_ids), mode, finish_reason, stats, context_full)
        yield Finished(result)

    def _prefill(self, state: DecodeState, decoder,
                 cancel: threading.Event) -> Generator[Event, None, torch.Tensor | None]:
        """The prompt read in chunks, with progress events; returns the last position's logits, or
        None once `cancel` is set: after a chunk, or inside one (between two layers, where the
        cache can be rolled back: it then holds the whole chunks before, which the next turn reuses)."""
        prompt_length = state.ids.shape[0]
        chunks = prefill(self.model, state.cache, state.ids, self.settings.prefill_chunk, decoder, cancel)
        while True:
            try:
                done = next(chunks)
            except StopIteration as end:
                return end.value
            except Cancelled:
                return None
            yield PrefillProgress(done, prompt_length)
            if cancel.is_set():
                return None


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
