"""The chat tab's behaviour without a browser, on the tiny model (256-token context): what is
saved when, stop, regenerate, edit, and the over-limit choice. The browser tests drive the same
code through the page."""

import dataclasses
import re
import threading
import time

import pytest

from conftest import DATA, holding, run, saved
from specchat.app.answer_turns import STOPPED
from specchat.app import chat_over_limit as over_limit
from specchat.app import chat_versions as versions
from specchat.app.conversation import model_messages
from specchat.app.engine_handle import EngineHandle
from specchat.app.history import HistoryStore
from specchat.app.chat_view import ASK_FIRST, KEPT_SETTINGS, Settings
from specchat.app.ui_chat import ChatLogic
from specchat.core.errors import InputError
from specchat.core.loading import load_engine

SETTINGS = Settings(system="", preset="free", temperature=0.0, top_p=1.0, top_k=0, seed=None,
                    max_new_tokens=24, mode="auto")


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
    # The list is drawn as the question is saved and again as the answer ends (its time moved).
    assert first.conversations_changed and rest[-1].conversations_changed


def test_a_streaming_answer_redraws_the_page_a_few_times_a_second_not_per_step(logic):
    from specchat.app.answer_stream import STREAM_UPDATE_SECONDS

    started = time.monotonic()
    views = run(logic.send("Tell me a story", None, "", None, Settings(**{**SETTINGS.__dict__, "max_new_tokens": 160})))
    seconds = time.monotonic() - started
    reply = saved(logic).messages[-1]
    drawn = [view for view in views if view.stats]  # the answer's text and figures while it streams
    assert reply["stats"]["target_forwards"] > len(drawn) >= 1
    assert len(drawn) <= seconds / STREAM_UPDATE_SECONDS + 2
    assert views[-1].conversation.messages[-1]["content"] == reply["content"]  # the end drawn whole


def test_stop_keeps_the_answer_so_far(logic, monkeypatch):
    from specchat.app import answer_stream

    # The tiny model can write 160 tokens within one 0.25 s batch: the first batch comes sooner.
    monkeypatch.setattr(answer_stream, "STREAM_UPDATE_SECONDS", 0.01)
    long = Settings(**{**SETTINGS.__dict__, "max_new_tokens": 160})  # far from its end when stopped
    views = logic.send("Tell me a story", None, "", None, long)
    streamed = []
    for view in views:  # the question, the start, the prompt, then the first batch of tokens
        streamed.append(view)
        if view.stats:
            break
    views.close()  # what the page's Stop does to the handler
    reply = saved(logic).messages[-1]
    assert reply["content"] and reply["role"] == "assistant" and not reply["partial"]
    assert reply["finish_reason"] == "cancelled"
    assert reply["content"] == streamed[-1].conversation.messages[-1]["content"]
    # Found: an answer cut off by leaving it showed "? tokens, stopped".
    assert 0 < reply["new_tokens"] < 160 and "?" not in versions.figures(reply)["stats"]


def test_a_cut_label_says_how_much_of_the_document_goes_and_never_zero():
    from specchat.app.chat_over_limit import _cut_labels

    assert "(25% of the document) from its start" in _cut_labels(250, {"tokens": 1000})["start"]
    assert "Cut 3 tokens (under 1% of the document)" in _cut_labels(3, {"tokens": 19_000})["end"]


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
    assert view.over_limit and view.cuts and "too many" in view.over_limit
    assert view.message == "What is this?" and view.attachment["text"] == document  # kept for the choice
    assert all("% of the document" in label for label in view.cuts.values())
    assert logic.store.list() == []  # nothing sent, nothing saved
    longer = dict((pair_id, label) for label, pair_id in view.longer_pairs)
    assert "embedded" in longer and all("tokens" in label for label in longer.values())
    assert re.fullmatch(r"Qwen2\.5 7B Instruct.* \(131,072 tokens · [\d.]+ GB, to download\)", longer["qwen2.5-7b"]), longer
    switch = over_limit.switch_pair(logic.handle, logic.registry_file, "qwen2.5-7b")
    assert "not downloaded" in switch.status and "kept" in switch.status  # offline here: nothing to load
    cut = over_limit.cut(logic, "middle", "What is this?", view.attachment, "", None, SETTINGS)
    assert "from the middle" in cut.attachment["note"] and "tokens cut" in cut.attachment["text"]
    views = run(logic.send("What is this?", cut.attachment, "", None, SETTINGS))
    conversation = views[-1].conversation
    assert conversation.messages[-1]["role"] == "assistant" and conversation.messages[-1]["content"] is not None
    assert document[:200] in model_messages(conversation)[0]["content"]  # the start kept
    assert document[-200:] in model_messages(conversation)[0]["content"]  # and the end


