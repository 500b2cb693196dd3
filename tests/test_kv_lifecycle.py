"""What the chat page leaves behind of an answer's KV, on the tiny model (256-token context): one
KV in memory per conversation whatever Retry, Edit or a turn left out change; the latest document's
KV saved to disk wherever it was attached; and a deleted conversation's saved documents deleted with
it, never one that another conversation still uses."""

import dataclasses

import torch

from conftest import DATA, run, tiny_llama
from specchat.app.chat_view import Settings
from specchat.app.engine_handle import EngineHandle
from specchat.app.history import HistoryStore
from specchat.app.ui_chat import ChatLogic
from specchat.core.kv.conversation_slot import ConversationSlot
from specchat.core.kv.prefix_store import PrefixStore
from specchat.core.loading import load_engine

SETTINGS = Settings(system="", preset="free", temperature=0.0, top_p=1.0, top_k=0, seed=None,
                    max_new_tokens=16, mode="plain")
DOCUMENT = (DATA / "apache-2.0.txt").read_text()[:400].strip()  # about 80 tokens


def test_retry_and_edit_take_the_conversation_s_kv_back_instead_of_copying_it(logic):
    """Retry and Edit start the prompt anew after the document: each kept a copy of the shared
    prefix beside the old entry (t6: +1,087 MB over 25 turns on the embedded model)."""
    engine = logic.handle.get()
    conversation = run(logic.send("What is this?", None, DOCUMENT, None, SETTINGS))[-1].conversation
    other = run(logic.send("Who wrote this?", None, DOCUMENT, None, SETTINGS))[-1].conversation
    assert len(engine.prefixes) == 2
    sampled = dataclasses.replace(SETTINGS, temperature=1.0)
    for seed in (1, 2):
        conversation = run(logic.regenerate(conversation, dataclasses.replace(sampled, seed=seed)))[-1].conversation
    conversation = run(logic.edit(conversation, 0, "Who may use it?", SETTINGS))[-1].conversation
    stats = conversation.messages[-1]["stats"]
    assert stats["reused_from"] == "memory" and stats["reused_prompt_tokens"] >= 60  # the document, from memory
    assert sorted(entry.owner for entry in engine.prefixes._entries) == sorted([conversation.id, other.id])
    # The other conversation kept its own KV all along.
    other = run(logic.send("And then?", None, "", other, SETTINGS))[-1].conversation
    assert other.messages[-1]["stats"]["reused_prompt_tokens"] >= len(engine.chat_ids(
        [{"role": "user", "content": f"{DOCUMENT}\n\nWho wrote this?"}]))


def started(tiny_model_dir, tmp_path):
    """The page's logic on a new engine (nothing in memory) and the same folders: a restart."""
    handle = EngineHandle(lambda model, progress: load_engine(model, progress), str(tiny_model_dir))
    handle.get()
    return handle, ChatLogic(handle, HistoryStore(tmp_path / "conversations", tmp_path / "cache" / "documents"))


