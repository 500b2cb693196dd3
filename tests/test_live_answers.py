"""An answer still being written, seen from elsewhere: another tab, a reload or an export made
meanwhile says it is being written, never "(interrupted)"; once it ends (done, stopped, the page
gone, an error) every view shows how it ended; after a restart a saved partial answer was cut
short, and says so; a rename made meanwhile shows at once and stays; a question another tab asks
meanwhile is answered after it, from the whole answer; deleted meanwhile, Undo brings it back as
its tab showed it. On the tiny model (256-token context)."""

import contextlib
import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import gradio as gr
import pytest

from conftest import holding, run
from specchat.app.answer_turns import STOPPED
from specchat.app import chat_versions as versions
from specchat.app.chat_view import Settings, View
from specchat.app.conversation import INTERRUPTED, WRITING, Conversation, shown_messages
from specchat.app.history import HistoryStore
from specchat.app.terminal_text import for_terminal
from specchat.app.ui import _ChatHandlers
from specchat.app.ui_chat import ChatLogic
from specchat.app.ui_chat_page import chat_page
from specchat.core.errors import SpecchatError

SETTINGS = Settings(system="", preset="free", temperature=0.0, top_p=1.0, top_k=0, seed=None,
                    max_new_tokens=160, mode="auto")  # far from its end at its first words


@dataclass
class Streaming:
    """An answer paused on the engine thread after its first words, which are saved (partial)."""
    views: Iterator[View]  # the answering tab's handler
    conversation: Conversation  # the answering tab's copy
    go_on: threading.Event  # the engine writes on (or ends at once, when Stop or the page gone cancelled it)
    fail: threading.Event  # set before `go_on`: it fails instead, as an engine's out-of-memory does


@pytest.fixture
def streaming(logic, monkeypatch):
    from specchat.app import answer_stream, ui_chat
    from specchat.core.engine import TextDelta

    monkeypatch.setattr(answer_stream, "STREAM_UPDATE_SECONDS", 0.01)
    monkeypatch.setattr(answer_stream, "SAVE_EVERY_SECONDS", 0.0)  # its first words saved, as 2 s into an answer
    answer_job, go_on, fail = ui_chat.answer_job, threading.Event(), threading.Event()

    def paused_job(*args, **kwargs):
        job = answer_job(*args, **kwargs)

        def paused(engine, cancel):
            with contextlib.closing(job(engine, cancel)) as events:
                for event in events:
                    yield event
                    if isinstance(event, TextDelta):
                        go_on.wait(30)
                        if fail.is_set():
                            raise SpecchatError("out of memory")
        return paused

    monkeypatch.setattr(ui_chat, "answer_job", paused_job)
    views = logic.send("Tell me a long story", None, "", None, SETTINGS, session="A")
    answer = Streaming(views, next(view for view in views if view.stats).conversation, go_on, fail)
    saved = logic.store.load(answer.conversation.id).messages[-1]
    assert saved["partial"] and saved["content"]
    yield answer
    views.close()
    go_on.set()


@pytest.fixture
def handlers(logic):
    """The page's handlers, drawing views as every tab does."""
    return handlers_of(logic)


def handlers_of(chat: ChatLogic) -> _ChatHandlers:
    with gr.Blocks():
        page = chat_page(lambda: "")
    return _ChatHandlers(page, chat)


def shown_answer(handlers: _ChatHandlers, view_of) -> str:
    """The last bubble of the chat a handler draws (`view_of`: what the page calls)."""
    return handlers.draw(view_of())[handlers.page.chatbot][-1]["content"]


def exported(chat: ChatLogic, conversation: Conversation) -> str:
    return Path(chat.export(conversation)[0]).read_text(encoding="utf-8")


def test_an_answer_streaming_here_reads_as_being_written_in_another_tab_a_reload_and_an_export(
        logic, handlers, streaming):
    conversation = streaming.conversation
    for view_of in (lambda: logic.open(conversation.id), logic.newest):  # another tab opens it; a reload
        bubble = shown_answer(handlers, view_of)
        assert bubble.endswith(WRITING) and INTERRUPTED not in bubble
    other_tab = logic.open(conversation.id).conversation
    for copy in (conversation, other_tab):  # exported from the tab that streams it, and from the other
        markdown = exported(logic, copy)
        assert WRITING in markdown and INTERRUPTED not in markdown


def test_after_a_restart_a_saved_partial_answer_was_interrupted(logic, streaming):
    """The same file, read by a server that is not writing it (this one crashed, or was killed)."""
    restarted = ChatLogic(logic.handle, HistoryStore(logic.store.folder))
    bubble = shown_answer(handlers_of(restarted), lambda: restarted.open(streaming.conversation.id))
    assert bubble.endswith(INTERRUPTED) and WRITING not in bubble
    markdown = exported(restarted, restarted.open(streaming.conversation.id).conversation)
    assert INTERRUPTED in markdown and WRITING not in markdown