def test_a_document_too_long_for_the_model_can_be_summarized_in_parts_then_asked_about(logic):
    document = (DATA / "apache-2.0.txt").read_text()[:1500].strip()  # about 300 tokens; the context is 256
    (view,) = run(logic.send("What is this?", None, document, None, SETTINGS))
    assert view.over_limit and view.in_parts and "it is read as 3 parts" in view.over_limit
    logic.pace = None  # no answer timed yet: no estimate before the first part
    assert "on this machine" not in over_limit.offer(logic, logic.meter(None, view.attachment, "", "What is this?",
                                                                        SETTINGS), view.attachment, "What is this?",
                                                     None, SETTINGS).over_limit
    views = run(over_limit.summarize_in_parts(logic, "What is this?", view.attachment, "", None, SETTINGS, session="s1"))
    pending = " ".join(v.pending for v in views if v.pending.startswith("⏳ *Summarizing part"))
    assert "part 1 of 3" in pending and "part 3 of 3" in pending
    left = r"(about \d+ (s|min)|a moment) left for the parts"
    assert re.search(rf"part 2 of 3 \(the document is too long to read whole\)…\* {left}", pending), pending
    assert logic.pace is not None and logic.pace.read_tokens_per_s > 0  # the parts' answers were timed
    (again,) = run(logic.send("What is this?", None, document, None, SETTINGS))
    assert re.search(r"read as 3 parts, (about \d+ (s|min)|a moment) on this machine", again.over_limit), again.over_limit
    conversation = saved(logic)
    question, answer = conversation.messages
    assert "not the whole text" in question["document"]["note"] and question["content"] == "What is this?"
    assert question["document"]["text"].startswith("Part 1 of ") and answer["role"] == "assistant"
    assert not answer["partial"] and "Apache License" in conversation.title


def test_a_shorter_answer_limit_is_offered_when_the_prompt_leaves_room_for_one(logic):
    document = (DATA / "apache-2.0.txt").read_text()[:300].strip()  # about 60 tokens of a 256 context
    greedy = dataclasses.replace(SETTINGS, max_new_tokens=240)
    (view,) = run(logic.send("What is this?", None, document, None, greedy))
    assert view.over_limit and 128 <= view.answer_room < 240
    shorter = over_limit.shorter_answer(logic, "What is this?", view.attachment, "", None, greedy)
    assert shorter.settings == {"max_new_tokens": view.answer_room}
    fitted = dataclasses.replace(greedy, max_new_tokens=view.answer_room)
    assert run(logic.send("What is this?", view.attachment, "", None, fitted))[-1].conversation.messages[-1]["content"]


def test_a_follow_up_over_the_limit_can_leave_earlier_messages_out_and_the_document_stays(logic):
    document = (DATA / "apache-2.0.txt").read_text()[:250].strip()
    settings = dataclasses.replace(SETTINGS, max_new_tokens=40, follow_up_room=ASK_FIRST)  # else it is done unasked
    conversation = run(logic.send("What is this?", None, document, None, settings))[-1].conversation
    question = "And what else does it say about it?"
    for _ in range(6):  # follow-ups until one does not fit (the tiny model's answers vary in length)
        view = run(logic.send(question, None, "", conversation, settings))[-1]
        if view.over_limit:
            break
    assert view.over_limit and view.can_leave_out and not view.cuts and len(conversation.messages) >= 4
    left = over_limit.leave_out_turns(logic, question, None, "", conversation, settings)
    assert left.over_limit == "" and "documents stay" in left.status
    assert any(m.get("left_out") for m in saved(logic).messages)
    answered = run(logic.send(question, None, "", conversation, settings))[-1].conversation
    assert answered.messages[-1]["role"] == "assistant" and not answered.messages[-1]["partial"]
    read = model_messages(answered)
    assert document in read[0]["content"] and read[-2] == {"role": "user", "content": question}


