"""Follow-ups on a long document without a click, choices only where they make room, every error's
reason in the page, and what is typed, attached and pasted kept with its own conversation; on the
tiny model (256-token context). The browser tests drive the same code through the page."""

import dataclasses
import functools
from types import SimpleNamespace

import gradio as gr
import pytest

from conftest import DATA, run, saved
from specchat.app import chat_over_limit as over_limit
from specchat.app.chat_view import ASK_FIRST, LEAVE_OUT_OLDEST, Settings, View
from specchat.app.conversation import LEFT_OUT, model_messages, shown_messages
from specchat.app.presets import PRESETS
from specchat.app.ui import _ChatHandlers, _preset_chosen
from specchat.app.ui_chat_page import chat_page
from specchat.core.errors import InputError

SETTINGS = Settings(system="", preset="free", temperature=0.0, top_p=1.0, top_k=0, seed=None,
                    max_new_tokens=24, mode="auto")
# About 125 tokens of question: beside a 120-token document it cannot fit a 256-token context.
LONG_QUESTION = "Does it say anything about " + "patents and trademarks and " * 25 + "the rest?"


@pytest.fixture
def handlers(logic):
    with gr.Blocks():
        page = chat_page(lambda: "")
    return _ChatHandlers(page, logic)


def shown_status(views) -> str:
    """The status line as the views leave it drawn (None: a view leaves it as it was)."""
    return [view.status for view in views if view.status is not None][-1]


def page_values(settings: Settings) -> list:
    """The settings as the page sends them, one value per component."""
    return [getattr(settings, field.name) for field in dataclasses.fields(Settings)]


def test_a_follow_up_that_does_not_fit_leaves_the_oldest_turns_out_unasked_and_says_so(logic):
    document = (DATA / "apache-2.0.txt").read_text()[:250].strip()
    settings = dataclasses.replace(SETTINGS, max_new_tokens=40)
    assert settings.follow_up_room == LEAVE_OUT_OLDEST  # the default
    conversation = run(logic.send("What is this?", None, document, None, settings))[-1].conversation
    question = "And what else does it say about it?"
    for _ in range(8):  # follow-ups until one does not fit (the tiny model's answers vary in length)
        views = run(logic.send(question, None, "", conversation, settings))
        assert not any(view.over_limit for view in views)  # never a choice to click
        if any(message.get("left_out") for message in conversation.messages):
            break
    kept = saved(logic)
    left = [index for index, message in enumerate(kept.messages) if message.get("left_out")]
    assert left and left[0] == 0  # the oldest first
    assert all(kept.messages[index + 1].get("left_out") for index in left if kept.messages[index]["role"] == "user")
    answer = kept.messages[-1]
    assert answer["role"] == "assistant" and not answer["partial"] and not answer.get("left_out")
    status = shown_status(views)
    assert status.startswith("✂ The ") and "left out of what the model reads" in status
    assert all(LEFT_OUT in shown_messages(kept)[index]["content"] for index in left)  # marked in the chat
    read = model_messages(kept)
    assert document in read[0]["content"] and read[-2] == {"role": "user", "content": question}


def test_leaving_turns_out_is_offered_only_where_it_makes_room(logic):
    document = (DATA / "apache-2.0.txt").read_text()[:600].strip()  # about 120 tokens: it stays
    conversation = run(logic.send("What is this?", None, document, None, SETTINGS))[-1].conversation
    for room in (LEAVE_OUT_OLDEST, ASK_FIRST):
        (view,) = run(logic.send(LONG_QUESTION, None, "", conversation,
                                 dataclasses.replace(SETTINGS, follow_up_room=room)))
        assert view.over_limit and not view.can_leave_out and view.message == LONG_QUESTION
    assert not any(message.get("left_out") for message in saved(logic).messages)  # nothing left out in vain
    with pytest.raises(InputError, match="still not enough"):
        over_limit.leave_out_turns(logic, LONG_QUESTION, None, "", conversation, SETTINGS)


def test_a_cut_is_offered_only_where_it_leaves_some_of_the_document(logic):
    (view,) = run(logic.send(LONG_QUESTION * 2, None, "A short note.", None, SETTINGS))
    assert view.over_limit and view.cuts is None and not view.can_leave_out
    assert "Nothing here can make room" not in view.over_limit  # a longer-context pair still can
    assert view.longer_pairs


