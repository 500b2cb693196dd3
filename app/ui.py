"""The Gradio app: the chat tab (conversations, documents, context meter, live speculation view,
settings) and the models & hardware tab, served with the OpenAI-compatible API on one server,
behind one guard (security.py: known hosts, no cross-site writes, the key, bounded bodies).

Layout and wiring only: the behaviour lives in `ui_chat.ChatLogic` (and `ui_models`); handlers
return `View`s that `_render` maps onto components. Errors become a line in the page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import webbrowser
from typing import Callable, Iterable

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from ..core import limits  # noqa: E402
from ..core.modes import REQUEST_MODES  # noqa: E402
from .conversation import attachment_label  # noqa: E402
from .documents import DOCUMENT_SUFFIXES  # noqa: E402
from .engine_handle import EngineHandle  # noqa: E402
from .history import HistoryStore, default_folder  # noqa: E402
from .presets import PRESETS  # noqa: E402
from .security import Guard, uploaded_file  # noqa: E402
from .context_meter import ANSWER_STEP, CUTS  # noqa: E402
from .model_notice import ModelNotice  # noqa: E402
from .ui_chat import KEPT_SETTINGS, ChatLogic, Settings, View, problem_text, shown  # noqa: E402

DEFAULT_HOST = "127.0.0.1"
SHUTDOWN_GRACE_SECONDS = 1
MODEL_LINE_SECONDS = 2.0  # how often the Chat tab's model line is read again (loading, switching)
MODES = list(REQUEST_MODES)
# Dark mode follows the visitor's last choice (kept in the browser), else the system's.
DARK_MODE_JS = """() => { const dark = !document.body.classList.contains('dark');
  document.body.classList.toggle('dark', dark); localStorage.setItem('specchat-dark', dark ? '1' : '0'); }"""
# Below 900 px the conversations sidebar goes above the chat, which keeps the whole width; table
# cells break between words, never inside one.
APP_CSS = """
@media (max-width: 900px) {
  #chat-row { flex-direction: column !important; }
  #sidebar, #main-column { width: 100% !important; min-width: 0 !important; flex: 1 1 auto !important; }
  #conversations { max-height: 9em; overflow-y: auto; }
}
table td, table th, table td *, table th *, #pairs span.text {
  word-break: normal !important; overflow-wrap: normal !important; hyphens: none; }
