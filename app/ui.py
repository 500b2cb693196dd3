"""The Gradio app: the chat tab (conversations, documents, context meter, live speculation view,
settings) and the models & hardware tab (served with the API by server.py).

Wiring only: the chat tab's layout is `ui_chat_page`, its behaviour `ui_chat.ChatLogic` (the
models tab's, `ui_models`); handlers return `View`s that `ui_chat_page.render` draws onto the page's
components by name. Errors become a line in the page.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import TYPE_CHECKING

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from . import chat_over_limit as over_limit  # noqa: E402
from .chat_drafts import kept as kept_draft  # noqa: E402
from .chat_drafts import restored as restored_draft  # noqa: E402
from .draft_store import DraftStore  # noqa: E402
from .chat_view import Settings, View, problem_text  # noqa: E402
from .engine_handle import EngineHandle  # noqa: E402
from .history import HistoryStore  # noqa: E402
from .model_notice import ModelNotice  # noqa: E402
from .presets import PRESETS  # noqa: E402
from .security import uploaded_file  # noqa: E402
from .ui_chat import ChatLogic  # noqa: E402
from .ui_chat_page import ChatPage, chat_page, render  # noqa: E402
from .ui_models import PAIRS_TABLE_CSS  # noqa: E402

if TYPE_CHECKING:
    from .pair_download import PairDownload

MODEL_LINE_SECONDS = 2.0  # how often the Chat tab's model line is read again (loading, switching)
QUIET = {"show_progress": "hidden"}  # the status line and the streaming text show progress
LIGHT = {"show_progress": "hidden", "concurrency_id": "light", "concurrency_limit": 4}  # never behind an answer
# One count at a time, in the order asked: a slow count of an earlier text (a long document
# just replaced) finishing after the newer one would leave the meter showing what is gone.
METERING = {"show_progress": "hidden", "concurrency_id": "meter", "concurrency_limit": 1}
# Reading an attached file: up to its reader's time limit (app/document_worker.py), so never in
# the light line that open, rename and New share.
READING = {"show_progress": "hidden", "concurrency_id": "reading", "concurrency_limit": 2}
# Dark mode follows the visitor's last choice (kept in the browser), else the system's.
DARK_MODE_JS = """() => { const dark = !document.body.classList.contains('dark');
  document.body.classList.toggle('dark', dark); localStorage.setItem('specchat-dark', dark ? '1' : '0'); }"""
# The chat takes the height the window leaves, so the message box stays in view on a 680-800 px
# laptop window. Below 900 px the conversations sidebar goes above the chat, which keeps the whole
# width; table cells break between words, never inside one (the models table scrolls sideways
# where a word would not fit); the answer's "‹ 2/3 ›" stays together.
APP_CSS = PAIRS_TABLE_CSS + """
#chat { height: max(260px, calc(100vh - 410px)) !important; }
@media (max-width: 900px) {
  #chat-row { flex-direction: column !important; }
  #sidebar, #main-column { width: 100% !important; min-width: 0 !important; flex: 1 1 auto !important; }
  #conversations { max-height: 9em; overflow-y: auto; }
}
table td, table th, table td *, table th *, #pairs span.text {
  word-break: normal !important; overflow-wrap: normal !important; hyphens: none; }
