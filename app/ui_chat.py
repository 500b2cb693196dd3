"""The chat tab's behaviour, without its layout: sending, streaming, stop, regenerate, edit,
documents and the context meter, conversations. Every handler returns a `View` of what changed;
`ui.py` maps views onto components.

The conversation on disk is the source of truth: a question is saved before its answer starts,
the answer is saved as it streams and when it ends, each write atomic. A server killed in the
middle of an answer loses at most that answer's last seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..core.errors import InputError, SpecchatError
from .context_meter import CUT_MARGIN, CUTS, Meter, cut_document, describe, measure, split_document
from .conversation import (LEFT_OUT, PASTED_NAME, Conversation, attachment_label, model_messages, shown_messages,
                           title_from)
from .documents import document_tokens, read_document, user_turn
from .engine_handle import EngineHandle
from .engine_queue import Ticket
from .exports import write_export
from .history import HistoryStore
from .read_progress import ReadProgress
from .safe_markdown import inert_markdown
from .speculation_view import colored_tokens, ending, stage_table, stats_line

SAVE_EVERY_SECONDS = 2.0  # while an answer streams; bounds what a crash can lose of it
KEPT_SETTINGS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "mode")
LOADING_POLL_SECONDS = 0.5
STARTING = "⏳ *Starting…*"
PART_ANSWER_TOKENS = 256  # each part's summary, when a document is summarized in parts (an eighth of a short context)
PART_SYSTEM = ("You summarize one part of a longer document faithfully: its main points in order, with names, "
               "numbers and dates exact, adding nothing it does not say.")


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

    def kept(self) -> dict:
        """The settings a conversation keeps and brings back when reopened (the system prompt and
        preset are fields of their own)."""
        return {name: getattr(self, name) for name in KEPT_SETTINGS}

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
    cuts: dict[str, str] | None = None  # where -> the cut's button label; None: no document to cut
    answer_room: int = 0  # a shorter answer limit that fits, offered as a choice; 0: none does
    can_leave_out: bool = False  # earlier turns can be left out to make room
    in_parts: bool = False  # the document can be summarized in parts
    longer_pairs: list[tuple[str, str]] | None = None
    streaming: bool = False
    pending: str = ""  # shown in the streaming answer's bubble until its first word (Markdown of ours)
    conversations_changed: bool = False
    clear_conversation: bool = False  # show an empty, new conversation
    # An opened conversation's own system prompt and preset, shown in the settings: otherwise the
    # page's (after a reload, the defaults) would replace them at its next question.
    system: str | None = None
    preset: str | None = None
    settings: dict | None = None  # an opened conversation's own settings (`KEPT_SETTINGS`), likewise
    deleted: str | None = None  # the id of a conversation just deleted, offered to undo; "": none now


class ChatLogic:
    def __init__(self, handle: EngineHandle, store: HistoryStore, registry_file: str | None = None):
        self.handle = handle
        self.store = store
        self.registry_file = registry_file
        self._cancels: dict[str, Ticket] = {}  # per browser session: its answer, for Stop
        self._waits: dict[str, threading.Event] = {}  # per browser session: a question waiting for the model

    def stop(self, session: str) -> None:
        """Stop the session's answer: it ends at the next token, saved, with its figures (or
        leaves the line, if it was still waiting)."""
        ticket = self._cancels.get(session)
        if ticket is not None:
            ticket.cancel()
        waiting = self._waits.get(session)
        if waiting is not None:
            waiting.set()

    # --- documents and the meter -------------------------------------------------------------

    def attach_file(self, path: str | None) -> View:
        if not path:
            return View()
        text = read_document(path)
        return View(attachment=self._attachment(Path(path).name, text), status=f"Attached {Path(path).name}.")

    def pasted_chip(self, pasted: str) -> str:
        """The attachment line for pasted text, as a file gets one ("" when nothing is pasted)."""
        if not (pasted or "").strip():
            return ""
        counted = self.handle.status() == "ready"
        document = {"name": PASTED_NAME, "text": pasted, "note": "",
                    "tokens": self.handle.get().count_tokens(pasted.strip()) if counted else None}
        return attachment_label(document)

    def _attachment(self, name: str, text: str, note: str = "") -> dict:
        engine = self.handle.get()
        return {"name": name, "text": text, "tokens": engine.count_tokens(text), "note": note}

    def _with_pasted(self, attachment: dict | None, pasted: str | None) -> dict | None:
        """The attachment, or pasted text made one (an uploaded file wins)."""
        if attachment is None and pasted and pasted.strip():
            return self._attachment(PASTED_NAME, pasted.strip())
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
        if not question and attachment is None and not (pasted or "").strip():
            yield View(status="Type a question or attach a document.")
            return
        if self.handle.status() == "loading":
            loaded = yield from self._wait_for_the_model(question, attachment, pasted, conversation, settings, session)
            if not loaded:
                return
        attachment = self._with_pasted(attachment, pasted)
        meter = self.meter(conversation, attachment, "", question, settings)
        if meter.over:
            yield dataclasses.replace(self._over_limit(meter, attachment, conversation), message=question,
                                      conversation=conversation, clear_conversation=conversation is None)
            return
        conversation = conversation or self.store.new(settings.system, settings.preset)
        conversation.system, conversation.preset = settings.system, settings.preset
        conversation.settings = settings.kept()
        if not conversation.messages:
            conversation.title = title_from(question, attachment)
        conversation.messages.append({"role": "user", "content": question, "document": attachment})
        self.store.save(conversation)  # the question is on disk before the answer starts
        yield View(conversation=conversation, message="", clear_attachment=True, pasted="", over_limit="",
                   conversations_changed=True, status="")
        yield from self._answer(conversation, settings, session)

    def _wait_for_the_model(self, question: str, attachment: dict | None, pasted: str, conversation: Conversation | None,
                            settings: Settings, session: str) -> Iterator[View]:
        """While the model loads, the question shows in the chat at once, its answer's bubble
        saying so, and it is saved: a tab closed meanwhile leaves it in its conversation, to
        answer once reopened. True once the model is ready. Whatever the wait's end, with the page
        still there the saved question comes back out: `send` saves it again with its document's
        tokens counted, or puts it back in the box (a failed load, Stop, or too long to fit)."""
        document = attachment or ({"name": PASTED_NAME, "text": pasted, "tokens": None} if (pasted or "").strip()
                                  else None)
        asked = self._asked(conversation, question, document, settings)
        problem = self._save_after_error(asked)
        shown_turn = dataclasses.replace(asked, messages=[*asked.messages, {"role": "assistant", "content": "",
                                                                            "partial": True}])
        stopped = self._waits[session] = threading.Event()
        try:
            while self.handle.status() == "loading" and not stopped.is_set():
                progress = self.handle.progress()
                yield View(conversation=shown_turn, streaming=True, message="", status=problem,
                           pending="⏳ *Loading the model, then this answer starts…* " + inert_markdown(progress))
                stopped.wait(LOADING_POLL_SECONDS)
        finally:
            if self._waits.get(session) is stopped:
                del self._waits[session]
        # The disk as it was: the conversation itself, or no file for a new one.
        self._save_after_error(conversation if conversation else dataclasses.replace(asked, messages=[]))
        back = View(conversation=conversation, clear_conversation=conversation is None, message=question)
        if stopped.is_set():
            yield dataclasses.replace(back, status="Stopped while the model loaded: your question is back in the box.")
            return False
        try:
            self.handle.get()
        except SpecchatError as error:
            yield dataclasses.replace(back, status=problem_text(error))
            return False
        return True

    def _asked(self, conversation: Conversation | None, question: str, document: dict | None,
               settings: Settings) -> Conversation:
        """A copy of the conversation (a new one when None) with the question asked, as `send`
        saves it."""
        asked = Conversation(**{**dataclasses.asdict(conversation or self.store.new()), "messages": [
            *(conversation.messages if conversation else []), {"role": "user", "content": question, "document": document}]})
        asked.system, asked.preset, asked.settings = settings.system, settings.preset, settings.kept()
        if not conversation or not conversation.messages:
            asked.title = title_from(question, document)
        return asked

    def _shown_turn(self, conversation: Conversation | None, question: str, document: dict | None) -> Conversation:
        """A copy of the conversation with the question and its empty answer, shown while work that
        comes before the answer (loading, summarizing parts) runs; nothing of it is saved."""
        return Conversation(**{**dataclasses.asdict(conversation or self.store.new()), "messages": [
            *(conversation.messages if conversation else []),
            {"role": "user", "content": question, "document": document},
            {"role": "assistant", "content": "", "partial": True}]})

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
        edited.pop("left_out", None)  # a question asked again is read again
        conversation.messages[index:] = [edited]
        self.store.save(conversation)
        yield from self._answer(conversation, settings, session)

    def _answer(self, conversation: Conversation, settings: Settings, session: str) -> Iterator[View]:
        reply = {"role": "assistant", "content": "", "partial": True, "stats": None, "origins": []}
        conversation.messages.append(reply)
        ticket = None
        try:
            # The previous answer's figures go as this one starts: a stale "done" misleads.
            yield View(conversation=conversation, streaming=True, stats="", stages="", tokens="",
                       pending=STARTING)
            # A browser session answers one question at a time: an earlier answer it left without
            # closing (the page moved on to another conversation) gives the engine up now.
            self.stop(session)
            ticket = self._cancels[session] = self.handle.submit(
                _answer_job(model_messages(conversation), int(settings.max_new_tokens), settings.sampling(),
                            settings.mode, _opening_document(conversation)))
            ahead = ticket.position
            if ahead:
                waiting = f"Waiting for the engine: {ahead} answer{'s' if ahead > 1 else ''} before yours…"
                yield View(conversation=conversation, streaming=True, status=waiting, pending=f"⏳ *{waiting}*")
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

        mode, pending = "", STARTING
        reading = ReadProgress()
        saved_at = time.monotonic()
        for event in events:
            if isinstance(event, _Started):
                mode = reply["mode"] = event.mode
            elif isinstance(event, PrefillProgress):
                pending = reading.update(event.done, event.total, time.monotonic())
                yield View(conversation=conversation, streaming=True, status="", pending=pending)
            elif isinstance(event, Notice):
                yield View(conversation=conversation, streaming=True, status=f"ℹ️ {event.text}", pending=pending)
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
                             finish_reason=result.finish_reason, context_full=result.context_full,
                             new_tokens=result.new_tokens, mode=result.mode)
                self.store.save(conversation)
                yield View(conversation=conversation, status="",
                           stats=stats_line(reply["stats"], result.mode, result.new_tokens, ending(reply)),
                           stages=stage_table(reply["stats"]), tokens=colored_tokens(reply["origins"]))

    # --- over the limit ------------------------------------------------------------------------

    def _over_limit(self, meter: Meter, attachment: dict | None, conversation: Conversation | None) -> View:
        engine = self.handle.get()
        text = (f"**This does not fit.** The prompt is {meter.prompt:,} tokens and the answer limit keeps "
                f"{meter.reserve:,} for the answer, but {engine.name} reads at most {meter.context:,}: "
                f"{meter.excess:,} too many. Nothing is cut or left out without your choice:")
        earlier = _earlier_messages(conversation)
        return View(over_limit=text, attachment=attachment,
                    cuts=_cut_labels(meter.excess, attachment) if attachment is not None else None,
                    answer_room=meter.answer_room, can_leave_out=bool(earlier),
                    in_parts=attachment is not None and meter.document > meter.context // 2,
                    longer_pairs=self._longer_pairs(meter.needed, self.handle.model),
                    status="⚠️ Too long for this model: see the choices below.")

    def _longer_pairs(self, needed: int, current: str) -> list[tuple[str, str]]:
        """Pairs whose context holds `needed` tokens and that this machine can run (the plan's
        verdict at their full context, as the Models tab shows it)."""
        from ..core.registry import load_registry
        from .models_cmd import listing_profile, plan_fit

        registry = load_registry(self.registry_file)
        candidates = [pair for pair in registry.pairs.values() if pair.context_length >= needed and pair.id != current]
        if not candidates:
            return []
        profile = listing_profile()
        return [(f"{pair.name} ({pair.context_length:,} tokens)", pair.id) for pair in candidates
                if plan_fit(pair, profile, registry).fits]

    def cut(self, where: str, message: str, attachment: dict | None, pasted: str,
            conversation: Conversation | None, settings: Settings) -> View:
        """Cut the document by what is too much, from its start, middle or end."""
        attachment = self._with_pasted(attachment, pasted)
        if attachment is None:
            raise InputError("there is no document to cut")
        meter = self.meter(conversation, attachment, "", message, settings)
        text, removed = cut_document(self.handle.get().tokenizer, attachment["text"], meter.excess, where)
        cut = self._attachment(attachment["name"], text, f"cut {removed:,} tokens from the {where}")
        return View(attachment=cut, pasted="", over_limit="",
                    status=f"Cut {removed:,} tokens from the {where} of the document.")

    def leave_out_turns(self, message: str, attachment: dict | None, pasted: str, conversation: Conversation | None,
                        settings: Settings) -> View:
        """Leave the oldest messages out of what the model reads until the next question fits; every
        document stays, and the messages stay in the chat, marked."""
        attachment = self._with_pasted(attachment, pasted)
        earlier = _earlier_messages(conversation)
        for count in range(1, len(earlier) + 1):
            for message_index in earlier[:count]:
                conversation.messages[message_index]["left_out"] = True
            if not self.meter(conversation, attachment, "", message, settings).over:
                self.store.save(conversation)
                return View(conversation=conversation, over_limit="",
                            status=f"Left {count} earlier message{'s' if count > 1 else ''} out of what the model "
                                   "reads (documents stay).")
        for message_index in earlier:
            conversation.messages[message_index].pop("left_out", None)
        raise InputError("leaving out every earlier turn is still not enough: cut the document, shorten the "
                         "answer limit, or start a new conversation")

    def summarize_in_parts(self, message: str, attachment: dict | None, pasted: str,
                           conversation: Conversation | None, settings: Settings, session: str = "") -> Iterator[View]:
        """For a document the model cannot read whole: summarize each part that fits, then ask the
        question about those summaries, which the chat labels as such (not the whole text)."""
        attachment = self._with_pasted(attachment, pasted)
        if attachment is None:
            raise InputError("there is no document to summarize in parts")
        engine = self.handle.get()
        summary_tokens = min(PART_ANSWER_TOKENS, engine.context_length // 8)
        overhead = len(engine.chat_ids(_part_messages("", 99, 99)))
        parts = split_document(engine.tokenizer, attachment["text"],
                               engine.context_length - summary_tokens - overhead - CUT_MARGIN)
        question = (message or "").strip()
        unread = dataclasses.replace(self.meter(conversation, None, "", question, settings), document=0)
        if unread.needed + len(parts) * (summary_tokens + CUT_MARGIN) > engine.context_length:
            raise InputError(f"even the summaries of its {len(parts)} parts would not fit beside the conversation: "
                             "cut the document first, or start a new conversation")
        shown_turn = self._shown_turn(conversation, question, attachment)
        summaries = []
        stopped = self._waits[session] = threading.Event()  # Stop between two parts' jobs too
        try:
            for number, part in enumerate(parts, 1):
                doing = f"⏳ *Summarizing part {number} of {len(parts)} (the document is too long to read whole)…*"
                yield View(conversation=shown_turn, streaming=True, message="", over_limit="", pending=doing, status="")
                summary = yield from self._part_summary(part, number, len(parts), summary_tokens, settings,
                                                        session, shown_turn, doing, stopped)
                if summary is None or stopped.is_set():
                    yield View(conversation=conversation, clear_conversation=conversation is None, message=question,
                               status="Stopped while summarizing the parts: your question and document are kept.")
                    return
                summaries.append(f"Part {number} of {len(parts)}, summarized:\n{summary.strip()}")
        finally:
            if self._waits.get(session) is stopped:
                del self._waits[session]
        combined = self._attachment(title_from("", attachment), "\n\n".join(summaries),
                                    f"summaries of its {len(parts)} parts, not the whole text")
        yield from self.send(question, combined, "", conversation, settings, session)

    def _part_summary(self, part: str, number: int, count: int, summary_tokens: int, settings: Settings,
                      session: str, shown_turn: Conversation, doing: str, stopped: threading.Event) -> Iterator[View]:
        """One part's summary (None when stopped), the bubble showing the part's read meanwhile."""
        from ..core.engine import Finished, PrefillProgress

        ticket = self._cancels[session] = self.handle.submit(
            _answer_job(_part_messages(part, number, count), summary_tokens, settings.sampling(), settings.mode))
        if stopped.is_set():  # a Stop that came before the ticket could be cancelled
            ticket.cancel()
        reading = ReadProgress()
        try:
            for event in ticket:
                if isinstance(event, PrefillProgress):
                    progress = reading.update(event.done, event.total, time.monotonic())
                    yield View(conversation=shown_turn, streaming=True, pending=f"{doing}\n\n{progress}")
                elif isinstance(event, Finished):
                    return None if event.result.finish_reason == "cancelled" else event.result.text
            return None  # taken out of the line by Stop before it started
        finally:
            if self._cancels.get(session) is ticket:
                del self._cancels[session]
            ticket.close()

    def shorter_answer(self, message: str, attachment: dict | None, pasted: str, conversation: Conversation | None,
                       settings: Settings) -> View:
        """Lower the answer limit to what the prompt leaves."""
        meter = self.meter(conversation, self._with_pasted(attachment, pasted), "", message, settings)
        if not meter.answer_room:
            raise InputError("no useful answer fits after this prompt: cut the document or leave out earlier turns")
        return View(over_limit="", settings={"max_new_tokens": meter.answer_room},
                    status=f"The answer limit is now {meter.answer_room:,} tokens for this conversation.")

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
        """(label, id) of each saved conversation, newest first: titles that repeat get their time,
        and labels that still repeat a number."""
        summaries = self.store.list()
        titles = collections.Counter(summary.title for summary in summaries)
        labels = [summary.title if titles[summary.title] == 1 else
                  f"{summary.title} · {time.strftime('%b %d, %H:%M', time.localtime(summary.updated))}"
                  for summary in summaries]
        repeats, seen = collections.Counter(labels), collections.Counter()
        for index, label in enumerate(labels):
            seen[label] += 1
            if repeats[label] > 1:
                labels[index] = f"{label} ({seen[label]})"
        return [(label, summary.id) for label, summary in zip(labels, summaries)]

    def open(self, conversation_id: str | None) -> View:
        if not conversation_id:
            return View()
        conversation = self.store.load(conversation_id)
        last = next((m for m in reversed(conversation.messages) if m["role"] == "assistant"), None)
        stats = last.get("stats") if last else None
        return View(conversation=conversation, over_limit="", system=conversation.system, preset=conversation.preset,
                    settings={name: value for name, value in conversation.settings.items() if name in KEPT_SETTINGS},
                    stats=stats_line(stats, last.get("mode", ""), last.get("new_tokens"), ending(last)) if stats else "",
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
        """Delete the conversation; it can be brought back (`undelete`) until the app restarts."""
        if conversation is None or not conversation.messages:
            return View(status="Nothing to delete: this conversation is not saved yet.")
        self.store.delete(conversation.id)
        view = self.newest()
        view.status = f"Deleted “{conversation.title}”."
        view.deleted = conversation.id
        return view

    def undelete(self, conversation_id: str | None) -> View:
        if not conversation_id:
            return View(status="Nothing to bring back.")
        self.store.undelete(conversation_id)
        view = self.open(conversation_id)
        view.conversations_changed, view.deleted, view.status = True, "", "Brought back."
        return view

    def export(self, conversation: Conversation | None) -> list[str]:
        return write_export(conversation)


@dataclass(frozen=True)
class _Started:
    """The first event of the page's answer job: the mode that runs (`auto` resolved)."""
    mode: str