def test_a_choice_that_fails_says_why_in_the_page_and_the_stale_choices_go(logic, handlers):
    document = (DATA / "apache-2.0.txt").read_text()[:600].strip()
    conversation = run(logic.send("What is this?", None, document, None, SETTINGS))[-1].conversation
    page = handlers.page
    leave_out = handlers.choose_then_send(functools.partial(over_limit.leave_out_turns, logic))
    drawn = list(leave_out(SimpleNamespace(session_hash="s"), {"text": LONG_QUESTION, "files": []}, None, "",
                           conversation, *page_values(SETTINGS)))
    last = drawn[-1]
    assert "still not enough" in last[page.status] and last[page.over_group]["visible"] is False
    assert len(saved(logic).messages) == 2  # nothing sent


def test_a_choice_that_works_sends_the_question_as_it_left_it(logic, handlers):
    document = (DATA / "apache-2.0.txt").read_text()[:3000].strip()  # about 600 tokens
    cut = handlers.choose_then_send(lambda *args: over_limit.cut(logic, "end", *args))
    drawn = list(cut(SimpleNamespace(session_hash="s"), {"text": "What is this?", "files": []}, None, document,
                     None, *page_values(SETTINGS)))
    (question, answer) = saved(logic).messages
    assert "from the end" in question["document"]["note"] and answer["content"]
    assert not any(str(value).startswith("⚠️") for value in drawn[-1].values())


def test_what_is_typed_attached_and_pasted_stays_with_its_conversation(logic, handlers):
    page = handlers.page
    first = run(logic.send("First", None, "", None, SETTINGS))[-1].conversation
    second = run(logic.send("Second", None, "", None, SETTINGS))[-1].conversation
    notes = logic.attach("notes.txt", "Some notes.")
    opened = handlers.moving(logic.open)({}, second, {"text": "About these notes?", "files": []}, notes,
                                         "pasted here", "free", first.id)
    assert opened[page.conversation].id == first.id
    assert opened[page.attachment] is None and opened[page.message]["text"] == "" and opened[page.pasted] == ""
    back = handlers.moving(logic.open)(opened[page.drafts], first, {"text": "", "files": []}, None, "", "free",
                                       second.id)
    assert back[page.attachment] == notes and back[page.message]["text"] == "About these notes?"
    assert back[page.pasted] == "pasted here"
    new = handlers.moving(lambda: View(clear_conversation=True))(back[page.drafts], second, {"text": "Typed"},
                                                                 notes, "", "summarize")
    assert new[page.message]["text"] == "Summarize this document." and new[page.attachment] is None
    again = handlers.moving(logic.open)(new[page.drafts], None, {"text": ""}, None, "", "summarize", second.id)
    assert again[page.message]["text"] == "Typed" and again[page.attachment] == notes
    # What was started in a new conversation comes back to a new one (a 100-page PDF attached, then
    # a look at an older conversation), once: sent or not, the box holds it from then on.
    typed_new = handlers.moving(lambda: View(clear_conversation=True))(again[page.drafts], second, {"text": ""},
                                                                       None, "", "free")
    looked = handlers.moving(logic.open)(typed_new[page.drafts], None, {"text": "About the report?"}, notes, "",
                                         "free", first.id)
    back_new = handlers.moving(lambda: View(clear_conversation=True))(looked[page.drafts], first, {"text": ""},
                                                                      None, "", "free")
    assert back_new[page.message]["text"] == "About the report?" and back_new[page.attachment] == notes
    afresh = handlers.moving(lambda: View(clear_conversation=True))(back_new[page.drafts], None, {"text": "x"},
                                                                    notes, "", "free")
    assert afresh[page.message]["text"] == "" and afresh[page.attachment] is None  # New on a new one: afresh
    reopened = handlers.moving(lambda: View(clear_conversation=True))(
        handlers.moving(logic.open)(afresh[page.drafts], None, {"text": ""}, None, "", "free", first.id)[page.drafts],
        first, {"text": ""}, None, "", "free")
    assert reopened[page.message]["text"] == "" and reopened[page.attachment] is None


def test_a_chosen_preset_sets_its_repetition_penalty_and_an_opened_conversations_own_stays(logic):
    *_, penalty = _preset_chosen("summarize", {"text": "", "files": []}, None)
    assert penalty == 1.1
    summarized = run(logic.send("Hello", None, "", None, dataclasses.replace(SETTINGS, preset="summarize")))
    conversation = summarized[-1].conversation
    *_, kept = _preset_chosen("summarize", {"text": ""}, conversation)
    assert kept == conversation.settings["repetition_penalty"]
    # Found: back from another preset, the other's temperature stayed (0.7 used and saved in a 0.0 chat).
    free = run(logic.send("Hello", None, "", None, SETTINGS))[-1].conversation
    assert _preset_chosen("summarize", {"text": ""}, free)[2] == PRESETS["summarize"].temperature != 0.0
    assert _preset_chosen("free", {"text": ""}, free)[2:] == (0.0, 1.0, SETTINGS.repetition_penalty)