#exported .download { min-width: 0 !important; width: auto !important; }
#exported .filename { display: block !important; word-break: break-all !important; }
#exported .filename .stem, #exported .filename .ext { white-space: normal !important; word-break: break-all !important; }
#version-label { flex: 0 0 auto !important; width: auto !important; align-self: center; }
"""
# Gradio 6.31's status tracker leaves a 60 Hz requestAnimationFrame loop running for the page's life
# (and runs one per output of an event while it runs), CPU taken from the engine on a small machine
# (bench/notes/page-streaming.md). So an animation loop that has run for a second goes on at 4 frames
# a second; one-off frames and short animations are untouched, and a hidden tab keeps the browser's
# own pause of frames. Put first in the page (`page_head`).
SLOW_LONG_ANIMATION_LOOPS = """<script>
(() => {
  const frame = window.requestAnimationFrame.bind(window), cancelFrame = window.cancelAnimationFrame.bind(window);
  const waiting = new Map();
  let last = 0, loopStart = null;  // when the loop whose frame is running first ran; null outside frames
  window.requestAnimationFrame = (callback) => {
    const id = ++last, inherited = loopStart;
    const run = (time) => { waiting.delete(id); loopStart = inherited ?? performance.now();
                            try { callback(time); } finally { loopStart = null; } };
    const slowed = inherited !== null && !document.hidden && performance.now() - inherited > 1000;
    waiting.set(id, slowed ? [clearTimeout, setTimeout(() => run(performance.now()), 250)] : [cancelFrame, frame(run)]);
    return id;
  };
  window.cancelAnimationFrame = (id) => {
    const handle = waiting.get(id);
    if (handle) { waiting.delete(id); handle[0](handle[1]); }
  };
})();
</script>"""
RESTORE_DARK_MODE_JS = """() => { const saved = localStorage.getItem('specchat-dark');
  if (saved !== null) document.body.classList.toggle('dark', saved === '1'); }"""
# Escape stops the answer, as in other chat apps: a click on Stop, which does nothing when none runs.
# Escape in another field (a list open, the search box) closes or leaves that field: it stopped the answer too.
ESCAPE_STOPS_JS = """() => { document.addEventListener('keydown', (event) => {
  if (event.key !== 'Escape' || event.defaultPrevented) return;
  const focus = document.activeElement;
  if (focus?.matches('input, textarea, select, [contenteditable="true"]') && !focus.closest('#message')) return;
  document.querySelector('#stop')?.click(); }); }"""


def build_ui(handle: EngineHandle, store: HistoryStore, registry_file: str | None = None) -> gr.Blocks:
    from .pair_download import PairDownload
    from .ui_models import build_models_tab

    logic = ChatLogic(handle, store, registry_file)
    downloads = PairDownload()  # one download at a time, whichever tab starts it
    model_status = ModelNotice(handle, registry_file, downloads)
    with gr.Blocks(title="specchat") as demo:
        page = chat_page(model_status.line)
        with gr.Tab("Models & hardware") as models_tab:
            build_models_tab(handle, registry_file, downloads, shown_by=(models_tab, [page.tab]))
        handlers = _ChatHandlers(page, logic)
        cancelled_by_leaving = _wire_answers(page, logic, handlers)
        _wire_conversations(demo, page, logic, handlers, cancelled_by_leaving)
        _wire_model_line(page, model_status, downloads)
        page.dark.click(None, js=DARK_MODE_JS)
        demo.load(None, js=RESTORE_DARK_MODE_JS)
        demo.load(None, js=ESCAPE_STOPS_JS)
    return demo


class _ChatHandlers:
    """The chat tab's event handlers: each draws its `View`s onto `page.outputs` (`render`), and an
    error becomes a line in the page."""

    def __init__(self, page: ChatPage, logic: ChatLogic):
        self.page, self.logic = page, logic
        self.drafts_on_disk = DraftStore(logic.store.folder.parent / "drafts")

    def draw(self, view: View) -> dict:
        return render(self.page, view, self.logic.conversation_choices, self.logic.store.live_answers)

    def streamed(self, views):
        """A handler's stream of views, rendered; an error ends it as a line in the page, and an
        over-limit panel shown before it goes (its choices were for what failed)."""
        try:
            with contextlib.closing(views()) as stream:
                for view in stream:
                    yield self.draw(view)
        except Exception as error:
            yield self.draw(View(status=problem_text(error), over_limit=""))

    def once(self, handler):
        """A one-shot handler's view, rendered; an error becomes a line in the page."""
        def run(*args):
            try:
                return self.draw(handler(*args))
            except Exception as error:
                return self.draw(View(status=problem_text(error)))
        return run

    def moving(self, handler):
        """A handler that shows another conversation (`once`): the one left keeps what was typed,
        attached and pasted in it, and the one shown gets its own back (`chat_drafts`)."""
        def run(drafts, chat, box, attached, pasted_text, preset, *args):
            drafts = kept_draft(drafts, chat, typed(box), attached, pasted_text)
            try:
                view, drafts = restored_draft(handler(*args), drafts, PRESETS.get(preset, PRESETS["free"]).question,
                                              left_new=chat is None)
            except Exception as error:
                view = View(status=problem_text(error))
            return {**self.draw(view), self.page.drafts: drafts}
        return run

    def save_drafts(self, browser, drafts, chat, box, attached, pasted_text) -> None:
        """The drafts on disk as the page holds them (nothing before the page load gave the id)."""
        if browser and self.drafts_on_disk.browser(browser) == browser:
            self.drafts_on_disk.save(browser, kept_draft(drafts, chat, typed(box), attached, pasted_text))

    def restore_drafts(self, browser, chat, preset):
        """At a page load, after the newest conversation is shown: the browser's drafts from disk,
        the shown conversation's in the box (a reload or a server restart lost nothing typed)."""
        browser = self.drafts_on_disk.browser(browser)
        shown = View(conversation=chat) if chat is not None else View(clear_conversation=True)
        view, drafts = restored_draft(shown, self.drafts_on_disk.load(browser),
                                      PRESETS.get(preset, PRESETS["free"]).question, left_new=False)
        return {**self.draw(view), self.page.drafts: drafts, self.page.browser: browser}

    def choose_then_send(self, choose):
        """An over-limit choice (a cut, a shorter answer, leaving turns out), then the question sent
        as the choice left it; a choice that fails says why in the page and sends nothing."""
        def run(request: gr.Request, box, attached, pasted_text, chat, *values):
            def views():
                chosen = choose(typed(box), attached, pasted_text, chat, self.settings_of(values))
                yield chosen
                settings = dataclasses.replace(self.settings_of(values), **(chosen.settings or {}))
                yield from self.logic.send(
                    typed(box), attached if chosen.attachment is None else chosen.attachment,
                    pasted_text if chosen.pasted is None else chosen.pasted, chosen.conversation or chat,
                    settings, request.session_hash)
            yield from self.streamed(views)
        return run

    def settings_of(self, values) -> Settings:
        # A component inside a never-opened accordion may arrive as None: use its default.
        defaults = [component.value for component in self.page.settings_inputs]
        return Settings(*(default if value is None else value for value, default in zip(values, defaults)))

    # Gradio passes the request (for the session's Stop) and event data by these annotations.
    def send_message(self, request: gr.Request, box, attached, pasted_text, chat, *values):
        def views():
            # A file dropped just before sending may not have been attached by its change event yet.
            dropped = self.attach_dropped(box, attached)
            yield dropped
            if dropped.message is not None and dropped.attachment is None:  # a file that could not be read
                return
            yield from self.logic.send(typed(box), dropped.attachment or attached, pasted_text, chat,
                                       self.settings_of(values), request.session_hash)
        yield from self.streamed(views)

    def attach_dropped(self, box, attached: dict | None = None) -> View:
        """A file put in the message box (📎 or dropped) becomes the attachment, in place of the one
        `attached` (a question carries one document), saying so; the box keeps the text. A file
        that cannot be read leaves the box, saying why: left there, it failed every Send."""
        files = (box or {}).get("files") or []
        if not files:
            return View()
        # Only a file that came through Gradio's upload: the event's path is whatever the client sends.
        path = files[-1] if isinstance(files[-1], str) else files[-1].get("path")
        try:
            view = self.logic.attach_file(uploaded_file(path))
        except Exception as error:
            return View(status=f"{problem_text(error)} It was taken out of the message box; your text stays.",
                        message=typed(box))
        view.message = typed(box)
        if attached is not None:
            name = view.attachment["name"]
            view.status = view.status.replace(f"Attached {name}.", f"Attached {name} in place of {attached['name']}.", 1)
        return view

    def again(self, handler):
        """An answer to the conversation as it stands: Retry (`logic.regenerate`), Continue."""
        def run(request: gr.Request, chat, *values):
            yield from self.streamed(lambda: handler(chat, self.settings_of(values), request.session_hash))
        return run

    def edit(self, request: gr.Request, edited: gr.EditData, chat, *values):
        yield from self.streamed(lambda: self.logic.edit(chat, edited.index, str(edited.value),
                                                         self.settings_of(values), request.session_hash))

    def summarize_in_parts(self, request: gr.Request, box, attached, pasted_text, chat, *values):
        yield from self.streamed(lambda: over_limit.summarize_in_parts(
            self.logic, typed(box), attached, pasted_text, chat, self.settings_of(values), request.session_hash))

    def stop_answer(self, request: gr.Request):
        self.logic.stop(request.session_hash)

    def pasted_chip(self, attached, pasted_text):
        """The attachment line for pasted text; an attached file's line stays."""
        try:
            return gr.update() if attached else self.logic.pasted_chip(pasted_text)
        except Exception as error:
            return problem_text(error)

    def update_meter(self, chat, attached, pasted_text, box, *values):
        try:
            return self.logic.meter_text(chat, attached, pasted_text, typed(box), self.settings_of(values))
        except Exception as error:
            return problem_text(error)


