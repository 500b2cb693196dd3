"""An answer drawn by three Gradio events (`app/answer_relay.py`): the views before it streams on every
output, the streaming ones on a few, the end on every output again; what waits between two events
is closed when the page moves on."""

import threading

from conftest import run, saved
from specchat.app.answer_relay import AnswerRelay, guarded, streams_only
from specchat.app.chat_view import Settings, View
from specchat.app.conversation import Conversation

SETTINGS = Settings(system="", preset="free", temperature=0.0, top_p=1.0, top_k=0, seed=None,
                    max_new_tokens=24, mode="auto")
CHAT = Conversation(id="c1", title="t", created=0.0, updated=0.0)
ASKED = View(conversation=CHAT, message="", clear_attachment=True, conversations_changed=True)
STREAMING = [View(conversation=CHAT, streaming=True, pending="starting"),
             View(conversation=CHAT, streaming=True, stats="1 tok/s", tokens="<b>a</b>"),
             View(conversation=CHAT, streaming=True, status="ℹ️ note", stages="| x |")]
ENDED = View(conversation=CHAT, status="", conversations_changed=True)


def handler(views, ended: threading.Event):
    """A handler's generator that says when it is closed or done."""
    def generate():
        try:
            yield from views
        finally:
            ended.set()
    return generate


def test_only_a_streaming_view_that_changes_what_streams_goes_to_the_lean_event():
    assert all(streams_only(view) for view in STREAMING)
    assert not streams_only(View(conversation=CHAT))  # not streaming: the answer's controls change
    assert not streams_only(View(conversation=CHAT, streaming=True, message=""))
    assert not streams_only(View(conversation=CHAT, streaming=True, conversations_changed=True))
    assert not streams_only(View(conversation=CHAT, streaming=True, over_limit=""))


def test_an_answer_is_drawn_by_three_events_each_view_once_in_order():
    relay, ended = AnswerRelay(), threading.Event()
    views = guarded(handler([ASKED, *STREAMING, ENDED, View(status="after")], ended))
    assert run(relay.start("s1", views)) == [ASKED, STREAMING[0]]  # the first streaming view on every output
    assert run(relay.stream("s1")) == STREAMING[1:]
    assert not ended.is_set()
    assert run(relay.end("s1")) == [ENDED, View(status="after")]
    assert ended.is_set() and run(relay.stream("s1")) == [] and run(relay.end("s1")) == []


def test_a_handler_that_never_streams_is_drawn_whole_by_the_first_event():
    relay, ended = AnswerRelay(), threading.Event()
    assert run(relay.start("s1", guarded(handler([ASKED, View(status="over the limit")], ended)))) == [
        ASKED, View(status="over the limit")]
    assert ended.is_set() and run(relay.stream("s1")) == [] and run(relay.end("s1")) == []


def test_an_error_while_streaming_is_drawn_by_the_last_event_as_a_line():
    def failing():
        yield STREAMING[0]
        yield STREAMING[1]
        raise RuntimeError("disk gone")

    relay = AnswerRelay()
    run(relay.start("s1", guarded(failing)))
    assert run(relay.stream("s1")) == [STREAMING[1]]
    (error,) = run(relay.end("s1"))
    assert "disk gone" in error.status and error.over_limit == ""


def test_a_streaming_event_closed_early_closes_the_answer():
    relay, ended = AnswerRelay(), threading.Event()
    run(relay.start("s1", guarded(handler([*STREAMING, ENDED], ended))))
    streaming = relay.stream("s1")
    next(streaming)
    streaming.close()  # the page left while the answer streamed
    assert ended.is_set() and run(relay.end("s1")) == []


