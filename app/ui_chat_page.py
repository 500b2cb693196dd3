"""The chat tab's layout, and a handler's `View` drawn onto it. `ChatPage` names every component
the wiring (`ui.py`) reads or draws on; `render` returns a view's values keyed by component, so that
each output is matched by name, never by its place in a list."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Container

import gradio as gr

from ..core.modes import REQUEST_MODES
from . import chat_versions as versions
from .chat_view import ASK_FIRST, KEPT_SETTINGS, LEAVE_OUT_OLDEST, Settings, View, shown
from .context_meter import ANSWER_STEP, CUTS
from .conversation import attachment_label
from .documents import DOCUMENT_SUFFIXES
from .presets import PRESETS

MODES = list(REQUEST_MODES)


@dataclass(frozen=True)
class ChatPage:
    conversation: gr.State
    attachment: gr.State
    deleted: gr.State  # the conversation just deleted, for Undo
    drafts: gr.State  # what was typed, attached and pasted in each conversation and not sent (`chat_drafts`)
    browser: gr.BrowserState  # this browser's id, under which its drafts are kept on disk (`draft_store`)
    dark: gr.Button
    tab: gr.Tab  # the Chat tab, so other tabs can tell when they are left
    new: gr.Button
    undo: gr.Button
    preset: gr.Dropdown
    conversations: gr.Radio
    search: gr.Textbox  # filters `conversations`
    title: gr.Textbox
    rename: gr.Button
    delete: gr.Button
    export: gr.Button
    exported: gr.File
    model_line: gr.Markdown
    get_pair: gr.Button
    chatbot: gr.Chatbot
    older: gr.Button  # the last answer's versions (`chat_versions`): the one before the shown one
    version_label: gr.Markdown
    newer: gr.Button
    go_on: gr.Button  # Continue: carries a cut answer on (`chat_versions.can_continue`)
    status: gr.Markdown
    over_group: gr.Group
    over_text: gr.Markdown
    shorter: gr.Button
    leave_out: gr.Button
    in_parts: gr.Button
    cut_buttons: dict[str, gr.Button]  # by where the cut is (`CUTS`)
    pairs_row: gr.Row
    longer_pairs: gr.Dropdown
    switch: gr.Button
    message: gr.MultimodalTextbox
    send: gr.Button
    stop: gr.Button
    attachment_line: gr.Markdown
    meter: gr.Markdown
    stats: gr.Markdown
    pasted: gr.Textbox
    detach: gr.Button
    color: gr.Checkbox
    stages: gr.Markdown
    tokens: gr.HTML
    # The settings, named as `Settings`' fields.
    system: gr.Textbox
    temperature: gr.Slider
    top_p: gr.Slider
    top_k: gr.Number
    max_new_tokens: gr.Slider
    seed: gr.Textbox
    mode: gr.Radio
    repetition_penalty: gr.Slider
    follow_up_room: gr.Radio

    @property
    def settings_inputs(self) -> list:
        """The components of a `Settings`, in the order of its fields."""
        return [getattr(self, field.name) for field in dataclasses.fields(Settings)]

    @property
    def send_inputs(self) -> list:
        """What a question is sent with: the box, the document (attached or pasted), the
        conversation, the settings."""
        return [self.message, self.attachment, self.pasted, self.conversation, *self.settings_inputs]

    @property
    def meter_inputs(self) -> list:
        return [self.conversation, self.attachment, self.pasted, self.message, *self.settings_inputs]

    @property
    def kept_settings(self) -> dict:
        return {name: getattr(self, name) for name in KEPT_SETTINGS}

    @property
    def outputs(self) -> list:
        """The components a `View` is drawn on: every chat handler's outputs."""
        return [self.conversation, self.chatbot, self.older, self.version_label, self.newer, self.go_on,
               self.status,
                self.message, self.attachment, self.attachment_line,
                self.pasted, self.stats, self.stages, self.tokens, self.over_group, self.over_text, self.shorter,
                self.leave_out, self.in_parts, *self.cut_buttons.values(), self.pairs_row, self.longer_pairs,
                self.conversations, self.search, self.title, self.system, self.preset, *self.kept_settings.values(),
                self.deleted, self.undo]