def _wire_answers(page: ChatPage, logic: ChatLogic, on: _ChatHandlers) -> list:
    """Asking, the over-limit choices, Stop, and what recounts the meter; returns the events that
    leaving the conversation cancels: those that answer, and reading a file put in the box."""
    outputs, settings_inputs = page.outputs, page.settings_inputs
    send_inputs, meter_inputs = page.send_inputs, page.meter_inputs
    answering = [trigger(on.send_message, send_inputs, outputs, **QUIET)
                 for trigger in (page.message.submit, page.send.click)]
    chat_inputs = [page.conversation, *settings_inputs]
    answering.append(page.chatbot.retry(on.again(logic.regenerate), chat_inputs, outputs, **QUIET))
    answering.append(page.chatbot.edit(on.edit, chat_inputs, outputs, **QUIET))
    answering.append(page.go_on.click(on.again(logic.continue_answer), chat_inputs, outputs, **QUIET))
    # The over-limit choices each change what is sent, then send it: the question and document are kept.
    choices = {button: functools.partial(over_limit.cut, logic, where) for where, button in page.cut_buttons.items()}
    choices |= {page.shorter: functools.partial(over_limit.shorter_answer, logic),
                page.leave_out: functools.partial(over_limit.leave_out_turns, logic)}
    answering += [button.click(on.choose_then_send(choose), send_inputs, outputs, **QUIET)
                  for button, choose in choices.items()]
    answering.append(page.in_parts.click(on.summarize_in_parts, send_inputs, outputs, **QUIET))
    for event in answering:
        event.then(on.update_meter, meter_inputs, page.meter, **METERING)
    for button, step in ((page.older, -1), (page.newer, 1)):  # paging a version saves: never behind an answer
        button.click(on.once(functools.partial(logic.page_version, step=step)), page.conversation, outputs,
                     **LIGHT).then(on.update_meter, meter_inputs, page.meter, **METERING)
    # Stop ends the answer gracefully (saved, with its figures); it skips the queue, which an answer holds.
    page.stop.click(on.stop_answer, None, None, queue=False)

    for box in (page.pasted, page.max_new_tokens, page.system):
        box.change(on.update_meter, meter_inputs, page.meter, trigger_mode="always_last", **METERING)
    # Typing recounts the meter; a file put in the box is attached first, then counted.
    reading = page.message.change(on.once(on.attach_dropped), [page.message, page.attachment], outputs,
                                  trigger_mode="always_last",
                                  **READING)
    reading.then(on.update_meter, meter_inputs, page.meter, **METERING)
    pasting = page.pasted.change(on.pasted_chip, [page.attachment, page.pasted], page.attachment_line,
                                 trigger_mode="always_last", **LIGHT)
    detaching = page.detach.click(lambda: (None, "", ""), None, [page.attachment, page.attachment_line, page.pasted])
    detaching.then(on.update_meter, meter_inputs, page.meter, **METERING)
    # What is typed, attached or pasted is kept on disk as it changes (a send empties the box: its draft goes).
    drafted = [page.browser, page.drafts, page.conversation, page.message, page.attachment, page.pasted]
    for event in (reading, pasting, detaching):
        event.then(on.save_drafts, drafted, None, **LIGHT)
    page.switch.click(on.once(functools.partial(over_limit.switch_pair, logic.handle, logic.registry_file)),
                      page.longer_pairs, outputs)
    page.color.change(lambda colored: gr.update(visible=colored), page.color, page.tokens)
    page.preset.change(_preset_chosen, [page.preset, page.message, page.conversation],
                       [page.system, page.message, page.temperature, page.top_p, page.repetition_penalty])
    # A file still being read when another conversation opens would land there when read.
    return [*answering, reading]