def test_a_document_attached_to_a_later_question_is_saved_for_the_conversation_reopened(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    """Only a document the conversation opened with was saved: one attached to the second question
    was read again after a restart (t14: a follow-up's first token after 15.4 s instead of 1.3)."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))  # no document saved by another test
    handle, logic = started(tiny_model_dir, tmp_path)
    try:
        conversation = run(logic.send("Hello! A document follows.", None, "", None, SETTINGS))[-1].conversation
        conversation = run(logic.send("What is this?", None, DOCUMENT, conversation, SETTINGS))[-1].conversation
        before = logic.handle.get().chat_ids([{"role": "user", "content": conversation.messages[0]["content"]},
                                              {"role": "assistant", "content": conversation.messages[1]["content"]}])
    finally:
        handle.close()
    assert len(list((tmp_path / "cache" / "documents").glob("*.safetensors"))) == 1
    handle, restarted = started(tiny_model_dir, tmp_path)
    try:
        reopened = restarted.open(conversation.id).conversation
        answered = run(restarted.send("And then?", None, "", reopened, SETTINGS))[-1].conversation
        stats = answered.messages[-1]["stats"]
        assert stats["reused_from"] == "disk" and stats["reused_prompt_tokens"] >= len(before) + 60
    finally:
        handle.close()


def test_a_deleted_conversation_s_saved_document_goes_when_the_bin_is_emptied_unless_another_uses_it(
        tiny_model_dir, tmp_path, monkeypatch):
    """A saved document holds its token ids: its text could be read back from the file after the
    conversation was deleted (t12: "CONFIDENTIAL salary list..."), until the 8 GB budget evicted it."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    secret = "CONFIDENTIAL salary list: Alice Smith 183,000; Bob Jones 201,500. " * 3
    documents = tmp_path / "cache" / "documents"
    handle, logic = started(tiny_model_dir, tmp_path)
    try:
        first = run(logic.send("Summarize.", None, secret, None, SETTINGS))[-1].conversation
        second = run(logic.send("Who earns most?", None, secret, None, SETTINGS))[-1].conversation
        tokenizer = logic.handle.get().tokenizer
    finally:
        handle.close()
    (path,) = documents.glob("*.safetensors")  # one file for both

    from safetensors import safe_open

    with safe_open(path, "pt") as file:
        assert "CONFIDENTIAL salary list" in tokenizer.decode(file.get_tensor("token_ids").tolist())
    logic.delete(first)
    logic.undelete(first.id)  # brought back before a restart: nothing goes
    logic.delete(first)
    HistoryStore(tmp_path / "conversations", documents)  # a restart empties the bin
    assert path.exists()  # the second conversation still uses it
    logic.delete(second)
    assert path.exists()  # until the bin is emptied: Undo still brings it back whole
    HistoryStore(tmp_path / "conversations", documents)
    assert list(documents.iterdir()) == []


def test_the_saved_document_s_length_is_measured_once_per_document_not_per_answer(logic):
    """Three prompts of the whole document measure where it ends: before every follow-up, that took
    0.7 s at 122K tokens."""
    from specchat.app.answer_job import saved_tokens
    from specchat.app.documents import document_tokens

    engine = logic.handle.get()

    class Counting:
        calls = 0

        def chat_ids(self, messages):
            self.calls += 1
            return engine.chat_ids(messages)

    counting = Counting()
    before = ({"role": "system", "content": "Be brief."},)
    assert saved_tokens(counting, before, DOCUMENT) == document_tokens(engine, list(before), DOCUMENT)
    assert saved_tokens(counting, before, DOCUMENT) == document_tokens(engine, list(before), DOCUMENT)
    assert counting.calls == 3
    saved_tokens(counting, (), DOCUMENT)  # other turns before it: measured anew
    assert counting.calls == 6


def test_a_deleted_conversation_s_kv_leaves_memory_and_no_other_conversation_s(logic):
    """Deleting a conversation left its KV in memory until the budget (RAM/4, up to 8 GB) evicted
    it, other conversations' first."""
    engine = logic.handle.get()
    deleted = run(logic.send("What is this?", None, DOCUMENT, None, SETTINGS))[-1].conversation
    kept = run(logic.send("Who wrote this?", None, DOCUMENT, None, SETTINGS))[-1].conversation
    held = engine.prefixes.nbytes
    logic.delete(deleted)
    logic.handle.call(lambda engine: None)  # the line runs in order: the KV is freed by now
    assert [entry.owner for entry in engine.prefixes._entries] == [kept.id] and engine.prefixes.nbytes < held
    # Brought back, it answers again (its document read anew).
    logic.undelete(deleted.id)
    answered = run(logic.send("And then?", None, "", logic.open(deleted.id).conversation, SETTINGS))[-1].conversation
    assert answered.messages[-1]["content"] and len(engine.prefixes) == 2


def test_dropping_a_conversation_frees_its_own_entries_and_its_parts_only():
    """A document read in parts keeps its KV as `<id>:parts`: it goes with the conversation."""
    model = tiny_llama(0)

    def filled(ids):
        cache = model.new_cache()
        model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
        return cache

    store = PrefixStore(10**12)
    for ids, owner in (([1, 2], "a"), ([3, 4], "a:parts"), ([5, 6], "ab"), ([7, 8], "b"), ([9, 9], "")):
        store.put(ids, filled(ids), owner)
    store.drop("a")
    assert [entry.owner for entry in store._entries] == ["ab", "b", ""]
    store.drop("")  # no conversation named: nothing is anyone's
    assert len(store) == 3

    slot, cache = ConversationSlot(), filled([1, 2, 3])
    slot.put([1, 2, 3], cache, "b")
    slot.drop("a")
    assert slot.best_length([1, 2, 3, 4]) == 3
    slot.drop("b")  # emptied, its memory kept for the next answer to fill
    assert slot.best_length([1, 2, 3, 4]) == 0 and cache.length == 0 and slot.take([1, 2])[0] is cache