def test_a_reopened_conversation_keeps_every_setting_until_the_user_changes_one(logic):
    """Each setting the page sends is kept with the conversation and comes back as it is opened (a
    reload, a restart): the next question then saves exactly what was saved before."""
    assert {field.name for field in dataclasses.fields(Settings)} == set(KEPT_SETTINGS) | {"system", "preset"}
    chosen = Settings(system="Answer in French.", preset="answer", temperature=0.7, top_p=0.9, top_k=40, seed="7",
                      max_new_tokens=32, mode="chain")
    conversation = run(logic.send("Hello", None, "", None, chosen))[-1].conversation
    before = saved(logic)
    restarted = ChatLogic(logic.handle, HistoryStore(logic.store.folder))
    view = restarted.open(conversation.id)
    assert (view.system, view.preset, view.settings) == ("Answer in French.", "answer", chosen.kept())
    page = Settings(system=view.system, preset=view.preset, **view.settings)  # what the page sends back
    run(restarted.send("And then?", None, "", view.conversation, page))
    after = saved(logic)
    assert (after.system, after.preset, after.settings) == (before.system, before.preset, before.settings)


def test_a_conversation_reopened_after_a_restart_starts_from_its_documents_saved_kv(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))  # no document saved by another test
    document = (DATA / "apache-2.0.txt").read_text()[:400].strip()
    settings = dataclasses.replace(SETTINGS, max_new_tokens=16)

    def started():
        handle = EngineHandle(lambda model, progress: load_engine(model, progress), str(tiny_model_dir))
        handle.get()
        return handle, ChatLogic(handle, HistoryStore(tmp_path / "conversations"))

    handle, logic = started()
    conversation = run(logic.send("What is this?", None, document, None, settings))[-1].conversation
    handle.close()
    handle, restarted = started()  # a new engine: nothing in memory
    try:
        reopened = restarted.open(conversation.id).conversation
        answered = run(restarted.send("And then?", None, "", reopened, settings))[-1].conversation
        stats = answered.messages[-1]["stats"]
        assert stats["reused_from"] == "disk" and stats["reused_prompt_tokens"] >= 60
    finally:
        handle.close()


@pytest.fixture
def loading_logic(tiny_model_dir, tmp_path):
    """A ChatLogic whose model loads until the test sets the event it gets along."""
    release = threading.Event()

    def load(model, progress):
        progress("Reading the weights...")
        release.wait(60)
        return load_engine(model, progress)

    handle = EngineHandle(load, str(tiny_model_dir))
    yield ChatLogic(handle, HistoryStore(tmp_path / "conversations")), release
    release.set()
    handle.close()


def test_a_question_sent_while_the_model_loads_survives_the_tab_closing(loading_logic):
    logic, release = loading_logic
    views = logic.send("What is this about?", None, "Some pasted notes.", None, SETTINGS, "tab")
    first = next(views)
    assert first.message == "" and first.conversation.messages[-2]["content"] == "What is this about?"
    assert "Loading the model" in first.pending and "Reading the weights" in first.pending
    (question,) = saved(logic).messages  # on disk while the model still loads
    assert question["content"] == "What is this about?" and question["document"]["text"] == "Some pasted notes."
    views.close()  # the tab closed
    reopened = saved(logic)
    assert reopened.messages == [question] and reopened.title != "New conversation"
    release.set()
    run(logic.regenerate(reopened, SETTINGS))  # what the reopened page's Regenerate does
    answered = saved(logic).messages
    assert [m["role"] for m in answered] == ["user", "assistant"] and answered[1]["content"]