@pytest.mark.parametrize("ending", ["done", "stop", "page gone", "error"])
def test_once_the_answer_ends_every_view_shows_how_it_ended(logic, handlers, streaming, ending):
    """Another tab, reopening it or exporting, shows the answer as the tab that wrote it does;
    even a copy that tab opened mid-answer exports the ended answer, not the cut one."""
    conversation, other_tab = streaming.conversation, logic.open(streaming.conversation.id).conversation
    if ending == "stop":
        logic.stop("A")
    elif ending == "page gone":
        streaming.views.close()
    elif ending == "error":
        streaming.fail.set()
    streaming.go_on.set()
    last = run(streaming.views)
    assert conversation.id not in logic.store.live_answers
    answered = logic.store.load(conversation.id).messages[-1]
    assert not answered["partial"] and answered["content"]
    as_written = shown_messages(conversation)[-1]["content"]  # what the tab that wrote it shows
    assert shown_answer(handlers, lambda: logic.open(conversation.id)) == as_written
    assert WRITING not in as_written and INTERRUPTED not in as_written
    assert as_written.endswith("*(stopped)*") == (ending in ("stop", "page gone"))
    assert ("*(cut short by an error: out of memory." in as_written) == (ending == "error")
    assert ending != "error" or "out of memory" in last[-1].status
    markdown = exported(logic, other_tab)
    assert for_terminal(as_written) in markdown and INTERRUPTED not in markdown  # the bubble's Markdown, whole


def test_a_rename_while_the_answer_streams_shows_at_once_and_stays(logic, handlers, streaming, monkeypatch):
    """Found in Chromium: each streamed update drew the answer's own copy's old title in the Name box
    until its next save (every 2 s) merged the rename, and wiped "Renamed to …" from the status line."""
    from specchat.app import answer_stream

    monkeypatch.setattr(answer_stream, "SAVE_EVERY_SECONDS", 60.0)  # no save merges the rename before the end
    page, conversation = handlers.page, streaming.conversation
    renamed = handlers.once(logic.rename)(conversation, "Stories")
    assert renamed[page.title] == "Stories" and renamed[page.status] == "Renamed to “Stories”."
    # The streaming bubble is left as it is (redrawn from the saved copy, it flashed back to the
    # last save, marked "being written", in the very tab writing it).
    assert renamed[page.chatbot] == gr.update() and renamed[page.conversation].title == "Stories"
    streaming.go_on.set()
    views, drawn = [], []
    for view in streaming.views:  # each drawn as it comes: the views share the answer's copy, which the end merges
        views.append(view)
        drawn.append(handlers.draw(view))
    assert any(view.streaming for view in views[:-1]) and not views[-1].streaming  # updates, then the end
    titles, statuses = ([each[component] for each in drawn if each[component] != gr.update()]
                        for component in (page.title, page.status))
    assert titles == ["Stories"] and statuses == []  # only the end draws the name: the conversation as saved
    ended = logic.store.load(conversation.id)
    assert ended.title == "Stories" and not ended.messages[-1]["partial"]


def test_an_answer_cut_by_an_error_says_so_after_a_restart_and_continue_carries_it_on(logic, streaming):
    """Not only the writing tab's status line: the saved answer says it was cut, and why, in every
    view after a restart too (it read as whole before); Continue carries it on, as a stopped one."""
    streaming.fail.set()
    streaming.go_on.set()
    run(streaming.views)
    restarted = ChatLogic(logic.handle, HistoryStore(logic.store.folder))
    reopened = restarted.open(streaming.conversation.id).conversation
    cut = reopened.messages[-1]
    assert (cut["finish_reason"], cut["error"], cut["partial"]) == ("error", "out of memory", False)
    mark = "*(cut short by an error: out of memory. Continue carries it on, or Retry answers again)*"
    assert shown_answer(handlers_of(restarted), lambda: restarted.open(reopened.id)).endswith(mark)
    assert mark in exported(restarted, reopened) and "cut short by an error" in restarted.open(reopened.id).stats
    assert versions.can_continue(reopened)
    said = cut["content"]
    streaming.fail.clear()  # the engine has the memory again
    run(restarted.continue_answer(reopened, dataclasses.replace(SETTINGS, max_new_tokens=4)))
    carried = restarted.store.load(reopened.id).messages[-1]
    assert carried["content"].startswith(said) and len(carried["content"]) > len(said) and carried["continued"] == 1
    assert carried["finish_reason"] == "length" and "error" not in carried


