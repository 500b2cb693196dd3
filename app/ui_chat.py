"""The chat tab's behaviour, without its layout: sending, streaming, stop, regenerate, edit,
documents and the context meter, conversations. Every handler returns a `View` of what changed;
`ui.py` maps views onto components.

The conversation on disk is the source of truth: a question is saved before its answer starts,
the answer is saved as it streams and when it ends, each write atomic. A server killed in the
middle of an answer loses at most that answer's last seconds.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..core.errors import InputError, SpecchatError
from .context_meter import Meter, cut_document, describe, measure
from .conversation import Conversation, model_messages, shown_messages, title_from
from .documents import read_document
from .engine_handle import EngineHandle
from .engine_queue import Ticket
from .exports import write_export
from .history import HistoryStore
from .speculation_view import colored_tokens, stage_table, stats_line

SAVE_EVERY_SECONDS = 2.0  # while an answer streams; bounds what a crash can lose of it
PASTED = "pasted document"


@dataclass(frozen=True)
class Settings:
    system: str
    preset: str
    temperature: float
    top_p: float
    top_k: int
    seed: str | float | None  # blank or None: a fresh seed each time
    max_new_tokens: int
    mode: str

    def sampling(self):
        from ..core.sampling import SamplingParams

        try:
            seed = None if str(self.seed or "").strip() == "" else int(str(self.seed).strip())
            return SamplingParams(float(self.temperature), int(self.top_k), float(self.top_p), seed)
        except ValueError as error:
            problem = str(error) if "must" in str(error) else f"the seed must be a whole number, got {self.seed!r}"
            raise InputError(problem) from None


@dataclass
class View:
    """What a handler changed; None: leave the component as it is."""
    conversation: Conversation | None = None
    status: str | None = None
    message: str | None = None
    attachment: dict | None = None
    clear_attachment: bool = False
    pasted: str | None = None
    stats: str | None = None
    stages: str | None = None
    tokens: str | None = None
    over_limit: str | None = None  # the over-limit choice's text; "" hides it
    cuts_possible: bool = False  # the over-limit text concerns a document that can be cut
    longer_pairs: list[tuple[str, str]] | None = None
    streaming: bool = False
    conversations_changed: bool = False
    clear_conversation: bool = False  # show an empty, new conversation
    # An opened conversation's own system prompt and preset, shown in the settings: otherwise the
    # page's (after a reload, the defaults) would replace them at its next question.
    system: str | None = None
    preset: str | None = None


class ChatLogic:
    def __init__(self, handle: EngineHandle, store: HistoryStore, registry_file: str | None = None):
        self.handle = handle
        self.store = store
        self.registry_file = registry_file
        self._cancels: dict[str, Ticket] = {}  # per browser session: its answer, for Stop

    def stop(self, session: str) -> None:
        """Stop the session's answer: it ends at the next token, saved, with its figures (or
        leaves the line, if it was still waiting)."""
        ticket = self._cancels.get(session)
        if ticket is not None:
            ticket.cancel()

    # --- documents and the meter -------------------------------------------------------------

    def attach_file(self, path: str | None) -> View:
        if not path:
            return View()
        text = read_document(path)
        return View(attachment=self._attachment(Path(path).name, text), status=f"Attached {Path(path).name}.")

    def _attachment(self, name: str, text: str, note: str = "") -> dict:
        engine = self.handle.get()
        return {"name": name, "text": text, "tokens": engine.count_tokens(text), "note": note}

    def _with_pasted(self, attachment: dict | None, pasted: str | None) -> dict | None:
        """The attachment, or pasted text made one (an uploaded file wins)."""
        if attachment is None and pasted and pasted.strip():
            return self._attachment(PASTED, pasted.strip())
        return attachment

    def meter(self, conversation: Conversation | None, attachment: dict | None, pasted: str, message: str,
              settings: Settings) -> Meter:
        engine = self.handle.get()
        document = _document_text(attachment, pasted)
        history = [m for m in model_messages(conversation) if m["role"] != "system"] if conversation else []
        return measure(engine, settings.system, history, document, message or "", int(settings.max_new_tokens))

    def meter_text(self, conversation, attachment, pasted, message, settings) -> str:
        if self.handle.status() != "ready":
            return "Context: counted once the model is loaded."
        return describe(self.meter(conversation, attachment, pasted, message, settings))

    # --- sending -------------------------------------------------------------------------------

    def send(self, message: str, attachment: dict | None, pasted: str, conversation: Conversation | None,
             settings: Settings, session: str = "") -> Iterator[View]:
        question = (message or "").strip()
        attachment = self._with_pasted(attachment, pasted)
        if not question and attachment is None:
            yield View(status="Type a question or attach a document.")
            return
        meter = self.meter(conversation, attachment, "", question, settings)
        if meter.over:
            yield self._over_limit(meter, attachment)
            return
        conversation = conversation or self.store.new(settings.system, settings.preset)
        conversation.system, conversation.preset = settings.system, settings.preset
        if not conversation.messages:
            conversation.title = title_from(question or attachment["name"])
        conversation.messages.append({"role": "user", "content": question, "document": attachment})
        self.store.save(conversation)  # the question is on disk before the answer starts
        yield View(conversation=conversation, message="", clear_attachment=True, pasted="", over_limit="",
                   conversations_changed=True, status=self._loading_line())
        yield from self._answer(conversation, settings, session)

    def _loading_line(self) -> str:
        if self.handle.status() != "loading":
            return ""
        progress = self.handle.progress()
        return "Loading the model…" + (f" {progress}" if progress else "")

    def regenerate(self, conversation: Conversation | None, settings: Settings, session: str = "") -> Iterator[View]:
        """A new answer to the last question (the old one is replaced)."""
        if conversation is None or not conversation.messages:
            yield View(status="Nothing to regenerate yet.")
            return
        while conversation.messages and conversation.messages[-1]["role"] == "assistant":
            conversation.messages.pop()
        yield from self._answer(conversation, settings, session)

    def edit(self, conversation: Conversation | None, index: int, text: str, settings: Settings,
             session: str = "") -> Iterator[View]:
        """Replace the question at `index` (its document stays) and answer it again; the turns
        after it go, as in any chat app that edits a question."""
        if conversation is None or not 0 <= index < len(conversation.messages) \
                or conversation.messages[index]["role"] != "user":
            yield View(conversation=conversation, status="Only your own messages can be edited.")
            return
        # The chat shows questions made inert (images as links, HTML as text): an edit that kept
        # that text as shown keeps the question as it was written.
        unchanged = text == shown_messages(conversation)[index]["content"]
        content = conversation.messages[index]["content"] if unchanged else _without_attachment_line(text).strip()
        edited = dict(conversation.messages[index], content=content)
        conversation.messages[index:] = [edited]
        self.store.save(conversation)
        yield from self._answer(conversation, settings, session)

    def _answer(self, conversation: Conversation, settings: Settings, session: str) -> Iterator[View]:
        reply = {"role": "assistant", "content": "", "partial": True, "stats": None, "origins": []}
        conversation.messages.append(reply)
        ticket = None
        try:
            # The previous answer's figures go as this one starts: a stale "done" misleads.
            yield View(conversation=conversation, streaming=True, stats="", stages="", tokens="")
            # A browser session answers one question at a time: an earlier answer it left without
            # closing (the page moved on to another conversation) gives the engine up now.
            self.stop(session)
            ticket = self._cancels[session] = self.handle.submit(
                _answer_job(model_messages(conversation), int(settings.max_new_tokens), settings.sampling(),
                            settings.mode))
            ahead = ticket.position
            if ahead:
                yield View(conversation=conversation, streaming=True,
                           status=f"Waiting for the engine: {ahead} answer{'s' if ahead > 1 else ''} before yours…")
            yield from self._stream(conversation, reply, ticket)
            if reply["partial"]:  # stopped while it waited in line: no answer, the question stays
                conversation.messages[:] = [m for m in conversation.messages if m is not reply]
                reply["partial"] = False
                self.store.save(conversation)
                yield View(conversation=conversation, status="Stopped before the answer started.")
        except Exception as error:  # shown in the page, never as a traceback; the question stays
            if not reply["content"]:  # an empty answer is no answer: the question stays, to retry
                conversation.messages[:] = [m for m in conversation.messages if m is not reply]
            reply["partial"] = False
            also = self._save_after_error(conversation)
            yield View(conversation=conversation, status=" ".join(filter(None, [problem_text(error), also])))
        finally:
            # An error, or the page went away mid-answer: the engine is freed now, what was said kept.
            if ticket is not None:
                if self._cancels.get(session) is ticket:
                    del self._cancels[session]
                ticket.close()
            if reply["partial"]:
                reply.update(partial=False, finish_reason="cancelled")
                self._save_after_error(conversation)

    def _save_after_error(self, conversation: Conversation) -> str:
        """Save on a path that is already ending badly: a failure here (a full disk) becomes a
        line for the page instead of a second error over the first; "" when the save worked."""
        try:
            self.store.save(conversation)
        except SpecchatError as error:
            return problem_text(error)
        return ""

    def _stream(self, conversation, reply, events) -> Iterator[View]:
        from ..core.engine import Finished, Notice, PrefillProgress, TextDelta

        mode = ""
        saved_at = time.monotonic()
        for event in events:
            if isinstance(event, _Started):
                mode = reply["mode"] = event.mode
            elif isinstance(event, PrefillProgress):
                yield View(conversation=conversation, streaming=True,
                           status=f"Reading the prompt: {event.done:,} / {event.total:,} tokens")
            elif isinstance(event, Notice):
                yield View(conversation=conversation, streaming=True, status=f"ℹ️ {event.text}")
            elif isinstance(event, TextDelta):
                reply["content"] += event.text
                reply["origins"].extend([text, origin] for text, origin in event.pieces if text)
                reply["stats"] = dataclasses.asdict(event.stats)
                if time.monotonic() - saved_at > SAVE_EVERY_SECONDS:
                    self.store.save(conversation)
                    saved_at = time.monotonic()
                yield View(conversation=conversation, streaming=True, status="",
                           stats=stats_line(reply["stats"], mode), stages=stage_table(reply["stats"]),
                           tokens=colored_tokens(reply["origins"]))
            elif isinstance(event, Finished):
                result = event.result
                reply.update(content=result.text, partial=False, stats=dataclasses.asdict(result.stats),
                             finish_reason=result.finish_reason, mode=result.mode)
                self.store.save(conversation)
                yield View(conversation=conversation, status="",
                           stats=stats_line(reply["stats"], result.mode, result.new_tokens, result.finish_reason),
                           stages=stage_table(reply["stats"]), tokens=colored_tokens(reply["origins"]))

    # --- over the limit ------------------------------------------------------------------------

    def _over_limit(self, meter: Meter, attachment: dict | None) -> View:
        engine = self.handle.get()
        text = (f"**This does not fit.** The conversation needs {meter.needed:,} tokens "
                f"({meter.prompt:,} of prompt and {meter.reserve:,} kept for the answer), but "
                f"{engine.name} reads at most {meter.context:,}: {meter.excess:,} too many. ")
        text += ("Choose what to cut from the document, or switch to a pair with a longer context. "
                 "Nothing is cut without your choice." if attachment is not None else
                 "Start a new conversation, shorten the question, or switch to a pair with a longer context.")
        return View(over_limit=text, cuts_possible=attachment is not None, attachment=attachment,
                    longer_pairs=self._longer_pairs(meter.needed, self.handle.model),
                    status="⚠️ Too long for this model: see the choices below.")

    def _longer_pairs(self, needed: int, current: str) -> list[tuple[str, str]]:
        from ..core.registry import load_registry

        pairs = load_registry(self.registry_file).pairs.values()
        return [(f"{pair.name} ({pair.context_length:,} tokens)", pair.id) for pair in pairs
                if pair.context_length >= needed and pair.id != current]

    def cut(self, where: str, message: str, attachment: dict | None, pasted: str,
            conversation: Conversation | None, settings: Settings) -> View:
        """Cut the document by what is too much, from its start, middle or end."""
        attachment = self._with_pasted(attachment, pasted)
        if attachment is None:
            raise InputError("there is no document to cut")
        meter = self.meter(conversation, attachment, "", message, settings)
        text, removed = cut_document(self.handle.get().tokenizer, attachment["text"], meter.excess, where)
        cut = self._attachment(attachment["name"], text, f"cut {removed:,} tokens from the {where}")
        return View(attachment=cut, pasted="", over_limit="", status=f"Cut {removed:,} tokens from the {where} of the document.")

    def switch_pair(self, pair_id: str | None) -> View:
        from ..core.download import model_status
        from ..core.files import human_size
        from ..core.registry import load_registry

        if not pair_id:
            return View(status="Choose a pair first.")
        pair = load_registry(self.registry_file).get(pair_id)
        missing = pair.source == "hub" and not all(model_status(model).complete for model in pair.models)
        if missing:
            return View(status=f"{pair.name} is not downloaded yet: download it ({human_size(pair.download_bytes)}) "
                               "in the Models & hardware tab, then switch. Your question and document are kept.")
        self.handle.switch(pair_id)
        return View(over_limit="", status=f"Loading {pair.name}… send again when it is ready; your question "
                                          "and document are kept.")

    # --- conversations -------------------------------------------------------------------------

    def conversation_choices(self) -> list[tuple[str, str]]:
        return [(summary.title, summary.id) for summary in self.store.list()]

    def open(self, conversation_id: str | None) -> View:
        if not conversation_id:
            return View()
        conversation = self.store.load(conversation_id)
        last = next((m for m in reversed(conversation.messages) if m["role"] == "assistant"), None)
        stats = last.get("stats") if last else None
        return View(conversation=conversation, over_limit="", system=conversation.system, preset=conversation.preset,
                    stats=stats_line(stats, last.get("mode", ""), None) if stats else "",
                    stages=stage_table(stats) if stats else "",
                    tokens=colored_tokens(last.get("origins") or []) if last else "")

    def newest(self) -> View:
        problems = self.store.take_problems()
        choices = self.conversation_choices()
        view = self.open(choices[0][1]) if choices else View(clear_conversation=True)
        view.status = " ".join(f"⚠️ {problem}" for problem in problems) or None
        view.conversations_changed = True
        return view

    def rename(self, conversation: Conversation | None, title: str) -> View:
        if conversation is None:
            raise InputError("start the conversation before naming it")
        self.store.rename(conversation.id, title)
        conversation.title = title.strip()
        return View(conversation=conversation, conversations_changed=True, status=f"Renamed to “{conversation.title}”.")

    def delete(self, conversation: Conversation | None) -> View:
        if conversation is not None:
            self.store.delete(conversation.id)
        view = self.newest()
        view.status = "Conversation deleted."
        return view

    def export(self, conversation: Conversation | None) -> list[str]:
        return write_export(conversation)


@dataclass(frozen=True)
class _Started:
    """The first event of the page's answer job: the mode that runs (`auto` resolved)."""
    mode: str


def _answer_job(messages: list[dict], max_new_tokens: int, sampling, mode: str):
    """An answer as a job for the engine thread (`engine_queue`)."""
    def job(engine, cancel) -> Iterator:
        from ..core.engine import resolve_mode

        events = engine.generate(engine.chat_ids(messages), max_new_tokens, sampling, mode, cancel)
        yield _Started(resolve_mode(mode, engine.auto_mode))
        yield from events
    return job


def problem_text(error: Exception) -> str:
    """An error as one line for the page, never a traceback."""
    text = str(error) if isinstance(error, SpecchatError) else f"unexpected error: {type(error).__name__}: {error}"
    return f"⚠️ {text}"


def shown(conversation: Conversation | None, streaming: bool = False) -> list[dict]:
    return shown_messages(conversation, streaming=streaming) if conversation else []


def _document_text(attachment: dict | None, pasted: str | None) -> str:
    if attachment is not None:
        return attachment["text"]
    return (pasted or "").strip()


def _without_attachment_line(text: str) -> str:
    """An edited question arrives as shown, attachment line included: drop that line."""
    lines = text.split("\n")
    return "\n".join(lines[1:]).lstrip("\n") if lines and lines[0].startswith("📎") else text