def test_a_question_sent_while_the_model_loads_is_answered_and_saved_once(loading_logic):
    logic, release = loading_logic
    views = logic.send("Hello there", None, "", None, SETTINGS, "tab")
    next(views)
    release.set()
    rest = run(views)
    (summary,) = logic.store.list()  # the question saved while loading became this conversation
    answered = logic.store.load(summary.id).messages
    assert [m["role"] for m in answered] == ["user", "assistant"] and answered[0]["content"] == "Hello there"
    assert answered[1]["content"] == rest[-1].conversation.messages[-1]["content"]
    assert [view.status for view in rest if view.status is not None][-1] == ""  # the status line ends empty


@pytest.mark.parametrize("new", [True, False], ids=["new conversation", "earlier conversation"])
def test_a_rename_while_the_model_loads_is_kept_and_the_question_answered_once(loading_logic, new):
    """A new conversation renamed while its question waited for the model was kept beside a second
    one holding the answer; an earlier one failed "changed meanwhile", its question unanswered."""
    logic, release = loading_logic
    earlier = None
    if not new:
        earlier = logic.store.new()
        earlier.messages = [{"role": "user", "content": "Earlier", "document": None},
                            {"role": "assistant", "content": "Earlier answer", "partial": False}]
        logic.store.save(earlier)
    views = logic.send("Second question", None, "", earlier, SETTINGS, "tab")
    logic.rename(next(views).conversation, "Named while loading")
    release.set()
    rest = run(views)
    assert not any("⚠️" in (view.status or "") for view in rest)
    (summary,) = logic.store.list()
    kept = logic.store.load(summary.id)
    assert kept.title == "Named while loading" and kept.messages[-2]["content"] == "Second question"
    assert [m["role"] for m in kept.messages] == ["user", "assistant"] * (1 if new else 2)


def test_a_file_attached_while_the_model_loads_attaches_at_once_and_is_counted_when_sent(loading_logic, tmp_path):
    logic, release = loading_logic
    notes = tmp_path / "notes.txt"
    notes.write_text("Some notes about the launch.")
    started = time.monotonic()
    attached = logic.attach_file(str(notes)).attachment
    assert time.monotonic() - started < 5 and attached["tokens"] is None  # not behind the model's load
    views = logic.send("What do they say?", attached, "", None, SETTINGS, "tab")
    next(views)
    release.set()
    run(views)
    (question, _) = saved(logic).messages
    assert question["document"]["tokens"] == logic.handle.get().count_tokens("Some notes about the launch.")


def test_stop_while_the_model_loads_puts_the_question_back_and_keeps_the_conversation_as_it_was(loading_logic):
    logic, _ = loading_logic
    earlier = logic.store.new()
    earlier.messages = [{"role": "user", "content": "Earlier", "document": None},
                        {"role": "assistant", "content": "Earlier answer", "partial": False}]
    logic.store.save(earlier)
    changed = dataclasses.replace(SETTINGS, system="Be brief.", max_new_tokens=99)  # on the page, never sent
    for conversation in (None, earlier):
        views = logic.send("Second thoughts", None, "", conversation, changed, "tab")
        next(views)
        logic.stop("tab")
        back = run(views)[-1]
        assert back.message == "Second thoughts" and "back in the box" in back.status
        assert back.clear_conversation == (conversation is None)
        kept = [logic.store.load(summary.id) for summary in logic.store.list()]
        assert [(c.messages, c.system, c.settings) for c in kept] == [(earlier.messages, "", earlier.settings)]


def test_a_deleted_conversation_comes_back_with_undo_and_repeated_titles_get_their_time(logic):
    first = run(logic.send("Same question", None, "", None, SETTINGS))[-1].conversation
    run(logic.send("Same question", None, "", None, SETTINGS))
    labels = [label for label, _ in logic.conversation_choices()]
    assert len(set(labels)) == 2 and all(label.startswith("Same question · ") for label in labels), labels
    deleted = logic.delete(first)
    assert deleted.deleted == first.id and first.id not in [i for _, i in logic.conversation_choices()]
    back = logic.undelete(deleted.deleted)
    assert back.conversation.id == first.id and back.deleted == "" and first.id in [i for _, i in logic.conversation_choices()]


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
        # Renamed meanwhile (the file moved on): the Stop takes the name, no "changed meanwhile".
        small_line.rename(saved(small_line), "Named while waiting")
        small_line.stop("s1")
        (last,) = run(views)
        assert last.status == STOPPED
        assert last.conversation.title == saved(small_line).title == "Named while waiting"
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