def test_the_reason_saved_with_a_cut_answer_is_a_few_words_without_paths():
    from specchat.app.chat_view import error_reason
    from specchat.app.history import CHANGED, SaveFailed

    assert error_reason(SpecchatError("the GPU ran out of memory while writing the answer: try a shorter answer "
                                      "or a smaller pair")) == "the GPU ran out of memory while writing the answer"
    assert error_reason(SaveFailed("cannot write to /home/me/data: Permission denied; conversation not saved")) \
        == error_reason(SaveFailed("cannot write to C:\\Users\\me: Permission denied")) == "cannot write to …"
    assert error_reason(SaveFailed(CHANGED)).endswith("so nothing was saved")  # not the advice after it
    assert error_reason(RuntimeError("CUDA error at /src/kernel.cu:12\nTraceback…")) == "an unexpected RuntimeError"


def test_only_words_an_error_cut_are_marked_and_an_answer_that_had_ended_keeps_its_ending():
    from specchat.app.answer_stream import cut_by_error

    error = SpecchatError("out of memory")
    for reply, start in (({"content": "", "partial": True}, ""), ({"content": "Once", "partial": True}, "Once")):
        cut_by_error(reply, error, start)  # no words of its own: no answer, taken out by the caller
        assert reply == {"content": start, "partial": False}
    ended = {"content": "Done", "partial": False, "finish_reason": "stop"}  # only its last save failed
    cut_by_error(ended, error, "")
    assert ended == {"content": "Done", "partial": False, "finish_reason": "stop"}
    carried = {"content": "Once upon", "partial": True, "continued": 1}
    cut_by_error(carried, error, "Once")
    assert carried == {"content": "Once upon", "partial": False, "continued": 2, "finish_reason": "error",
                       "error": "out of memory"}


def test_a_question_from_another_tab_while_an_answer_streams_is_answered_after_it(logic, handlers, streaming,
                                                                                   monkeypatch):
    """The other tab's question is saved at once (a tab closed meanwhile keeps it), waits for the
    answer being written, then is answered from the turns as saved: after the whole first answer,
    not after the first words its copy held (its first save failed "changed meanwhile")."""
    from specchat.app import ui_chat

    prompts, paused_job = [], ui_chat.answer_job
    monkeypatch.setattr(ui_chat, "answer_job", lambda messages, *rest: prompts.append(messages) or paused_job(
        messages, *rest))
    conversation = streaming.conversation
    other_tab = logic.open(conversation.id).conversation  # shows the answer's first words, being written
    asking = logic.send("And then?", None, "", other_tab, dataclasses.replace(SETTINGS, max_new_tokens=8), session="B")
    views = [next(asking) for _ in range(3)]  # the question saved, the start, the wait
    # Meanwhile the answer it waits for shows marked as being written, not cut mid-sentence.
    assert handlers.draw(views[2])[handlers.page.chatbot][-2]["content"].endswith(WRITING)
    assert [m["content"] for m in logic.store.load(conversation.id).messages][-1] == "And then?"
    streaming.go_on.set()
    run(streaming.views)
    views += run(asking)
    messages = logic.store.load(conversation.id).messages
    first = conversation.messages[1]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"] and messages[1] == first
    assert messages[3]["content"] and messages[3]["finish_reason"] in ("length", "stop", "repeating")
    assert prompts[-1][-2:] == [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "And then?"}]
    assert views[-1].conversation.messages == messages and not any("⚠️" in (view.status or "") for view in views)
    assert "another tab" in views[2].status


def test_stop_while_a_question_waits_for_the_other_tabs_answer_leaves_it_unanswered(logic, streaming):
    other_tab = logic.open(streaming.conversation.id).conversation
    asking = logic.send("And then?", None, "", other_tab, SETTINGS, session="B")
    assert "another tab" in [next(asking) for _ in range(3)][-1].status
    logic.stop("B")
    assert run(asking)[-1].status == STOPPED
    streaming.go_on.set()
    run(streaming.views)
    messages = logic.store.load(streaming.conversation.id).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user"] and messages[-1]["content"] == "And then?"
    assert messages[1] == streaming.conversation.messages[1] and not messages[1]["partial"]


def test_a_deleted_conversation_still_exports_as_its_tab_shows_it(logic):
    conversation = run(logic.send("Hello there", None, "", None, SETTINGS))[-1].conversation
    logic.delete(conversation)
    assert "Hello there" in exported(logic, conversation)


