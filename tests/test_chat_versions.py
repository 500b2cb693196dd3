"""Retry keeps every version of the last answer, to page through, saved with the conversation; on
the tiny model (256-token context). The browser test drives the same through the page."""

import dataclasses
import json

import gradio as gr
import pytest

from conftest import holding
from specchat.app import chat_versions as versions
from specchat.app.chat_view import Settings, View
from specchat.app.conversation import from_json, model_messages, to_json
from specchat.app.engine_handle import EngineHandle
from specchat.app.history import HistoryStore
from specchat.app.ui_chat import ChatLogic
from specchat.app.ui_chat_page import chat_page, render
from specchat.core.loading import load_engine

SETTINGS = Settings(system="", preset="free", temperature=1.0, top_p=1.0, top_k=0, seed=None,
                    max_new_tokens=12, mode="auto")


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


def seeded(seed: int) -> Settings:
    return dataclasses.replace(SETTINGS, seed=seed)


def test_retry_keeps_every_version_pages_through_them_and_the_conversation_goes_on_from_the_shown_one(logic):
    conversation = run(logic.send("Hello", None, "", None, seeded(1)))[-1].conversation
    answers = [conversation.messages[-1]["content"]]
    for seed in (2, 3):
        run(logic.regenerate(conversation, seeded(seed)))
        answers.append(conversation.messages[-1]["content"])
    last = saved(logic).messages[-1]
    assert [v["content"] for v in versions.all_versions(last)] == answers and versions.pager(conversation) == (3, 3)
    assert all(v["stats"]["target_forwards"] >= 1 for v in versions.all_versions(last))  # each keeps its figures
    assert len(saved(logic).messages) == 2  # one question, one answer with three versions

    view = logic.page_version(conversation, -1)
    assert view.conversation.messages[-1]["content"] == answers[1] and versions.pager(view.conversation) == (2, 3)
    assert view.stats.startswith("**") and "tokens" in view.stats  # the shown version's own figures
    reopened = logic.open(conversation.id).conversation  # saved as paged: a reload shows the same version
    assert versions.pager(reopened) == (2, 3) and reopened.messages[-1]["content"] == answers[1]
    assert model_messages(reopened)[-1]["content"] == answers[1]  # what the model goes on from
    assert logic.page_version(reopened, -5).conversation.messages[-1]["content"] == answers[0]  # stops at the first
    assert logic.page_version(reopened, 9).conversation.messages[-1]["content"] == answers[2]

    run(logic.send("And then?", None, "", reopened, seeded(4)))  # a follow-up leaves the versions where they were
    messages = saved(logic).messages
    assert len(messages) == 4 and versions.pager(dataclasses.replace(reopened, messages=messages[:2])) == (3, 3)
    assert "versions" not in messages[-1]
    assert "no other version" in logic.page_version(reopened, -1).status


def test_a_retry_stopped_in_the_line_keeps_the_answer_it_was_to_replace(logic):
    conversation = run(logic.send("Hello", None, "", None, seeded(1)))[-1].conversation
    before = saved(logic).messages
    gate, held = holding(logic.handle)
    try:
        views = logic.regenerate(conversation, seeded(2), session="s1")
        [next(views) for _ in range(2)]  # the start, the wait
        logic.stop("s1")
        assert run(views)[-1].status == "Stopped before the answer started."
    finally:
        gate.set()
    assert list(held) == ["held"]
    assert saved(logic).messages == before and conversation.messages == before


def test_the_pager_shows_where_the_answer_has_versions_and_hides_while_one_streams(logic):
    with gr.Blocks():
        page = chat_page(lambda: "")
    conversation = run(logic.send("Hello", None, "", None, seeded(1)))[-1].conversation
    assert render(page, View(conversation=conversation), list)[page.older]["visible"] is False
    run(logic.regenerate(conversation, seeded(2)))
    drawn = render(page, View(conversation=conversation), list)
    assert drawn[page.version_label]["value"] == "Answer 2/2" and drawn[page.version_label]["visible"]
    assert drawn[page.older]["interactive"] and not drawn[page.newer]["interactive"]
    assert render(page, View(conversation=conversation, streaming=True), list)[page.older]["visible"] is False
    assert render(page, View(clear_conversation=True), list)[page.older]["visible"] is False


def record(last: dict) -> dict:
    return {"id": "a" * 32, "title": "t", "created": 1.0, "updated": 1.0, "system": "", "preset": "free",
            "messages": [{"role": "user", "content": "Hi", "document": None}, last], "settings": {}}


def test_a_conversation_saved_before_versions_still_opens_and_bad_versions_are_refused():
    old = {"role": "assistant", "content": "Hello", "partial": False, "stats": None, "origins": None,
           "finish_reason": "stop"}
    conversation = from_json(json.dumps(record(old)))
    assert versions.pager(conversation) == (1, 1)
    assert versions.all_versions(conversation.messages[-1])[0]["content"] == "Hello"
    retried = dict(versions.retried(old), content="Hi!", partial=False)
    again = from_json(to_json(dataclasses.replace(conversation, messages=[conversation.messages[0], retried])))
    assert [v["content"] for v in versions.all_versions(again.messages[-1])] == ["Hello", "Hi!"]
    for bad in ({"versions": "Hello"}, {"versions": [{"content": 3}]}, {"versions": [], "version": 1},
                {"versions": [old]}, {"versions": [{"content": "x", "stats": {"target_forwards": "many"}}]},
                {"versions": [{"content": "x"}], "version": True}):
        with pytest.raises(ValueError):
            from_json(json.dumps(record({**old, **bad})))