def test_a_longer_pair_offered_on_a_gpu_says_its_download_and_its_speed_there(monkeypatch):
    from specchat.app import models_cmd
    from specchat.core.hardware import HardwareProfile

    monkeypatch.setattr(models_cmd, "listing_profile", lambda: HardwareProfile.load(DATA / "profiles" / "rtx4090-24gb.json"))
    offered = {pair_id: label for label, pair_id in over_limit.longer_pairs(None, 9000, "embedded")}
    assert offered and all(re.search(r" · about \d+ tokens/s here\)$", label) for label in offered.values()), offered
    assert all(re.search(r"· [\d.]+ GB, (downloaded|to download) ·", label) for label in offered.values())


def test_the_meter_counts_a_document_once_while_its_parts_are_summarized(logic):
    """Summarizing in parts shows the question with its document while the page keeps the
    attachment (for Stop to give back): the meter must not add the two."""
    attachment = logic.attach("notes.txt", ("The quick brown fox jumps over the lazy dog. " * 8).strip())
    before = logic.meter(None, attachment, "", "Summarize this", SETTINGS)
    shown = logic.shown_turn(None, "Summarize this", attachment)
    during = logic.meter(shown, attachment, "", "", SETTINGS)
    assert during == before and during.history == 0 and during.document == attachment["tokens"]
    answered = logic.shown_turn(None, "Summarize this", attachment)
    answered.messages[-1].update(content="A fox.", partial=False)
    after = logic.meter(answered, attachment, "", "", SETTINGS)  # the same text attached again: counted again
    assert after.history > 0 and after.document == attachment["tokens"]


def test_leaving_a_conversation_cancels_a_file_still_being_read(tmp_path):
    """A file put in the box is read in its own line: opened elsewhere before the reading ends, it
    would land, with the box's question, in the conversation opened (seen in CI's browser run)."""
    from specchat.app.ui import build_ui

    demo = build_ui(EngineHandle(lambda _model, _progress: threading.Event().wait(), "never loads"),
                    HistoryStore(tmp_path))
    config = demo.config
    box = next(block["id"] for block in config["components"] if block["props"].get("elem_id") == "message")
    reading = {event["id"] for event in config["dependencies"] if (box, "change") in map(tuple, event["targets"])}
    listing = next(block["id"] for block in config["components"] if block["props"].get("elem_id") == "conversations")
    new = next(block["id"] for block in config["components"] if block["props"].get("elem_id") == "new-conversation")
    for target in ((listing, "input"), (new, "click")):
        moving = [event for event in config["dependencies"]
                  if target in map(tuple, event["targets"]) and event["cancels"]]
        assert moving and all(reading <= set(event["cancels"]) for event in moving), target


def test_two_tabs_on_one_conversation_never_write_over_each_other(logic):
    """Each tab holds its own copy: a question from a tab that has not seen the other's turn
    follows the saved turns (and says so); Retry on a stale copy shows the conversation as saved
    instead of retrying an answer the user no longer sees as the last."""
    first = run(logic.send("Question zero", None, "", None, SETTINGS))[-1].conversation
    tab_a, tab_b = logic.open(first.id).conversation, logic.open(first.id).conversation
    run(logic.send("From tab A", None, "", tab_a, SETTINGS, session="A"))
    views = run(logic.send("From tab B", None, "", tab_b, SETTINGS, session="B"))
    assert "had changed since it was shown" in views[0].status
    questions = [m["content"] for m in saved(logic).messages if m["role"] == "user"]
    assert questions == ["Question zero", "From tab A", "From tab B"]
    assert views[-1].conversation.messages == saved(logic).messages
    (refused,) = run(logic.regenerate(tab_a, SETTINGS, session="A"))
    assert "here it is as saved" in refused.status and refused.conversation.messages == saved(logic).messages
    assert len(saved(logic).messages) == 6