def render(page: ChatPage, view: View, choices: Callable[[], list[tuple[str, str]]],
           writing: Container[str] = frozenset()) -> dict:
    """The view drawn onto the page: a value for each of `page.outputs`, keyed by component;
    `gr.update()` keeps what the view leaves as None. `choices`: the conversations' list; `writing`:
    the ids of those whose answer this process is writing (`HistoryStore.live_answers`)."""
    drawn = dict.fromkeys(page.outputs, gr.update())
    chat = view.conversation
    if view.clear_conversation:
        drawn |= {page.conversation: None, page.chatbot: [], page.title: ""}
    elif chat is not None:
        drawn[page.conversation] = chat
        if not view.same_messages:
            drawn[page.chatbot] = shown(chat, view.streaming, view.pending, writing=chat.id in writing)
        if not view.streaming:  # a streaming answer's copy can predate a rename, and would undo a name being typed
            drawn[page.title] = chat.title
    if view.clear_conversation or (chat is not None and not view.same_messages):
        drawn |= _answer_controls(page, None if view.clear_conversation else chat, view.streaming)
    if view.conversations_changed:
        drawn[page.conversations] = gr.update(choices=choices(), value=chat.id if chat else None)
        drawn[page.search] = ""  # the whole list again
    if view.attachment is not None or view.clear_attachment:
        drawn[page.attachment] = view.attachment
        drawn[page.attachment_line] = attachment_label(view.attachment) if view.attachment else ""
    if view.message is not None:
        drawn[page.message] = {"text": view.message, "files": []}
    for component, value in ((page.status, view.status), (page.pasted, view.pasted), (page.stats, view.stats),
                             (page.stages, view.stages), (page.tokens, view.tokens), (page.system, view.system),
                             (page.deleted, view.deleted)):
        if value is not None:
            drawn[component] = value
    over = view.over_limit
    if over is not None:
        drawn |= {page.over_group: gr.update(visible=bool(over)), page.over_text: over,
                  page.shorter: gr.update(visible=bool(over and view.answer_room),
                                          value=f"Answer in up to {view.answer_room:,} tokens (what fits)"),
                  page.leave_out: gr.update(visible=bool(over and view.can_leave_out)),
                  page.in_parts: gr.update(visible=bool(over and view.in_parts))}
        drawn |= {button: gr.update(visible=bool(over and view.cuts), value=(view.cuts or {}).get(where, ""))
                  for where, button in page.cut_buttons.items()}
    if view.longer_pairs is not None:
        drawn |= {page.pairs_row: gr.update(visible=bool(view.longer_pairs)),
                  page.longer_pairs: gr.update(choices=view.longer_pairs, value=None)}
    if view.preset is not None and view.preset in PRESETS:
        drawn[page.preset] = view.preset
    saved = view.settings or {}
    drawn |= {component: saved[name] for name, component in page.kept_settings.items()
              if name in saved and _takes(component, saved[name])}
    if view.deleted is not None:
        drawn[page.undo] = gr.update(visible=bool(view.deleted))
    return drawn