@pytest.mark.parametrize("deleting", ["another tab", "this tab"])
def test_an_answer_deleted_meanwhile_comes_back_with_undo_as_its_tab_showed_it(logic, handlers, streaming, deleting):
    """Found in Chromium: deleted mid-answer, Undo brought back its last periodic save (seconds
    short, still partial: "(interrupted)", no Continue) and the answering tab called it an error.
    Another tab's Delete leaves it to its end; this tab's stops it (the page's Delete presses Stop
    and Gradio closes the answer's handler)."""
    conversation, views = streaming.conversation, []
    if deleting == "this tab":
        logic.delete(conversation)
        logic.stop("A")
        streaming.views.close()
    else:
        logic.delete(logic.open(conversation.id).conversation)
        streaming.go_on.set()
        views = run(streaming.views)
    assert conversation.id not in logic.store.live_answers and logic.conversation_choices() == []
    logic.undelete(conversation.id)
    back = logic.open(conversation.id).conversation
    answer = back.messages[-1]
    assert back.messages == conversation.messages and not answer["partial"] and "error" not in answer
    bubble = shown_answer(handlers, lambda: logic.open(conversation.id))
    assert bubble == shown_messages(conversation)[-1]["content"] and INTERRUPTED not in bubble
    if deleting == "this tab":
        assert bubble.endswith("*(stopped)*") and versions.can_continue(back)
    else:
        assert answer["finish_reason"] in ("length", "stop", "repeating")
        assert not any("⚠️" in (view.status or "") for view in views)

def test_a_conversation_is_live_while_any_of_its_answers_is_written(tmp_path):
    """Two tabs answering in one conversation: the first to end leaves the other's live."""
    live, conversation_id = HistoryStore(tmp_path).live_answers, "a" * 32
    with live.writing(conversation_id):
        with pytest.raises(RuntimeError), live.writing(conversation_id):
            assert conversation_id in live
            raise RuntimeError("the second answer fails")
        assert conversation_id in live
    assert conversation_id not in live


def test_the_answering_tab_shows_its_answer_live_with_another_tab_s_question_below(logic, handlers, streaming):
    """Once its save took in the question another tab asked after it, the answer being written was
    no longer the chat's last message, and its own tab marked it "(still being written…)"."""
    other_tab = logic.open(streaming.conversation.id).conversation
    asking = logic.send("And then?", None, "", other_tab, SETTINGS, session="B")
    [next(asking) for _ in range(3)]  # saved, and waiting for the answer being written
    streaming.go_on.set()
    drawn = [(view, handlers.draw(view)) for view in streaming.views]
    merged = [chat for view, chat in drawn if view.streaming and view.conversation.messages[-1]["role"] == "user"]
    assert merged  # the answer's saves (one per update here) took the question in
    for chat in merged:
        answer, question = chat[handlers.page.chatbot][-2:]
        assert question["content"] == "And then?" and WRITING not in answer["content"]
    logic.stop("B")
    run(asking)


def test_an_answer_waiting_to_start_reads_as_being_written_and_a_question_asked_meanwhile_follows_it(
        logic, handlers):
    """Before its first words were saved (waiting in the engine's line, reading a long document),
    another tab or a reload showed the question unanswered and unmarked; a question asked there
    was answered after the first answer but then refused "changed meanwhile", though saved."""
    gate, held = holding(logic.handle)
    short = dataclasses.replace(SETTINGS, max_new_tokens=8)
    try:
        answering = logic.send("Hello there", None, "", None, short, session="A")
        waiting = [next(answering) for _ in range(3)][-1]  # the question, the start, the engine's line
        assert "Waiting for the engine" in waiting.status
        conversation_id = waiting.conversation.id
        assert shown_answer(handlers, lambda: logic.open(conversation_id)) == WRITING
        other_tab = logic.open(conversation_id).conversation
        asking = logic.send("And then?", None, "", other_tab, short, session="B")
        assert "another tab" in [next(asking) for _ in range(3)][-1].status
    finally:
        gate.set()
    assert list(held) == ["held"]
    run(answering)
    views = run(asking)
    messages = logic.store.load(conversation_id).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert all(m["content"] and not m.get("partial") for m in messages)
    assert not any("⚠️" in (view.status or "") for view in views)


def test_a_tab_opened_mid_answer_asks_after_the_ended_answer_without_a_changed_note(logic, streaming):
    """Its copy differed from the file only by the answer written on since it was shown: every
    follow-up from it said "This conversation had changed since it was shown", and kept saying so."""
    other_tab = logic.open(streaming.conversation.id).conversation  # the answer's first words
    streaming.go_on.set()
    run(streaming.views)
    views = run(logic.send("And then?", None, "", other_tab, dataclasses.replace(SETTINGS, max_new_tokens=8)))
    assert not any("had changed" in (view.status or "") for view in views)
    messages = logic.store.load(other_tab.id).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"] and not messages[1]["partial"]