def test_an_answer_left_streaming_ends_in_the_copy_the_tab_reopened(logic):
    """Reopening the conversation whose answer still streams loads it as saved mid-answer; the
    answer then ends (saved); a follow-up from the reopened copy keeps the ended answer, never
    the stale copy's (which showed "(interrupted)" for ever)."""
    views = logic.send("Tell me a long story", None, "", None, Settings(**{**SETTINGS.__dict__, "max_new_tokens": 160}),
                       session="S")
    conversation = next(views).conversation  # the question saved; its answer to come
    reopened = logic.open(conversation.id).conversation
    assert next(views).streaming  # the answer started
    views.close()  # the page left it: stopped and saved
    ended = saved(logic).messages[-1]
    assert ended["role"] == "assistant" and len(reopened.messages) == 1
    run(logic.send("And then?", None, "", reopened, SETTINGS, session="S"))
    assert saved(logic).messages[1] == ended and ended["finish_reason"] == "cancelled"


def test_deleting_a_conversation_while_it_answers_keeps_it_deleted(logic):
    views = logic.send("Tell me a long story", None, "", None, Settings(**{**SETTINGS.__dict__, "max_new_tokens": 160}),
                       session="S")
    conversation = next(view.conversation for view in views if view.stats)
    deleted = logic.delete(conversation)
    views.close()  # the handler of the answer it cancelled closes, and saves no more
    assert logic.store.list() == [] and deleted.deleted == conversation.id
    logic.conversations.undelete(conversation.id)
    assert [m["content"] for m in saved(logic).messages][0] == "Tell me a long story"


def test_a_question_that_could_not_be_saved_is_only_in_the_box(logic, monkeypatch):
    """The page says to free space and send again: sending again must not ask it twice."""
    from specchat.app import history
    from specchat.core.errors import SpecchatError

    conversation = run(logic.send("First question", None, "", None, SETTINGS))[-1].conversation

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(history, "write_atomically", full_disk)
    with pytest.raises(SpecchatError, match="disk is full"):
        run(logic.send("Second question", None, "", conversation, SETTINGS))
    assert [m["content"] for m in conversation.messages if m["role"] == "user"] == ["First question"]
    monkeypatch.undo()
    run(logic.send("Second question", None, "", conversation, SETTINGS))
    assert [m["content"] for m in saved(logic).messages if m["role"] == "user"] == ["First question", "Second question"]


def test_half_an_emoji_from_the_page_is_a_replacement_character_not_an_error(logic):
    """A browser's string can hold an unpaired surrogate (text cut inside an emoji); the tokenizer
    raised TypeError on it, shown as "unexpected error"."""
    broken = "Is this \ud83d fine?"
    assert "tokens** (prompt + the answer limit)" in logic.meter_text(None, None, broken, broken, SETTINGS)
    views = run(logic.send(broken, None, broken, None, SETTINGS))
    (question, answer) = saved(logic).messages
    assert question["content"] == "Is this \ufffd fine?" and question["document"]["text"] == "Is this \ufffd fine?"
    assert answer["content"] and not views[-1].status


def test_attaching_a_partly_scanned_pdf_says_which_pages_are_not_read(logic, tmp_path):
    from pdf_fixture import write_pdf

    view = logic.attach_file(str(write_pdf(tmp_path / "mixed.pdf", ["", "Page two has text."])))
    assert view.status.startswith("Attached mixed.pdf. ⚠️ 1 of 2 pages have no text") and view.attachment["tokens"]


def test_a_bad_seed_is_refused_before_anything_is_saved(logic):
    # Found: the question was saved unanswered and the box emptied, then the seed was refused.
    bad = dataclasses.replace(SETTINGS, seed="abc")
    with pytest.raises(InputError, match="seed must be a whole number"):
        run(logic.send("Hello there", None, "", None, bad))
    assert logic.store.list() == []
    conversation = run(logic.send("Hello there", None, "", None, SETTINGS))[-1].conversation
    run(logic.send("And then?", None, "", conversation, SETTINGS))
    with pytest.raises(InputError, match="seed must be a whole number"):
        run(logic.edit(conversation, 0, "Edited", bad))
    assert len(saved(logic).messages) == 4