def test_an_edit_that_does_not_fit_changes_nothing_and_waits_in_the_box(logic):
    # Found: the turns after an edited question were deleted and saved before anything was
    # measured; the answer then failed "too long", or its limit was cut to what was left.
    conversation = run(logic.send("First question", None, "", None, SETTINGS))[-1].conversation
    run(logic.send("Second question", None, "", conversation, SETTINGS))
    before = saved(logic).messages
    too_long = LONG_QUESTION * 3
    for room in (LEAVE_OUT_OLDEST, ASK_FIRST):  # nothing before the first question to leave out
        (view,) = run(logic.edit(conversation, 0, too_long, dataclasses.replace(SETTINGS, follow_up_room=room)))
        assert "does not fit" in view.status and "Nothing was changed" in view.status
        assert view.message == too_long and saved(logic).messages == before


def test_an_edit_makes_room_by_leaving_the_oldest_turns_out_as_a_follow_up_does(logic):
    document = (DATA / "apache-2.0.txt").read_text()[:250].strip()
    conversation = run(logic.send("What is this?", None, document, None, SETTINGS))[-1].conversation
    run(logic.send("And then?", None, "", conversation, SETTINGS))
    asked_before = dataclasses.replace(conversation, messages=conversation.messages[:2])
    question = next(question for question in ("Does it say anything about " + "patents and " * count + "the rest?"
                                              for count in range(1, 200))
                    if logic.meter(asked_before, None, "", question, SETTINGS).over)  # just past the limit
    ask_first = dataclasses.replace(SETTINGS, follow_up_room=ASK_FIRST)
    assert "does not fit" in run(logic.edit(conversation, 2, question, ask_first))[-1].status
    views = run(logic.edit(conversation, 2, question, SETTINGS))
    kept = saved(logic).messages
    assert [message.get("left_out", False) for message in kept] == [True, True, False, False]
    assert kept[2]["content"] == question and kept[3]["role"] == "assistant" and not kept[3]["partial"]
    assert shown_status(views).startswith("✂ The oldest turn was left out")


def test_a_retry_that_no_longer_fits_its_answer_limit_changes_nothing(logic):
    document = (DATA / "apache-2.0.txt").read_text()[:600].strip()  # about 120 tokens
    conversation = run(logic.send("What is this?", None, document, None, SETTINGS))[-1].conversation
    before = saved(logic).messages
    (view,) = run(logic.regenerate(conversation, dataclasses.replace(SETTINGS, max_new_tokens=200)))
    assert "does not fit" in view.status and saved(logic).messages == before


def test_a_file_that_cannot_be_read_leaves_the_box_and_sends_nothing(logic, handlers, tmp_path, monkeypatch):
    # Found: the file stayed in the box, and every Send failed again with the upload folder's path.
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "uploads"))
    binary = tmp_path / "uploads" / "f00d" / "notes.txt"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"\x00\x01binary\xff" * 100)
    page = handlers.page
    drawn = list(handlers.send_message(SimpleNamespace(session_hash="s"), {"text": "Say hello.", "files": [str(binary)]},
                                       None, "", None, *page_values(SETTINGS)))
    assert drawn[-1][page.message] == {"text": "Say hello.", "files": []}
    status = drawn[-1][page.status]
    assert status.startswith("⚠️ notes.txt ") and str(binary.parent) not in status and "your text stays" in status
    assert logic.store.list() == []  # nothing sent


def test_a_second_file_says_which_one_it_replaces(logic, handlers, tmp_path, monkeypatch):
    # Found: a question carries one document, and a second file replaced the first without a word.
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "uploads"))
    second = tmp_path / "uploads" / "beef" / "beta.md"
    second.parent.mkdir(parents=True)
    second.write_text("Beta notes.")
    view = handlers.attach_dropped({"text": "Compare?", "files": [str(second)]}, {"name": "alpha.txt", "text": "A."})
    assert view.status == "Attached beta.md in place of alpha.txt." and view.attachment["name"] == "beta.md"
    assert handlers.attach_dropped({"text": "", "files": [str(second)]}).status == "Attached beta.md."
