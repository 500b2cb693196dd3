"""The Gradio chat: streaming answers, a document box, a stop button, live speed figures.

It consumes the engine's event stream and never touches models or tensors. The model loads in
the background, so the page is up at once, even during the one-time conversion.
"""

from __future__ import annotations

import os
import sys
import threading
import webbrowser
from typing import Callable

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from ..core.errors import SpecchatError  # noqa: E402
from .documents import TEXT_SUFFIXES, read_text_file, user_turn  # noqa: E402

DEFAULT_HOST = "127.0.0.1"


class EngineHandle:
    """The engine, loading in a background thread; `get()` waits for it or raises its error."""

    def __init__(self, load: Callable[[], object]):
        self._ready = threading.Event()
        self._engine = None
        self._error: Exception | None = None
        threading.Thread(target=self._load, args=(load,), daemon=True).start()

    def _load(self, load: Callable[[], object]) -> None:
        try:
            self._engine = load()
        except Exception as error:  # shown in the chat instead of killing the server
            self._error = error
        finally:
            self._ready.set()

    def get(self):
        self._ready.wait()
        if self._error is not None:
            raise SpecchatError(f"the model could not be loaded: {self._error}")
        return self._engine


FINISH_REASONS = {"stop": "done", "length": "reached the token limit", "cancelled": "stopped"}


def _stats_line(stats, mode: str) -> str:
    reused = f" ({stats.reused_prompt_tokens:,} prompt tokens reused)" if stats.reused_prompt_tokens else ""
    return (f"**{stats.tokens_per_second:.1f} tok/s** · "
            f"**{stats.mean_accepted_per_forward:.2f}** tokens per target forward · "
            f"{stats.target_forwards} target forwards · first token after {stats.prefill_seconds:.2f} s{reused} · "
            f"mode `{mode}`")


def build_ui(handle: EngineHandle) -> gr.Blocks:
    from ..core.engine import Finished, PrefillProgress, TextDelta, resolve_mode
    from ..core.sampling import SamplingParams

    unchanged = (gr.update(), gr.update(), gr.update())  # message, document, upload
    cleared = ("", "", None)

    def respond(message, document, upload, max_new_tokens, temperature, mode, conversation, shown):
        """Stream one answer. `conversation` holds what the model sees (documents in full);
        `shown` is the chat as displayed (documents as a one-line attachment)."""
        question = (message or "").strip()
        shown_before = shown
        try:
            attached = document or ""
            if upload:
                attached = "\n\n".join(part for part in (attached, read_text_file(upload)) if part.strip())
            content = user_turn(question, attached)
            if not content:
                yield conversation, shown, *unchanged, "Type a question or attach a document."
                return
            label = question or "(document)"
            if attached.strip():
                label = f"*[document attached: {len(attached):,} characters]*\n\n{label}"
            turn = conversation + [{"role": "user", "content": content}]
            shown = shown + [{"role": "user", "content": label}, {"role": "assistant", "content": ""}]
            # The document is now part of the conversation: clear the boxes so it is not sent twice.
            yield conversation, shown, *cleared, "Loading the model…"
            engine = handle.get()
            params = SamplingParams(temperature=float(temperature))
            answer = ""
            for event in engine.generate(engine.chat_ids(turn), int(max_new_tokens), params, mode):
                if isinstance(event, PrefillProgress):
                    status = f"Reading the prompt: {event.done:,} / {event.total:,} tokens"
                    yield conversation, shown, *unchanged, status
                elif isinstance(event, TextDelta):
                    answer += event.text
                    shown[-1] = {"role": "assistant", "content": answer}
                    yield (turn + [{"role": "assistant", "content": answer}], shown, *unchanged,
                           _stats_line(event.stats, resolve_mode(mode, engine.auto_mode)))
                elif isinstance(event, Finished):
                    result = event.result
                    yield (turn + [{"role": "assistant", "content": result.text}], shown, *unchanged,
                           f"{_stats_line(result.stats, result.mode)} · {result.new_tokens} tokens, "
                           f"{FINISH_REASONS[result.finish_reason]}")
        except Exception as error:  # shown in the page, never as a traceback
            # Nothing is lost: the chat stays as it was, the question and document go back
            # into their boxes.
            text = str(error) if isinstance(error, SpecchatError) else f"unexpected error: {type(error).__name__}: {error}"
            yield conversation, shown_before, message, document, upload, f"⚠️ {text}"

    with gr.Blocks(title="specchat") as demo:
        gr.Markdown("## specchat\nLong-document chat, sped up by lossless speculative decoding.")
        conversation = gr.State([])
        chatbot = gr.Chatbot(label="Chat", height=460, elem_id="chat")
        with gr.Row():
            message = gr.Textbox(placeholder="Ask about your document, or just chat", show_label=False,
                                 scale=6, elem_id="message", autofocus=True)
            send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            stop = gr.Button("Stop", variant="stop", scale=1, elem_id="stop")
        stats = gr.Markdown("", elem_id="stats")
        with gr.Accordion("Document", open=False):
            document = gr.Textbox(label="Paste a document", lines=6, elem_id="document")
            upload = gr.File(label="…or upload one", file_types=list(TEXT_SUFFIXES), type="filepath")
        with gr.Accordion("Settings", open=False):
            max_new_tokens = gr.Slider(16, 2048, value=512, step=16, label="Max new tokens")
            temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="Temperature (0 = greedy)")
            mode = gr.Radio(["auto", "chain", "tree", "triforce", "plain"], value="auto", label="Decoding")
        clear = gr.Button("New conversation", size="sm")

        inputs = [message, document, upload, max_new_tokens, temperature, mode, conversation, chatbot]
        outputs = [conversation, chatbot, message, document, upload, stats]
        events = [trigger(respond, inputs, outputs) for trigger in (message.submit, send.click)]
        stop.click(None, cancels=events)
        clear.click(lambda: ([], [], ""), None, [conversation, chatbot, stats], cancels=events)
        chatbot.clear(lambda: ([], ""), None, [conversation, stats], cancels=events)
    return demo


def launch(load: Callable[[], object], host: str = DEFAULT_HOST, port: int = 7860,
           open_browser: bool = True, api_key: str | None = None) -> None:
    """Serve the chat at / and the OpenAI-compatible API at /v1 on one server; `load` loads the
    engine (in the background, so the page is up at once)."""
    import uvicorn
    from fastapi import FastAPI

    from .api import add_api

    if host not in (DEFAULT_HOST, "localhost", "::1"):
        print(f"specchat: warning: listening on {host}: other computers on the network can use this chat"
              + ("" if api_key else " and its API (set --api-key)"), file=sys.stderr)
    handle = EngineHandle(load)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    add_api(app, handle.get, api_key)
    demo = build_ui(handle).queue(default_concurrency_limit=1)
    app = gr.mount_gradio_app(app, demo, path="/", ssr_mode=False, footer_links=[])
    url = f"http://{host}:{port}"
    print(f"specchat: the chat is at {url}/ and the OpenAI-compatible API at {url}/v1", file=sys.stderr)
    if open_browser:
        threading.Timer(1.5, webbrowser.open, args=(f"{url}/",)).start()
    uvicorn.run(app, host=host, port=port, log_level="warning")