def test_a_new_answer_in_a_session_closes_its_answer_still_waiting_and_no_other_sessions():
    relay, first, other = AnswerRelay(), threading.Event(), threading.Event()
    run(relay.start("s1", guarded(handler(STREAMING, first))))
    run(relay.start("s2", guarded(handler(STREAMING, other))))
    again = run(relay.start("s1", guarded(handler([STREAMING[0], ENDED], threading.Event()))))
    assert first.is_set() and not other.is_set() and again == [STREAMING[0]]
    assert run(relay.stream("s1")) == [] and run(relay.end("s1")) == [ENDED]
    relay.discard("s2")  # the page moved on between two events
    assert other.is_set() and run(relay.stream("s2")) == []


def test_a_real_answer_streams_through_the_lean_event_and_is_saved_once_it_ends(logic):
    relay = AnswerRelay()
    settings = Settings(**{**SETTINGS.__dict__, "max_new_tokens": 160})  # long enough to stream in a few batches
    first = run(relay.start("s1", guarded(lambda: logic.send("Tell me a story", None, "", None, settings, "s1"))))
    assert first[-1].streaming and not any(view.stats for view in first)  # handed over before the first word
    streamed = run(relay.stream("s1"))
    assert any(view.stats for view in streamed)  # the words and figures as they come
    ended = run(relay.end("s1"))
    reply = saved(logic).messages[-1]
    assert not reply["partial"] and reply["content"] and ended[-1].conversation.messages[-1]["content"] == reply["content"]
    assert not ended[-1].streaming and ended[-1].conversations_changed


def test_every_question_streams_on_a_few_outputs_and_leaving_cancels_all_three_events(tmp_path):
    from specchat.app.engine_handle import EngineHandle
    from specchat.app.history import HistoryStore
    from specchat.app.ui import build_ui

    config = build_ui(EngineHandle(lambda _model, _progress: threading.Event().wait(), "never loads"),
                      HistoryStore(tmp_path)).config
    ids = {block["props"].get("elem_id"): block["id"] for block in config["components"]}
    events = config["dependencies"]
    after = {event["trigger_after"]: event for event in events if event["trigger_after"] is not None}
    chains = [(event, after[event["id"]], after[after[event["id"]]["id"]]) for event in events
              if event["id"] in after and ids["chat"] in after[event["id"]]["outputs"]
              and len(after[event["id"]]["outputs"]) < len(event["outputs"])]
    targets = {tuple(target) for asking, _, _ in chains for target in asking["targets"]}
    answering = {(ids[name], "click") for name in ("send", "continue", "in-parts", "shorter-answer", "leave-out")}
    assert answering | {(ids["message"], "submit"), (ids["chat"], "retry"), (ids["chat"], "edit")} <= targets
    for asking, streaming, ending in chains:
        assert len(streaming["outputs"]) <= 6 and ending["outputs"] == asking["outputs"]
    drawn_by_chains = {event["id"] for chain in chains for event in chain}
    for target in ((ids["conversations"], "input"), (ids["new-conversation"], "click")):
        moving = [event for event in events if target in map(tuple, event["targets"]) and event["cancels"]]
        assert moving and all(drawn_by_chains <= set(event["cancels"]) for event in moving), target


def test_an_event_with_nothing_to_draw_leaves_the_page_as_it_is(logic):
    """Gradio blanks every output of a generator event that yields nothing: the streaming and
    ending events of a question that never streamed (over the limit, an error) must yield."""
    import gradio as gr
    from types import SimpleNamespace

    from specchat.app.ui import _ChatHandlers
    from specchat.app.ui_chat_page import chat_page

    with gr.Blocks():
        page = chat_page(lambda: "")
    handlers, request = _ChatHandlers(page, logic), SimpleNamespace(session_hash="s1")
    assert list(handlers.streaming(request)) == [gr.skip()] and list(handlers.ending(request)) == [gr.skip()]


def test_an_answer_closed_before_its_first_word_leaves_its_question_to_retry(logic):
    relay = AnswerRelay()
    run(relay.start("s1", guarded(lambda: logic.send("First", None, "", None, SETTINGS, "s1"))))
    relay.discard("s1")  # the page moved on before the answer streamed: no empty answer is saved
    (question,) = saved(logic).messages
    assert question == {**question, "role": "user", "content": "First"}