def _answer_job(messages: list[dict], max_new_tokens: int, sampling, mode: str, document: str = ""):
    """An answer as a job for the engine thread (`engine_queue`). `document`: the text the
    conversation opens with, whose KV is saved to disk, so that the conversation reopened after
    a restart does not read it again."""
    def job(engine, cancel) -> Iterator:
        from ..core.engine import resolve_mode

        system = messages[:1] if messages and messages[0]["role"] == "system" else []
        saved = document_tokens(engine, system, document) if document else 0
        events = engine.generate(engine.chat_ids(messages), max_new_tokens, sampling, mode, cancel,
                                 document_tokens=saved)
        yield _Started(resolve_mode(mode, engine.auto_mode))
        yield from events
    return job


def _opening_document(conversation: Conversation) -> str:
    """The text of the document the conversation opens with ("" when it opens without one)."""
    first = conversation.messages[0] if conversation.messages else {}
    return (first.get("document") or {}).get("text", "") if first.get("role") == "user" else ""


def _part_messages(part: str, number: int, count: int) -> list[dict]:
    return [{"role": "system", "content": PART_SYSTEM},
            {"role": "user", "content": user_turn(f"Summarize part {number} of {count} of a longer document.", part)}]


def _earlier_messages(conversation: Conversation | None) -> list[int]:
    """The indexes of the messages that can still be left out of what the model reads, oldest first."""
    if conversation is None:
        return []
    return [index for index, message in enumerate(conversation.messages) if not message.get("left_out")]


