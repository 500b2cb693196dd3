"""The chat tab's behaviour, without its layout: sending, streaming, stop, retry, continue, edit,
documents and the context meter. Every handler returns a `View` of what changed (`chat_view`);
`ui_chat_page.render` draws views onto components. The over-limit choices live in `chat_over_limit`
(`ui.py` calls them with this `ChatLogic`), leaving turns out unasked in `chat_follow_up`, the last
answer's versions and continuations in `chat_versions`, the list of conversations in `chat_list`,
whose calls `ChatLogic` hands on.

The conversation on disk is the source of truth: a question is saved before its answer starts,
the answer is saved as it streams and when it ends, each write atomic. A server killed in the
middle of an answer loses at most that answer's last seconds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from pathlib import Path
from typing import Iterator

from ..core.errors import InputError, SpecchatError
from . import answer_turns
from . import chat_follow_up as follow_up
from . import chat_over_limit as over_limit
from . import chat_versions as versions
from .chat_list import ConversationList
from .chat_view import Settings, View, problem_text
from .context_meter import Meter, describe, document_text, measure, turn_in_preparation
from .answer_job import ConversationKv, answer_job, conversation_kv
from .answer_stream import STARTING, answer_views, cut_by_error
from .conversation import (PASTED_NAME, Conversation, attachment_label, model_messages, shown_messages,
                           title_from)
from .document_formats import textless_note
from .documents import read_document, well_formed
from .edited_question import edited_question
from .engine_handle import EngineHandle
from .engine_queue import Ticket
from .history import ConversationChanged, HistoryStore
from .parts_clock import Pace
from .safe_markdown import inert_markdown

LOADING_POLL_SECONDS = 0.5


class ChatLogic:
    def __init__(self, handle: EngineHandle, store: HistoryStore, registry_file: str | None = None):
        self.handle = handle
        self.store = store
        self.registry_file = registry_file
        self._cancels: dict[str, Ticket] = {}  # per browser session: its answer, for Stop
        self._waits: dict[str, threading.Event] = {}  # per browser session: a question waiting for the model
        self.conversations = ConversationList(store)
        self.pace: Pace | None = None  # the latest answer's reading and writing speed (parts_clock.py)

    def stop(self, session: str) -> None:
        """Stop the session's answer: it ends at the next token, saved, with its figures (or
        leaves the line, if it was still waiting)."""
        ticket = self._cancels.get(session)
        if ticket is not None:
            ticket.cancel()
        waiting = self._waits.get(session)
        if waiting is not None:
            waiting.set()

    def submit(self, session: str, messages: list[dict], max_new_tokens: int, settings: Settings,
               kept: ConversationKv | None = None, continued: bool = False) -> Ticket:
        """An answer to `messages` (or their last answer `continued`) put in the engine's line as the
        session's, for `stop` to cancel."""
        ticket = self._cancels[session] = self.handle.submit(
            answer_job(messages, max_new_tokens, settings.sampling(), settings.mode, kept, continued))
        return ticket

    def release(self, session: str, ticket: Ticket) -> None:
        """Close the ticket (the engine is freed of it); `stop` no longer reaches it."""
        if self._cancels.get(session) is ticket:
            del self._cancels[session]
        ticket.close()

    @contextlib.contextmanager
    def waiting(self, session: str) -> Iterator[threading.Event]:
        """An event that the session's `stop` sets, for the work before an answer (a model that
        loads, a document's parts summarized)."""
        stopped = self._waits[session] = threading.Event()
        try:
            yield stopped
        finally:
            if self._waits.get(session) is stopped:
                del self._waits[session]

    # --- documents and the meter -------------------------------------------------------------

    def attach_file(self, path: str | None) -> View:
        if not path:
            return View()
        try:
            text = read_document(path)
        except InputError as error:  # named as the user knows it, not by the upload folder's path
            raise InputError(str(error).replace(str(path), Path(path).name)) from None
        return View(attachment=self.attach(Path(path).name, text),
                    status=f"Attached {Path(path).name}." + textless_note(text))

    def pasted_chip(self, pasted: str) -> str:
        """The attachment line for pasted text, as a file gets one ("" when nothing is pasted)."""
        pasted = well_formed(pasted or "")
        if not pasted.strip():
            return ""
        counted = self.handle.status() == "ready"
        document = {"name": PASTED_NAME, "text": pasted, "note": "",
                    "tokens": self.handle.get().count_tokens(pasted.strip()) if counted else None}
        return attachment_label(document)

    def attach(self, name: str, text: str, note: str = "") -> dict:
        """A document's text as the attachment a question carries, its tokens counted; while no
        model is ready (loading, or failed) not yet: never wait for a model to attach a file."""
        text = well_formed(text)
        tokens = self.handle.get().count_tokens(text) if self.handle.status() == "ready" else None
        return {"name": name, "text": text, "tokens": tokens, "note": note}

    def with_pasted(self, attachment: dict | None, pasted: str | None) -> dict | None:
        """The attachment, or pasted text made one (an uploaded file wins), its tokens counted."""
        if attachment is None and pasted and pasted.strip():
            return self.attach(PASTED_NAME, pasted.strip())
        if attachment is not None and attachment.get("tokens") is None:  # attached while the model loaded
            return self.attach(attachment["name"], attachment["text"], attachment.get("note", ""))
        return attachment

    def meter(self, conversation: Conversation | None, attachment: dict | None, pasted: str, message: str,
              settings: Settings) -> Meter:
        engine = self.handle.get()
        document, question = well_formed(document_text(attachment, pasted)), well_formed(message or "")
        asked = turn_in_preparation(conversation, document)
        if asked is not None:  # the question and its document are in the chat already: count them once
            conversation, question = asked
        history = [m for m in model_messages(conversation) if m["role"] != "system"] if conversation else []
        return measure(engine, settings.system, history, document, question, int(settings.max_new_tokens))

    def meter_text(self, conversation, attachment, pasted, message, settings) -> str:
        if self.handle.status() != "ready":
            return "Context: counted once the model is loaded."
        return describe(self.meter(conversation, attachment, pasted, message, settings))

    # --- sending -------------------------------------------------------------------------------

    def send(self, message: str, attachment: dict | None, pasted: str, conversation: Conversation | None,
             settings: Settings, session: str = "") -> Iterator[View]:
        question, pasted = well_formed(message or "").strip(), well_formed(pasted or "")
        if not question and attachment is None and not pasted.strip():
            yield View(status="Type a question or attach a document.")
            return
        settings.sampling()  # a bad setting (a seed of "abc") is refused before the question is saved
        changed = ""
        if conversation is not None:  # this tab's copy may be older than the file: the question follows the file
            try:
                saved = self.store.current(conversation)
            except ConversationChanged as gone:
                yield View(status=problem_text(gone), message=question)
                return
            if saved is not conversation and not answer_turns.only_written_on(conversation, saved):
                changed = ("ℹ️ This conversation had changed since it was shown (another tab, or an answer that "
                           "ended later): your question follows its saved turns.")
            conversation = saved
        named = ""  # given to the conversation while the model loaded
        if self.handle.status() == "loading":
            named = yield from self._wait_for_the_model(question, attachment, pasted, conversation, settings, session)
            if named is None:
                return
        attachment = self.with_pasted(attachment, pasted)
        kept = [*conversation.messages] if conversation else []  # what a failed save puts back
        meter = self.meter(conversation, attachment, "", question, settings)
        left_out = follow_up.make_room(self, conversation, attachment, question, settings) if meter.over else ""
        if meter.over and not left_out:
            offer = over_limit.offer(self, meter, attachment, question, conversation, settings)
            yield dataclasses.replace(offer, message=question, conversation=conversation,
                                      clear_conversation=conversation is None)
            return
        conversation = conversation or self.store.new(settings.system, settings.preset)
        conversation.system, conversation.preset = settings.system, settings.preset
        conversation.settings = settings.kept()
        if not conversation.messages:
            conversation.title = named or title_from(question, attachment)
        conversation.messages.append({"role": "user", "content": question, "document": attachment})
        try:
            self.store.save(conversation)  # the question is on disk before the answer starts
        except SpecchatError:  # not saved: the question stays in the box, and only there
            conversation.messages[:] = kept
            raise
        note = " ".join(filter(None, [changed, left_out]))
        yield View(conversation=conversation, message="", clear_attachment=True, pasted="", over_limit="",
                   conversations_changed=True, status=note)
        yield from follow_up.noted(self._answer(conversation, settings, session), note)

    def _wait_for_the_model(self, question: str, attachment: dict | None, pasted: str, conversation: Conversation | None,
                            settings: Settings, session: str) -> Iterator[View]:
        """While the model loads, the question shows in the chat at once, its answer's bubble
        saying so, and it is saved: a tab closed meanwhile leaves it in its conversation, to
        answer once reopened. Whatever the wait's end, with the page still there the saved question
        comes back out: `send` saves it again with its document's tokens counted, or puts it back in
        the box (a failed load, Stop, too long). The name given meanwhile ("" for none) once the model
        is ready, else None."""
        document = attachment or ({"name": PASTED_NAME, "text": pasted, "tokens": None} if (pasted or "").strip()
                                  else None)
        asked = self._asked(conversation, question, document, settings)
        problem = self._save_after_error(asked)
        shown_turn = dataclasses.replace(asked, messages=[*asked.messages, {"role": "assistant", "content": "",
                                                                            "partial": True}])
        with self.waiting(session) as stopped:
            while self.handle.status() == "loading" and not stopped.is_set():
                progress = self.handle.progress()
                yield View(conversation=shown_turn, streaming=True, message="", status=problem,
                           pending="⏳ *Loading the model, then this answer starts…* " + inert_markdown(progress))
                stopped.wait(LOADING_POLL_SECONDS)
        named = answer_turns.renamed_meanwhile(self.store, asked)
        # The disk as it was: the conversation itself, or no file for a new one.
        if conversation is not None:
            conversation.revision, conversation.title = asked.revision, asked.title  # its file's latest copy
        self._save_after_error(conversation if conversation else dataclasses.replace(asked, messages=[]))
        back = View(conversation=conversation, clear_conversation=conversation is None, message=question)
        if stopped.is_set():
            yield dataclasses.replace(back, status="Stopped while the model loaded: your question is back in the box.")
            return None
        try:
            self.handle.get()
        except SpecchatError as error:
            yield dataclasses.replace(back, status=problem_text(error))
            return None
        return named

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

    def shown_turn(self, conversation: Conversation | None, question: str, document: dict | None) -> Conversation:
        """A copy of the conversation with the question and its empty answer, shown while work that
        comes before the answer (loading, summarizing parts) runs; nothing of it is saved."""
        return Conversation(**{**dataclasses.asdict(conversation or self.store.new()), "messages": [
            *(conversation.messages if conversation else []),
            {"role": "user", "content": question, "document": document},
            {"role": "assistant", "content": "", "partial": True}]})

    def regenerate(self, conversation: Conversation | None, settings: Settings, session: str = "") -> Iterator[View]:
        """A new version of the last answer; the earlier ones stay, to page through (`chat_versions`)."""
        if (stale := self.conversations.as_saved(conversation)) is not None:
            yield stale
            return
        if conversation is None or not conversation.messages:
            yield View(status="Nothing to regenerate yet.")
            return
        restore = [*conversation.messages]  # no new answer (stopped in the line, an error): the old one stays
        old = versions.last_answer(conversation)
        asked = len(conversation.messages) - (1 if old is None else 2)  # the question, asked again
        fits, note = follow_up.room_to_ask_again(self, conversation, asked, conversation.messages[asked]["content"],
                                                 settings)
        if not fits:
            yield View(conversation=conversation, status=note)
            return
        if old is not None:  # else a question left unanswered (an error, a stop in the line): its first answer
            conversation.messages[-1] = versions.retried(old)
        yield from follow_up.noted(self._answer(conversation, settings, session, restore if old else None), note)

    def continue_answer(self, conversation: Conversation | None, settings: Settings,
                        session: str = "") -> Iterator[View]:
        """Carry the last answer on from its last word, in the same message: one cut at the answer
        limit, stopped, or cut short by an error (`chat_versions.can_continue`)."""
        if (stale := self.conversations.as_saved(conversation)) is not None:
            yield stale
            return
        if not versions.can_continue(conversation):
            yield View(status="Only an answer cut at the answer limit, stopped or cut by an error can be continued.")
            return
        restore = [*conversation.messages[:-1], copy.deepcopy(conversation.messages[-1])]
        conversation.messages[-1]["partial"] = True
        conversation.messages[-1].pop("error", None)  # how it was cut goes: it ends anew
        yield from self._answer(conversation, settings, session, restore)

    def page_version(self, conversation: Conversation | None, step: int) -> View:
        """Show another version of the last answer (the conversation goes on from the one shown)."""
        if (stale := self.conversations.as_saved(conversation)) is not None:
            return stale
        answer = versions.last_answer(conversation)
        if answer is None or not answer.get("versions"):
            return View(status="This answer has no other version.")
        conversation.messages[-1] = versions.paged(answer, step)
        self.store.save(conversation)
        return View(conversation=conversation, status="", **versions.figures(conversation.messages[-1]))

    def edit(self, conversation: Conversation | None, index: int, text: str, settings: Settings,
             session: str = "") -> Iterator[View]:
        """Replace the question at `index` (its document stays) and answer it again; the turns
        after it go, as in any chat app that edits a question."""
        if (stale := self.conversations.as_saved(conversation)) is not None:
            yield stale
            return
        if conversation is None or not 0 <= index < len(conversation.messages) \
                or conversation.messages[index]["role"] != "user":
            yield View(conversation=conversation, status="Only your own messages can be edited.")
            return
        settings.sampling()  # a bad setting is refused before the turns after the edit go
        content = edited_question(conversation.messages[index]["content"],
                                  shown_messages(conversation)[index]["content"], well_formed(text))
        fits, note = follow_up.room_to_ask_again(self, conversation, index, content, settings)
        if not fits:  # the later turns stay; the edit waits in the box
            yield View(conversation=conversation, message=content, status=f"{note} Your edit is in the message box.")
            return
        edited = dict(conversation.messages[index], content=content)
        edited.pop("left_out", None)  # a question asked again is read again
        conversation.messages[index:] = [edited]
        self.store.save(conversation)
        yield from follow_up.noted(self._answer(conversation, settings, session), note)

    def _answer(self, conversation: Conversation, settings: Settings, session: str,
                restore: list[dict] | None = None) -> Iterator[View]:
        """Answer into the conversation's last message when `restore` is given (a retry's new
        version, or an answer continued: its text so far the start of the assistant's turn), else
        into a new one; with no answer (an error before its first word, a Stop while it waited) the
        messages go back to `restore` (by default, as they were)."""
        if restore is None:
            restore = [*conversation.messages]
            conversation.messages.append({"role": "assistant", "content": "", "partial": True, "stats": None,
                                          "origins": []})
        reply = conversation.messages[-1]
        start = reply["content"]  # "" unless the answer is continued
        ticket = None
        # Until its last save: meanwhile another tab, a reload or an export shows it as being written.
        with self.store.live_answers.writing(conversation.id) as turn:
            try:
                # The previous answer's figures go as this one starts: a stale "done" misleads.
                yield View(conversation=conversation, streaming=True, stats="", stages="", tokens="",
                           pending=STARTING)
                # A browser session answers one question at a time: an earlier answer it left without
                # closing (the page moved on to another conversation) gives the engine up now.
                self.stop(session)
                with self.waiting(session) as stopped:  # another tab's answer here first: this one reads it whole
                    yield from answer_turns.after_earlier_answers(self.store, conversation, restore, turn, stopped)
                ticket = None if stopped.is_set() else self.submit(
                    session, model_messages(conversation), int(settings.max_new_tokens), settings,
                    conversation_kv(conversation), continued=bool(start))
                result = (yield from answer_views(conversation, reply, ticket, self.store, start)) if ticket else None
                self.pace = (Pace.of(result) if result else None) or self.pace  # what summarizing in parts is estimated by
                if reply["partial"]:  # stopped while it waited (another answer, the engine's line): the question stays
                    answer_turns.taken_back(self.store, conversation, restore)
                    reply["partial"] = False
                    yield View(conversation=conversation, status=answer_turns.STOPPED)
            except Exception as error:  # shown in the page, never as a traceback; the question stays
                if reply["content"] == start:  # nothing said is no answer: the question stays, to retry
                    conversation.messages[:] = restore
                cut_by_error(reply, error, start)  # what was said reads as cut short, in every view of it
                also = "" if isinstance(error, ConversationChanged) else self._save_after_error(conversation, reply)
                yield View(conversation=conversation, status=" ".join(filter(None, [problem_text(error), also])))
            finally:
                # An error, or the page went away mid-answer: the engine is freed now, what was said kept.
                if ticket is not None:
                    self.release(session, ticket)
                if reply["partial"]:
                    reply.update(partial=False, finish_reason="cancelled")
                    self._save_after_error(conversation, reply)

    def _save_after_error(self, conversation: Conversation, answer: dict | None = None) -> str:
        """Save on a path that is already ending badly: a failure here (a full disk) becomes a
        line for the page instead of a second error over the first; "" when the save worked.
        `answer`: the message being written, merged into a newer copy if there is one."""
        try:
            if any(message is answer for message in conversation.messages):
                self.store.save_answer(conversation, answer)
            else:
                self.store.save(conversation)
        except SpecchatError as error:
            return problem_text(error)
        return ""

    # --- conversations: `chat_list` -------------------------------------------------------------

    def conversation_choices(self, query: str = "") -> list[tuple[str, str]]:
        return self.conversations.choices(query)

    def open(self, conversation_id: str | None) -> View:
        return self.conversations.open(conversation_id)

    def newest(self) -> View:
        return self.conversations.newest()

    def rename(self, conversation: Conversation | None, title: str) -> View:
        return self.conversations.rename(conversation, title)

    def delete(self, conversation: Conversation | None) -> View:
        view = self.conversations.delete(conversation)
        if view.deleted:  # its KV in memory goes now; an undelete reads its saved document again
            self.handle.forget(view.deleted)
        return view

    def undelete(self, conversation_id: str | None) -> View:
        return self.conversations.undelete(conversation_id)

    def export(self, conversation: Conversation | None) -> list[str]:
        return self.conversations.export(conversation)

