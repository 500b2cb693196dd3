"""Retry keeps every version of the last answer, to page through, saved with the conversation;
Continue carries a cut answer on in the same message. On the tiny model (256-token context); the
browser test drives the same through the page."""

import dataclasses
import json

import gradio as gr
import pytest

from conftest import holding, run, saved
from specchat.app.answer_turns import STOPPED
from specchat.app import chat_versions as versions
from specchat.app.chat_view import Settings, View
from specchat.app.conversation import from_json, model_messages, to_json, to_markdown
from specchat.app.safe_markdown import inert_markdown
from specchat.app.ui_chat_page import chat_page, render
from specchat.core.errors import InputError

SETTINGS = Settings(system="", preset="free", temperature=1.0, top_p=1.0, top_k=0, seed=None,
                    max_new_tokens=12, mode="auto")


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
    exported = to_markdown(reopened)  # the shown version, then the others folded away
    shown_at, folded_at = exported.index(inert_markdown(answers[1])), exported.index("2 other versions of this answer")
    assert shown_at < folded_at < exported.index(inert_markdown(answers[0])) < exported.index(inert_markdown(answers[2]))
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
        assert run(views)[-1].status == STOPPED
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


GREEDY = dataclasses.replace(SETTINGS, temperature=0.0, max_new_tokens=6)


def cut_answer(logic, settings=GREEDY):
    conversation = run(logic.send("Tell me a story", None, "", None, settings))[-1].conversation
    assert conversation.messages[-1]["finish_reason"] == "length"  # the random tiny model never ends on its own
    return conversation


def test_continue_carries_a_cut_answer_on_from_inside_the_assistants_turn(logic):
    conversation = cut_answer(logic)
    start = conversation.messages[-1]["content"]
    assert versions.can_continue(conversation)
    engine = logic.handle.get()
    # The prompt is the question's, then the answer so far, with no end of turn: the model goes on from it.
    asked = engine.chat_ids(model_messages(conversation)[:-1])
    prompt = versions.continued_ids(engine, model_messages(conversation))
    assert prompt[:len(asked)] == asked and engine.tokenizer.decode(prompt[len(asked):]) == start

    views = run(logic.continue_answer(conversation, GREEDY))
    reply = saved(logic).messages[-1]
    assert len(saved(logic).messages) == 2  # the same message, no new one
    assert reply["content"].startswith(start) and len(reply["content"]) > len(start)
    assert reply["new_tokens"] == 12 and reply["continued"] == 1 and reply["finish_reason"] == "length"
    assert "".join(text for text, _ in reply["origins"]) == reply["content"]
    assert "continued once" in views[-1].stats and not versions.can_continue(None)
    with gr.Blocks():
        page = chat_page(lambda: "")
    assert render(page, View(conversation=conversation), list)[page.go_on]["visible"]  # cut again: offered again
    assert render(page, View(conversation=conversation, streaming=True), list)[page.go_on]["visible"] is False


def test_stop_during_continue_keeps_what_was_added_and_a_stop_in_the_line_keeps_the_answer(logic):
    conversation = cut_answer(logic, dataclasses.replace(GREEDY, max_new_tokens=4))
    start = conversation.messages[-1]["content"]
    long = dataclasses.replace(GREEDY, max_new_tokens=200)
    views = logic.continue_answer(conversation, long, session="s1")
    for view in views:
        if view.conversation.messages[-1]["content"] != start:  # something was added: Stop
            logic.stop("s1")
            break
    run(views)
    reply = saved(logic).messages[-1]
    assert reply["finish_reason"] == "cancelled" and not reply["partial"] and reply["content"].startswith(start)
    assert 4 < reply["new_tokens"] < 204 and versions.can_continue(conversation)  # a stopped answer goes on too

    before = saved(logic).messages
    gate, held = holding(logic.handle)
    try:
        views = logic.continue_answer(conversation, long, session="s1")
        [next(views) for _ in range(2)]  # the start, the wait
        logic.stop("s1")
        assert run(views)[-1].status == STOPPED
    finally:
        gate.set()
    assert list(held) == ["held"] and saved(logic).messages == before == conversation.messages


def test_continue_is_offered_only_for_an_answer_cut_with_room_to_go_on():
    def chat(**answer):
        return from_json(json.dumps(record({"role": "assistant", "content": "Once", "partial": False, **answer})))

    assert versions.can_continue(chat(finish_reason="length"))
    assert versions.can_continue(chat(finish_reason="cancelled"))
    assert versions.can_continue(chat(finish_reason="error", error="the GPU ran out of memory"))
    for not_cut in ({"finish_reason": "stop"}, {"finish_reason": "repeating"},
                    {"finish_reason": "length", "context_full": True}, {"finish_reason": "length", "content": ""},
                    {"finish_reason": "length", "partial": True}, {"finish_reason": "length", "left_out": True}):
        assert not versions.can_continue(chat(**not_cut))
    for bad in (-1, "2", True):
        with pytest.raises(ValueError):
            chat(finish_reason="length", continued=bad)


def test_continue_says_why_it_cannot_go_on(logic):
    class Refusing:
        name = "refusing-model"

        class tokenizer:
            @staticmethod
            def apply_chat_template(*args, **kwargs):
                raise ValueError("the final message does not appear in the chat ... " + "x" * 9000)

    with pytest.raises(InputError, match="refusing-model's chat template cannot continue an answer") as refused:
        versions.continued_ids(Refusing, [{"role": "assistant", "content": "Once"}])
    assert len(str(refused.value)) < 200  # not the whole chat the template's error quotes
    assert "can be continued" in run(logic.continue_answer(None, GREEDY))[-1].status

    # An answer that fills the context: the engine's reason shows in the status line, the answer as it was.
    conversation = logic.store.new()
    cut = {"role": "assistant", "content": "word " * 300, "partial": False, "stats": None, "origins": None,
           "finish_reason": "length", "new_tokens": 300}
    conversation.messages = [{"role": "user", "content": "Say words", "document": None}, dict(cut)]
    logic.store.save(conversation)
    views = run(logic.continue_answer(conversation, GREEDY))
    assert views[-1].status.startswith("⚠️ the prompt is") and "reads at most 256" in views[-1].status
    assert saved(logic).messages[-1] == cut == conversation.messages[-1]


def test_a_saved_setting_the_page_cannot_take_keeps_the_pages_value(logic):
    """A conversation edited by hand, or saved by another version, with a value out of a slider's
    range or a radio's choices: Gradio's input check would refuse every later send."""
    with gr.Blocks():
        page = chat_page(lambda: "")
    conversation = run(logic.send("Hello", None, "", None, seeded(1)))[-1].conversation
    settings = {"max_new_tokens": 100_000, "mode": "warp", "temperature": 0.7, "seed": "5", "top_k": -3}
    drawn = render(page, View(conversation=conversation, settings=settings), list)
    assert drawn[page.temperature] == 0.7 and drawn[page.seed] == "5"
    for component in (page.max_new_tokens, page.mode, page.top_k):
        assert drawn[component] == gr.update()