#exported .file-name, #exported a { word-break: break-all; white-space: normal; }
"""
RESTORE_DARK_MODE_JS = """() => { const saved = localStorage.getItem('specchat-dark');
  if (saved !== null) document.body.classList.toggle('dark', saved === '1'); }"""


def build_ui(handle: EngineHandle, store: HistoryStore, registry_file: str | None = None) -> gr.Blocks:
    from .ui_models import PairDownload, build_models_tab

    logic = ChatLogic(handle, store, registry_file)
    downloads = PairDownload()  # one download at a time, whichever tab starts it
    model_status = ModelNotice(handle, registry_file, downloads)
    with gr.Blocks(title="specchat") as demo:
        conversation = gr.State(None)
        attachment = gr.State(None)
        deleted = gr.State("")  # the conversation just deleted, for Undo
        with gr.Row():
            gr.Markdown("## specchat\nLong-document chat, sped up by lossless speculative decoding.")
            dark = gr.Button("🌓 Dark mode", size="sm", scale=0, elem_id="dark-mode")
        with gr.Tab("Chat"):
            with gr.Row(elem_id="chat-row"):
                with gr.Column(scale=1, min_width=220, elem_id="sidebar"):
                    new = gr.Button("+ New conversation", size="sm", elem_id="new-conversation")
                    undo = gr.Button("↶ Undo the delete", size="sm", visible=False, elem_id="undo-delete")
                    preset = gr.Dropdown([(p.label, key) for key, p in PRESETS.items()], value="free",
                                         label="Preset", elem_id="preset")
                    conversations = gr.Radio([], label="Conversations", elem_id="conversations")
                    title = gr.Textbox(label="Name", placeholder="Rename this conversation", elem_id="title")
                    with gr.Row():
                        rename = gr.Button("Rename", size="sm", elem_id="rename")
                        delete = gr.Button("Delete", size="sm", variant="stop", elem_id="delete")
                    export = gr.Button("Export (Markdown + JSON)", size="sm", elem_id="export")
                    exported = gr.File(label="Exported", file_count="multiple", visible=False, elem_id="exported")
                with gr.Column(scale=4, min_width=320, elem_id="main-column"):
                    with gr.Row():
                        model_line = gr.Markdown(model_status.line, elem_id="model-line")  # drawn anew at each page load
                        get_pair = gr.Button("⬇ Download it and switch to it", size="sm", scale=0, min_width=200,
                                             visible=False, elem_id="get-recommended")
                    chatbot = gr.Chatbot(label="Chat", height=460, elem_id="chat", editable="user",
                                         buttons=["copy", "copy_all"])
                    status = gr.Markdown("", elem_id="status")
                    with gr.Group(visible=False, elem_id="over-limit") as over_group:
                        over_text = gr.Markdown("")
                        with gr.Row():
                            shorter = gr.Button("Answer in fewer tokens", size="sm", visible=False, elem_id="shorter-answer")
                            leave_out = gr.Button("✂ Leave earlier messages out (documents stay)", size="sm",
                                                  visible=False, elem_id="leave-out")
                            in_parts = gr.Button("📚 Summarize it in parts, then answer from the summaries "
                                                 "(not a whole-document reading)", size="sm", visible=False,
                                                 elem_id="in-parts")
                        with gr.Row():
                            cut_buttons = {where: gr.Button(f"Cut the {where}", size="sm", visible=False,
                                                            elem_id=f"cut-{where}") for where in CUTS}
                        with gr.Row(visible=False) as pairs_row:
                            longer_pairs = gr.Dropdown([], label="Longer-context pairs that fit this machine", scale=3,
                                                       elem_id="longer-pairs")
                            switch = gr.Button("Switch to this pair", size="sm", scale=1, elem_id="switch-pair")
                    with gr.Row():
                        # 📎 and drag-and-drop attach a document right at the box (`attach_dropped`).
                        message = gr.MultimodalTextbox(
                            placeholder="Ask about your document, or just chat (the clip attaches a file; "
                                        "so does dropping one here)",
                            show_label=False, scale=6, elem_id="message", autofocus=True, sources=["upload"],
                            file_types=list(DOCUMENT_SUFFIXES), file_count="single", submit_btn=False)
                        send = gr.Button("Send", variant="primary", scale=0, min_width=90, elem_id="send")
                        stop = gr.Button("Stop", variant="stop", scale=0, min_width=90, elem_id="stop")
                    attachment_line = gr.Markdown("", elem_id="attachment")
                    meter = gr.Markdown("", elem_id="meter")
                    stats = gr.Markdown("", elem_id="stats")
                    with gr.Accordion("Paste a document", open=False):
                        pasted = gr.Textbox(label=f"Paste a document's text here (or attach a file with the clip by the message box: "
                                                  f"{', '.join(DOCUMENT_SUFFIXES)})", lines=6, elem_id="document")
                        detach = gr.Button("Remove the document", size="sm", elem_id="detach")
                    with gr.Accordion("Speculation view", open=False, elem_id="speculation"):
                        color = gr.Checkbox(label="Color the answer's tokens by origin", value=False, elem_id="color-tokens")
                        stages = gr.Markdown("", elem_id="stages")
                        tokens = gr.HTML("", visible=False, elem_id="tokens")
                    with gr.Accordion("Settings", open=False, elem_id="settings"):
                        system = gr.Textbox("", label="System prompt", lines=3, elem_id="system")
                        with gr.Row():
                            temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                            top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p")
                            top_k = gr.Number(0, label="Top-k (0 = off)", precision=0, minimum=0)
                        with gr.Row():
                            max_new_tokens = gr.Slider(ANSWER_STEP, 4096, value=512, step=ANSWER_STEP,
                                                       label="Answer limit (tokens)",
                                                       elem_id="max-new-tokens")
                            seed = gr.Textbox("", label="Seed (blank = random)", elem_id="seed")
                        mode = gr.Radio(MODES, value="auto", label="Decoding", elem_id="mode")
        with gr.Tab("Models & hardware"):
            build_models_tab(handle, registry_file, downloads)

        settings_inputs = [system, preset, temperature, top_p, top_k, seed, max_new_tokens, mode]
        kept_settings = dict(zip(KEPT_SETTINGS, [temperature, top_p, top_k, seed, max_new_tokens, mode]))
        outputs = [conversation, chatbot, status, message, attachment, attachment_line, pasted, stats, stages,
                   tokens, over_group, over_text, shorter, leave_out, in_parts, *cut_buttons.values(), pairs_row,
                   longer_pairs,
                   conversations, title, system, preset, *kept_settings.values(), deleted, undo]

        def render(view: View) -> tuple:
            keep = gr.update()
            chat = view.conversation
            listing = gr.update(choices=logic.conversation_choices(), value=chat.id if chat else None) \
                if view.conversations_changed else keep
            attached = view.attachment if view.attachment is not None else None if view.clear_attachment else keep
            label = (attachment_label(attached) if attached else "") if attached is not keep else keep
            if view.clear_conversation:
                conversation_value, chat_value = None, []
            else:
                conversation_value = keep if chat is None else chat
                chat_value = keep if chat is None else shown(chat, view.streaming, view.pending)
            over = view.over_limit
            saved = view.settings or {}
            return (conversation_value, chat_value,
                    keep if view.status is None else view.status,
                    keep if view.message is None else {"text": view.message, "files": []},
                    attached, label,
                    keep if view.pasted is None else view.pasted,
                    keep if view.stats is None else view.stats,
                    keep if view.stages is None else view.stages,
                    keep if view.tokens is None else view.tokens,
                    keep if over is None else gr.update(visible=bool(over)),
                    keep if over is None else over,
                    keep if over is None else gr.update(
                        visible=bool(over and view.answer_room),
                        value=f"Answer in up to {view.answer_room:,} tokens (what fits)"),
                    keep if over is None else gr.update(visible=bool(over and view.can_leave_out)),
                    keep if over is None else gr.update(visible=bool(over and view.in_parts)),
                    *(keep if over is None else gr.update(visible=bool(over and view.cuts),
                                                          value=(view.cuts or {}).get(where, ""))
                      for where in cut_buttons),
                    keep if view.longer_pairs is None else gr.update(visible=bool(view.longer_pairs)),
                    keep if view.longer_pairs is None else gr.update(choices=view.longer_pairs, value=None),
                    listing,
                    "" if view.clear_conversation else keep if chat is None else chat.title,
                    keep if view.system is None else view.system,
                    keep if view.preset is None or view.preset not in PRESETS else view.preset,
                    *(saved[name] if name in saved else keep for name in kept_settings),
                    keep if view.deleted is None else view.deleted,
                    keep if view.deleted is None else gr.update(visible=bool(view.deleted)))

        def streamed(views):
            """A handler's stream of views, rendered; an error ends it as a line in the page."""
            try:
                with contextlib.closing(views()) as stream:
                    for view in stream:
                        yield render(view)
            except Exception as error:
                yield render(View(status=problem_text(error)))

        def once(handler, stop_chain: bool = False):
            """A one-shot handler's view, rendered; with `stop_chain` an error is raised as a
            Gradio error (a message in the page) so the `.success` after it does not run."""
            def run(*args):
                try:
                    return render(handler(*args))
                except Exception as error:
                    if stop_chain:
                        raise gr.Error(problem_text(error)) from None
                    return render(View(status=problem_text(error)))
            return run

        def settings_of(values) -> Settings:
            # A component inside a never-opened accordion may arrive as None: use its default.
            defaults = [component.value for component in settings_inputs]
            return Settings(*(default if value is None else value for value, default in zip(values, defaults)))

        # Gradio passes the request (for the session's Stop) and event data by these annotations.
        def send_message(request: gr.Request, box, attached, pasted_text, chat, *values):
            def views():
                # A file dropped just before sending may not have been attached by its change event yet.
                dropped = attach_dropped(box)
                yield dropped
                yield from logic.send(typed(box), dropped.attachment or attached, pasted_text, chat,
                                      settings_of(values), request.session_hash)
            yield from streamed(views)

        def attach_dropped(box) -> View:
            """A file put in the message box (📎 or dropped) becomes the attachment; the box keeps the text."""
            files = (box or {}).get("files") or []
            if not files:
                return View()
            # Only a file that came through Gradio's upload: the event's path is whatever the client sends.
            path = files[-1] if isinstance(files[-1], str) else files[-1].get("path")
            view = logic.attach_file(uploaded_file(path))
            view.message = typed(box)
            return view

        def regenerate(request: gr.Request, chat, *values):
            yield from streamed(lambda: logic.regenerate(chat, settings_of(values), request.session_hash))

        def edit(request: gr.Request, edited: gr.EditData, chat, *values):
            yield from streamed(lambda: logic.edit(chat, edited.index, str(edited.value), settings_of(values),
                                                   request.session_hash))

        def stop_answer(request: gr.Request):
            logic.stop(request.session_hash)

        def update_meter(chat, attached, pasted_text, box, *values):
            try:
                return logic.meter_text(chat, attached, pasted_text, typed(box), settings_of(values))
            except Exception as error:
                return problem_text(error)

        send_inputs = [message, attachment, pasted, conversation, *settings_inputs]
        meter_inputs = [conversation, attachment, pasted, message, *settings_inputs]
        quiet = {"show_progress": "hidden"}  # the status line and the streaming text show progress
        light = {"show_progress": "hidden", "concurrency_id": "light", "concurrency_limit": 4}  # never behind an answer
        # One count at a time, in the order asked: a slow count of an earlier text (a long document
        # just replaced) finishing after the newer one would leave the meter showing what is gone.
        metering = {"show_progress": "hidden", "concurrency_id": "meter", "concurrency_limit": 1}
        answering = [trigger(send_message, send_inputs, outputs, **quiet) for trigger in (message.submit, send.click)]
        answering.append(chatbot.retry(regenerate, [conversation, *settings_inputs], outputs, **quiet))
        answering.append(chatbot.edit(edit, [conversation, *settings_inputs], outputs, **quiet))
        # The over-limit choices each change what is sent, then send it: the question and document are kept.
        choices = {button: (lambda box, *args, where=where: logic.cut(where, typed(box), *args[:3], settings_of(args[3:])))
                   for where, button in cut_buttons.items()}
        choices[shorter] = lambda box, *args: logic.shorter_answer(typed(box), *args[:3], settings_of(args[3:]))
        choices[leave_out] = lambda box, *args: logic.leave_out_turns(typed(box), *args[:3], settings_of(args[3:]))
        for button, choose in choices.items():
            chosen = button.click(once(choose, stop_chain=True),
                                  [message, attachment, pasted, conversation, *settings_inputs], outputs, **light)
            answering.append(chosen.success(send_message, send_inputs, outputs, **quiet))
        def summarize_in_parts(request: gr.Request, box, attached, pasted_text, chat, *values):
            yield from streamed(lambda: logic.summarize_in_parts(typed(box), attached, pasted_text, chat,
                                                                 settings_of(values), request.session_hash))

        answering.append(in_parts.click(summarize_in_parts, send_inputs, outputs, **quiet))
        for event in answering:
            event.then(update_meter, meter_inputs, meter, **metering)
        # Stop ends the answer gracefully (saved, with its figures); it skips the queue, which an answer holds.
        stop.click(stop_answer, None, None, queue=False)

        for box in (pasted, max_new_tokens, system):
            box.change(update_meter, meter_inputs, meter, trigger_mode="always_last", **metering)
        # Typing recounts the meter; a file put in the box is attached first, then counted.
        message.change(once(attach_dropped), message, outputs, trigger_mode="always_last", **light).then(
            update_meter, meter_inputs, meter, **metering)
        pasted.change(lambda attached, text: gr.update() if attached else logic.pasted_chip(text), [attachment, pasted],
                      attachment_line, trigger_mode="always_last", **light)
        detach.click(lambda: (None, "", ""), None, [attachment, attachment_line, pasted]).then(
            update_meter, meter_inputs, meter, **metering)
        switch.click(once(logic.switch_pair), longer_pairs, outputs)
        color.change(lambda on: gr.update(visible=on), color, tokens)
        preset.change(_preset_chosen, [preset, message, conversation], [system, message, temperature, top_p])

        for clear in (new.click, chatbot.clear):  # the chat's own Clear starts afresh too; nothing is deleted
            clear(once(lambda: View(clear_conversation=True, conversations_changed=True, status="", stats="",
                                    stages="", tokens="", over_limit="", message="", clear_attachment=True,
                                    pasted="")), None, outputs, cancels=answering,
                  **light).then(
                update_meter, meter_inputs, meter, **metering)
        conversations.input(once(logic.open), conversations, outputs, cancels=answering, **light).then(
            update_meter, meter_inputs, meter, **metering)
        rename.click(once(logic.rename), [conversation, title], outputs, **light)
        delete.click(once(logic.delete), conversation, outputs, cancels=answering, **light).then(
            update_meter, meter_inputs, meter, **metering)
        undo.click(once(logic.undelete), deleted, outputs, **light).then(update_meter, meter_inputs, meter, **metering)
        export.click(_exporter(logic), conversation, [exported, status])
        # Leaving a running answer (new, open, delete) cancels its Gradio event, which abandons the
        # answer without closing it: cancel its ticket too, so the engine moves on at once instead of
        # after the line's stall backstop.
        for leave in (new.click, chatbot.clear, conversations.input, delete.click):
            leave(stop_answer, None, None, queue=False)
            # Another conversation's export files are not this one's: they go.
            leave(lambda: gr.update(value=None, visible=False), None, exported, **light)

        def model_state():
            return model_status.line(), gr.update(visible=model_status.offers_download()
                                                  and not downloads.downloading(model_status.recommended.id))

        gr.Timer(MODEL_LINE_SECONDS).tick(model_state, None, [model_line, get_pair], **light)
        get_pair.click(lambda: model_status.get_recommended() or "", None, status, **light).then(
            model_state, None, [model_line, get_pair], **light)
        dark.click(None, js=DARK_MODE_JS)
        demo.load(once(logic.newest), None, outputs).then(update_meter, meter_inputs, meter, **metering)
        demo.load(None, js=RESTORE_DARK_MODE_JS)
    return demo


