"""The chat tab's behaviour without a browser, on the tiny model (256-token context): what is
saved when, stop, regenerate, edit, and the over-limit choice. The browser tests drive the same
code through the page."""

import dataclasses

import pytest

from conftest import DATA, holding
from specchat.app.conversation import model_messages
from specchat.app.engine_handle import EngineHandle
from specchat.app.history import HistoryStore
from specchat.app.ui_chat import ChatLogic, Settings
from specchat.core.loading import load_engine

SETTINGS = Settings(system="", preset="free", temperature=0.0, top_p=1.0, top_k=0, seed=None,
                    max_new_tokens=24, mode="auto")


@pytest.fixture
def logic(tiny_model_dir, tmp_path):
    handle = EngineHandle(lambda model, progress: load_engine(model, progress), str(tiny_model_dir))
    handle.get()
    yield ChatLogic(handle, HistoryStore(tmp_path / "conversations"))
    handle.close()


def run(views):
    return list(views)


def saved(logic):
    (summary,) = logic.store.list()
    return logic.store.load(summary.id)


def test_a_question_is_saved_before_its_answer_and_the_answer_when_it_ends(logic):
    views = logic.send("Hello there", None, "", None, SETTINGS)
    first = next(views)
    assert first.message == "" and first.conversation.messages[-1]["content"] == "Hello there"
    assert [m["role"] for m in saved(logic).messages] == ["user"]  # on disk before any token
    rest = run(views)
    reply = saved(logic).messages[-1]
    assert reply["role"] == "assistant" and not reply["partial"] and reply["content"] == rest[-1].conversation.messages[-1]["content"]
    assert reply["finish_reason"] in ("stop", "length") and reply["stats"]["target_forwards"] >= 1
    assert "".join(text for text, _ in reply["origins"]) == reply["content"]


def test_stop_keeps_the_answer_so_far(logic):
    views = logic.send("Tell me a story", None, "", None, SETTINGS)
    streamed = [next(views) for _ in range(6)]  # the question, the start, the prompt, a few tokens
    views.close()  # what the page's Stop does to the handler
    reply = saved(logic).messages[-1]
    assert reply["content"] and reply["role"] == "assistant" and not reply["partial"]
    assert reply["finish_reason"] == "cancelled"
    assert reply["content"] == streamed[-1].conversation.messages[-1]["content"]


def test_regenerate_and_edit_replace_what_follows(logic):
    conversation = run(logic.send("First question", None, "", None, SETTINGS))[-1].conversation
    run(logic.send("Second question", None, "", conversation, SETTINGS))
    assert len(saved(logic).messages) == 4
    sampled = Settings(**{**SETTINGS.__dict__, "temperature": 1.0, "seed": 7})
    run(logic.regenerate(conversation, sampled))
    messages = saved(logic).messages
    assert len(messages) == 4 and messages[2]["content"] == "Second question"
    run(logic.edit(conversation, 0, "📎 *ignored label*\n\nEdited question", SETTINGS))
    messages = saved(logic).messages
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "Edited question"
    refused = run(logic.edit(conversation, 1, "not mine", SETTINGS))
    assert "Only your own messages" in refused[-1].status


def test_over_the_limit_nothing_is_sent_until_a_cut_is_chosen(logic):
    document = (DATA / "apache-2.0.txt").read_text()[:3000].strip()  # about 600 tokens; the context is 256
    (view,) = run(logic.send("What is this?", None, document, None, SETTINGS))
    assert view.over_limit and view.cuts_possible and "too many" in view.over_limit
    assert logic.store.list() == []  # nothing sent, nothing saved
    longer = dict((pair_id, label) for label, pair_id in view.longer_pairs)
    assert "embedded" in longer and all("tokens" in label for label in longer.values())
    switch = logic.switch_pair(next(pair_id for pair_id in longer if pair_id != "embedded"))
    assert "not downloaded" in switch.status and "kept" in switch.status  # offline here: nothing to load
    cut = logic.cut("middle", "What is this?", view.attachment, "", None, SETTINGS)
    assert "from the middle" in cut.attachment["note"] and "tokens cut" in cut.attachment["text"]
    views = run(logic.send("What is this?", cut.attachment, "", None, SETTINGS))
    conversation = views[-1].conversation
    assert conversation.messages[-1]["role"] == "assistant" and conversation.messages[-1]["content"] is not None
    assert document[:200] in model_messages(conversation)[0]["content"]  # the start kept
    assert document[-200:] in model_messages(conversation)[0]["content"]  # and the end