def _wire_conversations(demo: gr.Blocks, page: ChatPage, logic: ChatLogic, on: _ChatHandlers,
                        cancelled_by_leaving: list) -> None:
    """New, open, rename, delete and undo, export, and the newest conversation at each page load."""
    outputs, meter_inputs = page.outputs, page.meter_inputs
    # Moving to another conversation keeps the draft of the one left (`_ChatHandlers.moving`).
    leaving = [page.drafts, page.conversation, page.message, page.attachment, page.pasted, page.preset]
    moved = [*outputs, page.drafts]
    # The chat's own Clear starts afresh too; nothing is deleted.
    for clear in (page.new.click, page.chatbot.clear):
        clear(on.moving(lambda: View(clear_conversation=True, conversations_changed=True, status="", stats="",
                                     stages="", tokens="", over_limit="")), leaving, moved, cancels=cancelled_by_leaving,
              **LIGHT).then(on.update_meter, meter_inputs, page.meter, **METERING)
    page.conversations.input(on.moving(logic.open), [*leaving, page.conversations], moved, cancels=cancelled_by_leaving,
                             **LIGHT).then(on.update_meter, meter_inputs, page.meter, **METERING)
    page.search.change(lambda query: gr.update(choices=logic.conversation_choices(query)), page.search,
                      page.conversations, trigger_mode="always_last", **LIGHT)
    page.rename.click(on.once(logic.rename), [page.conversation, page.title], outputs, **LIGHT)
    page.delete.click(on.moving(logic.delete), [*leaving, page.conversation], moved, cancels=cancelled_by_leaving,
                      **LIGHT).then(on.update_meter, meter_inputs, page.meter, **METERING)
    page.undo.click(on.moving(logic.undelete), [*leaving, page.deleted], moved, **LIGHT).then(
        on.update_meter, meter_inputs, page.meter, **METERING)
    page.export.click(_exporter(logic), page.conversation, [page.exported, page.status])
    # Leaving a running answer (new, open, delete) cancels its Gradio event, which abandons the
    # answer without closing it: cancel its ticket too, so the engine moves on at once instead of
    # after the line's stall backstop.
    for leave in (page.new.click, page.chatbot.clear, page.conversations.input, page.delete.click):
        leave(on.stop_answer, None, None, queue=False)
        # Another conversation's export files are not this one's: they go.
        leave(lambda: gr.update(value=None, visible=False), None, page.exported, **LIGHT)
    demo.load(on.once(logic.newest), None, outputs).then(
        on.restore_drafts, [page.browser, page.conversation, page.preset], [*outputs, page.drafts, page.browser],
        **LIGHT).then(on.update_meter, meter_inputs, page.meter, **METERING)