def typed(box) -> str:
    """The text in the message box (a MultimodalTextbox: {"text", "files"}; a string from the API)."""
    return (box.get("text") or "") if isinstance(box, dict) else str(box or "")


def _preset_chosen(key: str, box, chat) -> tuple:
    """The system prompt, message box, temperature and top-p for a preset. The conversation's own
    preset (set as it is opened) keeps its own system prompt and settings, which may have been
    edited, and adds no question."""
    text = typed(box)
    if chat is not None and chat.preset == key:
        return chat.system, {"text": text, "files": []}, gr.update(), gr.update()
    preset = PRESETS[key]
    return preset.system, {"text": text or preset.question, "files": []}, preset.temperature, preset.top_p


def _exporter(logic: ChatLogic):
    def export(chat):
        try:
            return gr.update(value=logic.export(chat), visible=True), "Exported: download the files below the list."
        except Exception as error:
            return gr.update(visible=False), problem_text(error)
    return export


def build_app(handle: EngineHandle, store: HistoryStore, registry_file: str | None = None,
              api_key: str | None = None, host: str = DEFAULT_HOST, allowed_hosts: Iterable[str] = ()):
    """The whole server as one ASGI app: the page at /, the OpenAI-compatible API at /v1, and
    Gradio's routes, all behind the `Guard` (known hosts, no cross-site writes, the key, sizes)."""
    from fastapi import FastAPI

    from .api import add_api

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    add_api(app, handle)  # the key is the Guard's, for every route alike
    demo = build_ui(handle, store, registry_file).queue(default_concurrency_limit=1)
    app = gr.mount_gradio_app(app, demo, path="/", ssr_mode=False, footer_links=[], css=APP_CSS,
                              max_file_size=limits.UPLOAD.bytes)
    # Gradio checks that a file an event receives was uploaded (processing_utils._check_allowed)
    # only once `launch()` has marked the app launched, which a mounted app never is: mark it.
    demo.has_launched = True
    return Guard(app, api_key, host, allowed_hosts)