def test_conversations_survive_a_new_store_on_the_same_folder(logic):
    conversation = run(logic.send("Remember me", None, "", None, SETTINGS))[-1].conversation
    logic.rename(conversation, "Kept")
    again = HistoryStore(logic.store.folder)
    assert [summary.title for summary in again.list()] == ["Kept"]
    assert again.load(conversation.id).messages[0]["content"] == "Remember me"
    logic.delete(conversation)
    assert again.list() == []


@pytest.fixture
def small_line(tiny_model_dir, tmp_path):
    handle = EngineHandle(lambda model, progress: load_engine(model, progress), str(tiny_model_dir), max_waiting=1)
    handle.get()
    yield ChatLogic(handle, HistoryStore(tmp_path / "conversations"))
    handle.close()


def test_an_answer_waits_in_the_engines_line_and_stop_takes_it_out(small_line):
    gate, held = holding(small_line.handle)
    try:
        views = small_line.send("Waiting here", None, "", None, SETTINGS, session="s1")
        statuses = [next(views).status for _ in range(3)]  # the question, the start, the wait
        assert statuses[-1] == "Waiting for the engine: 1 answer before yours…"
        small_line.stop("s1")
        (last,) = run(views)
        assert last.status == "Stopped before the answer started."
        assert [m["role"] for m in saved(small_line).messages] == ["user"]  # the question stays
    finally:
        gate.set()
    assert list(held) == ["held"]
    conversation = run(small_line.send("Now answer", None, "", None, SETTINGS))[-1].conversation
    assert conversation.messages[-1]["role"] == "assistant" and not conversation.messages[-1]["partial"]


def test_a_full_line_is_one_busy_line_and_the_question_stays(small_line):
    gate, held = holding(small_line.handle)
    waiting = small_line.handle.submit(lambda engine, cancel: iter(["waited"]))  # the line (of one) is full
    try:
        views = run(small_line.send("Am I too late?", None, "", None, SETTINGS))
        assert views[-1].status == "⚠️ busy: 1 requests waiting, try again shortly"
        assert [(m["role"], m["content"]) for m in saved(small_line).messages] == [("user", "Am I too late?")]
    finally:
        gate.set()
    assert list(held) == ["held"] and list(waiting) == ["waited"]


def test_a_new_answer_in_the_same_session_ends_the_one_the_page_left(logic):
    """The page leaves an answer without closing it (another conversation opened mid-answer);
    the session's next question cancels it, so the engine need not wait for the stall backstop."""
    left = logic.send("Tell me a long story", None, "", None, SETTINGS, session="s1")
    while "s1" not in logic._cancels:  # until the answer has its place in the engine's line
        next(left)
    left_ticket = logic._cancels["s1"]
    answered = run(logic.send("Hello", None, "", None, SETTINGS, session="s1"))[-1].conversation
    assert answered.messages[-1]["role"] == "assistant" and not answered.messages[-1]["partial"]
    assert left_ticket.cancel_event.is_set()


def test_an_opened_conversation_brings_back_its_own_system_prompt_and_preset(logic):
    settings = dataclasses.replace(SETTINGS, system="Answer in French.", preset="answer")
    conversation = run(logic.send("Hello", None, "", None, settings))[-1].conversation
    view = logic.open(conversation.id)
    assert (view.system, view.preset) == ("Answer in French.", "answer")
    assert (logic.newest().system, logic.newest().preset) == ("Answer in French.", "answer")  # after a reload