def _wire_model_line(page: ChatPage, model_status: ModelNotice, downloads: PairDownload) -> None:
    """The chat tab's model line, read again every `MODEL_LINE_SECONDS`, and its download offer."""

    def model_state():
        return model_status.line(), gr.update(visible=model_status.offers_download()
                                              and not downloads.downloading(model_status.recommended.id))

    gr.Timer(MODEL_LINE_SECONDS).tick(model_state, None, [page.model_line, page.get_pair], **LIGHT)

    def get_recommended():
        try:
            return model_status.get_recommended() or ""
        except Exception as error:  # a line in the page, as every chat handler's error is
            return problem_text(error)

    page.get_pair.click(get_recommended, None, page.status, **LIGHT).then(
        model_state, None, [page.model_line, page.get_pair], **LIGHT)


def typed(box) -> str:
    """The text in the message box (a MultimodalTextbox: {"text", "files"}; a string from the API)."""
    return (box.get("text") or "") if isinstance(box, dict) else str(box or "")


def _preset_chosen(key: str, box, chat) -> tuple:
    """The system prompt, message box, temperature, top-p and repetition penalty for a preset. The
    conversation's own preset (set as it is opened) keeps its own system prompt and settings,
    which may have been edited, and adds no question."""
    text = typed(box)
    if chat is not None and chat.preset == key:  # back from another preset: this conversation's own settings
        own = [chat.settings.get(name) for name in ("temperature", "top_p", "repetition_penalty")]
        return chat.system, {"text": text, "files": []}, *(gr.update() if value is None else value for value in own)
    preset = PRESETS[key]
    return (preset.system, {"text": text or preset.question, "files": []}, preset.temperature, preset.top_p,
            preset.repetition_penalty)


def _exporter(logic: ChatLogic):
    def export(chat):
        try:
            return gr.update(value=logic.export(chat), visible=True), "Exported: download the files below the list."
        except Exception as error:
            return gr.update(visible=False), problem_text(error)
    return export