def _cut_labels(excess: int, attachment: dict) -> dict[str, str]:
    """Each cut's button label, saying how much of the document goes."""
    share = min(1.0, excess / max(attachment["tokens"], 1))
    percent = "under 1%" if share < 0.005 else f"{share:.0%}"  # "0%" would read as cutting nothing
    return {where: f"✂ Cut {excess:,} tokens ({percent} of the document) from its {where}" for where in CUTS}


def problem_text(error: Exception) -> str:
    """An error as one line for the page, never a traceback."""
    text = str(error) if isinstance(error, SpecchatError) else f"unexpected error: {type(error).__name__}: {error}"
    return f"⚠️ {text}"


def shown(conversation: Conversation | None, streaming: bool = False, pending: str = "") -> list[dict]:
    return shown_messages(conversation, streaming=streaming, pending=pending) if conversation else []


def _document_text(attachment: dict | None, pasted: str | None) -> str:
    if attachment is not None:
        return attachment["text"]
    return (pasted or "").strip()


def _without_attachment_line(text: str) -> str:
    """An edited question arrives as shown, attachment line (and left-out mark) included: drop them."""
    text = text.removesuffix(LEFT_OUT).rstrip()
    lines = text.split("\n")
    return "\n".join(lines[1:]).lstrip("\n") if lines and lines[0].startswith("📎") else text