def _quiet_forced_shutdown(record: logging.LogRecord) -> bool:
    """On Ctrl-C uvicorn cuts the streams still open after the grace period (an open tab's event
    stream always is one) and logs each cut as an error with a traceback: expected, so not shown."""
    cut = record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError)
    return not (cut or "timeout graceful shutdown exceeded" in record.getMessage())


def launch(load: Callable[[str, Callable[[str], None]], object], model: str = "embedded", registry_file: str | None = None,
           host: str = DEFAULT_HOST, port: int = 7860, open_browser: bool = True, api_key: str | None = None,
           allowed_hosts: Iterable[str] = ()) -> None:
    """Serve the chat at / and the OpenAI-compatible API at /v1 on one server; `load(model,
    progress)` loads an engine (in the background, so the page is up at once)."""
    import uvicorn

    if host not in (DEFAULT_HOST, "localhost", "::1"):
        print(f"specchat: warning: listening on {host}: other computers on the network can use this chat and "
              + ("its API with the key" if api_key else "its API without a key (set --api-key)")
              + "; they reach it by this computer's address, or by a name given with --allow-host",
              file=sys.stderr)
    # The engine's modules (transformers, torch) are imported here, before any thread starts: a
    # thread importing transformers while another does can fail with "cannot import name
    # 'DynamicCache'" (its lazy module is then half set up). The loading thread starts next.
    from ..core import engine  # noqa: F401

    handle = EngineHandle(load, model)
    store = HistoryStore(default_folder())
    app = build_app(handle, store, registry_file, api_key, host, allowed_hosts)
    url = f"http://{host}:{port}"
    print(f"specchat: the chat is at {url}/ and the OpenAI-compatible API at {url}/v1; "
          f"conversations are saved in {store.folder}"
          + ("; both need the key (the page asks for it once per browser)" if api_key else ""), file=sys.stderr)
    if open_browser:
        threading.Timer(1.5, webbrowser.open, args=(f"{url}/",)).start()
    # Open streams (an answer, a tab's event stream) get SHUTDOWN_GRACE_SECONDS to end on Ctrl-C,
    # then are cut: waiting for all of them kept the server up for minutes with a tab open.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", ws_max_size=limits.REQUEST_BODY.bytes,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)  # configures uvicorn's logging
    logging.getLogger("uvicorn.error").addFilter(_quiet_forced_shutdown)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        pass  # Ctrl-C is how the app is stopped: a normal end, as with uvicorn.run
    finally:
        handle.close(timeout=5)  # the running answer is cancelled, the waiting ones told why