def _takes(component, value) -> bool:
    """Whether `component` takes `value`: a saved setting out of a slider's range or a radio's
    choices (a file edited by hand, or saved by another version) would fail every later send in
    Gradio's input check; such a setting keeps the page's value instead."""
    if isinstance(component, gr.Radio):
        return value in [choice for _, choice in component.choices]
    if isinstance(component, (gr.Slider, gr.Number)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and \
            (component.minimum is None or value >= component.minimum) and \
            (component.maximum is None or value <= component.maximum)
    return value is None or isinstance(value, (str, int, float))  # the seed's box: blank, or a number


def _answer_controls(page: ChatPage, chat, streaming: bool) -> dict:
    """The last answer's pager ("‹ 2/3 ›"), shown where it has versions, and Continue, where it was
    cut; neither while an answer streams."""
    number, count = versions.pager(chat)
    paging = count > 1 and not streaming
    return {page.older: gr.update(visible=paging, interactive=number > 1),
            page.version_label: gr.update(visible=paging, value=f"Answer {number}/{count}"),
            page.newer: gr.update(visible=paging, interactive=number < count),
            page.go_on: gr.update(visible=versions.can_continue(chat) and not streaming)}


def chat_page(model_line: Callable[[], str]) -> ChatPage:
    """The page's header and its Chat tab (call inside the `gr.Blocks`); `model_line` draws the
    model's line at each page load."""
    conversation = gr.State(None)
    attachment = gr.State(None)
    deleted = gr.State("")
    drafts = gr.State({})
    # The browser's id for its drafts on disk (`draft_store`). The id is no secret: a fixed key
    # keeps it readable after a restart, when a random one (Gradio's default) would lose it.
    browser = gr.BrowserState("", storage_key="specchat-browser", secret="specchat-drafts")
    with gr.Row():
        gr.Markdown("## specchat\nLong-document chat, sped up by lossless speculative decoding.")
        dark = gr.Button("🌓 Dark mode", size="sm", scale=0, elem_id="dark-mode")
    with gr.Tab("Chat") as tab:
        with gr.Row(elem_id="chat-row"):
            with gr.Column(scale=1, min_width=220, elem_id="sidebar"):
                new = gr.Button("+ New conversation", size="sm", elem_id="new-conversation")
                undo = gr.Button("↶ Undo the delete", size="sm", visible=False, elem_id="undo-delete")
                preset = gr.Dropdown([(p.label, key) for key, p in PRESETS.items()], value="free",
                                     label="Preset", elem_id="preset")
                search = gr.Textbox(placeholder="Search conversations", show_label=False, elem_id="search",
                                    container=False)
                conversations = gr.Radio([], label="Conversations", elem_id="conversations")
                title = gr.Textbox(label="Name", placeholder="Rename this conversation", elem_id="title")
                with gr.Row():
                    rename = gr.Button("Rename", size="sm", elem_id="rename")
                    delete = gr.Button("Delete", size="sm", variant="stop", elem_id="delete")
                export = gr.Button("Export (Markdown + JSON)", size="sm", elem_id="export")
                exported = gr.File(label="Exported", file_count="multiple", visible=False, elem_id="exported")
            with gr.Column(scale=4, min_width=320, elem_id="main-column"):
                with gr.Row():
                    shown_model = gr.Markdown(model_line, elem_id="model-line")
                    get_pair = gr.Button("⬇ Download it and switch to it", size="sm", scale=0, min_width=200,
                                         visible=False, elem_id="get-recommended")
                chatbot = gr.Chatbot(label="Chat", height=460, elem_id="chat", editable="user",
                                     buttons=["copy", "copy_all"])
                with gr.Row(elem_id="answer-controls"):
                    older = gr.Button("‹", size="sm", scale=0, min_width=40, visible=False, elem_id="older-version")
                    version_label = gr.Markdown("", visible=False, scale=0, min_width=90, elem_id="version-label")
                    newer = gr.Button("›", size="sm", scale=0, min_width=40, visible=False, elem_id="newer-version")
                    go_on = gr.Button("Continue", size="sm", scale=0, min_width=110, visible=False,
                                      elem_id="continue")
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
                                                   label="Answer limit (tokens)", elem_id="max-new-tokens")
                        seed = gr.Textbox("", label="Seed (blank = random)", elem_id="seed")
                    mode = gr.Radio(MODES, value="auto", label="Decoding", elem_id="mode")
                    repetition_penalty = gr.Slider(1.0, 2.0, value=1.0, step=0.05, elem_id="repetition-penalty",
                                                   label="Repetition penalty (1 = off; counts the answer's own words)")
                    follow_up_room = gr.Radio(
                        [("Leave the oldest turns out of what the model reads (documents stay; marked in the chat)",
                          LEAVE_OUT_OLDEST), ("Ask me first", ASK_FIRST)],
                        value=LEAVE_OUT_OLDEST, label="When a follow-up does not fit", elem_id="follow-up-room")
    return ChatPage(
        conversation=conversation, attachment=attachment, deleted=deleted, drafts=drafts, browser=browser, dark=dark,
        tab=tab, new=new,
        undo=undo, preset=preset, conversations=conversations, search=search, title=title, rename=rename,
        delete=delete, export=export,
        exported=exported, model_line=shown_model, get_pair=get_pair, chatbot=chatbot, older=older,
        version_label=version_label, newer=newer, go_on=go_on, status=status,
        over_group=over_group, over_text=over_text, shorter=shorter, leave_out=leave_out, in_parts=in_parts,
        cut_buttons=cut_buttons, pairs_row=pairs_row, longer_pairs=longer_pairs, switch=switch, message=message,
        send=send, stop=stop, attachment_line=attachment_line, meter=meter, stats=stats, pasted=pasted,
        detach=detach, color=color, stages=stages, tokens=tokens, system=system, temperature=temperature,
        top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, seed=seed, mode=mode,
        repetition_penalty=repetition_penalty, follow_up_room=follow_up_room)
