"""An offloaded KV kept across turns (issue 38): the conversation answered last keeps its cache, a
follow-up reads only its new tokens and answers as from scratch, and another conversation reuses
the same memory instead of allocating a second cache beside it."""

from __future__ import annotations

import pytest

from specchat.app.documents import user_turn
from specchat.core.engine import Engine, Finished
from specchat.core.kv.conversation_slot import ConversationSlot
from specchat.core.kv.offload import OffloadedCache
from specchat.core.kv.prefix_store import common_prefix_length
from specchat.core.model import TransformersLM
from specchat.core.placement import LoadOptions
from specchat.core.request import Request
from specchat.core.runtime import EngineSettings
from specchat.core.sampling import SamplingParams

DOCUMENT = " ".join(f"line {i} of the offloaded document." for i in range(12))
OFFLOADED = EngineSettings(keep_prefixes=False)  # what runtime.py plans for an offloaded KV


@pytest.fixture(scope="module")
def offloaded_parts(tiny_model_dir):
    """The tiny model in fp64 with its KV in an offloaded cache (host memory on the CPU)."""
    from transformers import AutoTokenizer

    model = TransformersLM.from_pretrained(tiny_model_dir, LoadOptions("float64", "cpu", None, None,
                                                                       offload_capacity=256))
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def answer(engine, messages, mode="plain", params=SamplingParams()):
    events = list(engine.generate(engine.chat_ids(messages), Request(12, params, mode)))
    assert isinstance(events[-1], Finished)
    return events[-1].result


def conversation(answer_text: str, document: str = DOCUMENT) -> list[dict]:
    return [{"role": "user", "content": user_turn("What is it?", document)},
            {"role": "assistant", "content": answer_text}, {"role": "user", "content": "And then?"}]


@pytest.mark.parametrize("mode, params", [("plain", SamplingParams()), ("tree", SamplingParams()),
                                          ("triforce", SamplingParams()),
                                          ("chain", SamplingParams(temperature=0.9, seed=3))])
def test_a_follow_up_over_an_offloaded_cache_reads_only_its_new_tokens(offloaded_parts, mode, params):
    engine = Engine(*offloaded_parts, "tiny", settings=OFFLOADED)
    assert isinstance(engine.prefixes, ConversationSlot) and engine.documents is None
    first = answer(engine, conversation("")[:1], mode, params)
    held = engine.prefixes._cache
    assert isinstance(held, OffloadedCache)
    messages = conversation(first.text)
    follow_up = answer(engine, messages, mode, params)
    from_scratch = answer(Engine(*offloaded_parts, "tiny", settings=OFFLOADED), messages, mode, params)
    assert follow_up.token_ids == from_scratch.token_ids
    prompt = engine.chat_ids(messages)
    assert follow_up.stats.reused_from == "memory" and from_scratch.stats.reused_prompt_tokens == 0
    assert follow_up.stats.reused_prompt_tokens == min(
        common_prefix_length(prompt, engine.chat_ids(messages[:1]) + first.token_ids[:-1]), len(prompt) - 1)
    assert follow_up.stats.reused_prompt_tokens > len(prompt) // 2
    assert engine.prefixes._cache is held  # the same host memory, answer after answer


def test_another_conversation_reuses_the_memory_and_answers_as_from_scratch(offloaded_parts):
    engine = Engine(*offloaded_parts, "tiny", settings=OFFLOADED)
    answer(engine, conversation("")[:1])
    held = engine.prefixes._cache
    other = conversation("", document="A different text entirely, about rivers.")[:1]
    switched = answer(engine, other)
    assert engine.prefixes._cache is held  # trimmed and refilled, never a second cache beside it
    assert switched.token_ids == answer(Engine(*offloaded_parts, "tiny", settings=OFFLOADED), other).token_ids
    # What the two prompts share (the chat template's start) was kept, the rest read again.
    assert switched.stats.reused_prompt_tokens == common_prefix_length(
        engine.chat_ids(conversation("")[:1]), engine.chat_ids(other))


def test_the_slot_moves_its_cache_and_never_copies(offloaded_parts):
    model, _ = offloaded_parts
    slot, cache = ConversationSlot(), model.new_cache()
    assert slot.take([1, 2]) is None and slot.nbytes == 0 and len(slot) == 0
    with pytest.raises(ValueError):
        slot.put([1, 2, 3], cache)  # the ids must be the cache's
    slot.put([], cache)
    assert len(slot) == 1 and slot.best_length([5, 6]) == 0
    taken, length = slot.take([5, 6])
    assert taken is cache and length == 0 and len(slot) == 0


def test_an_engine_built_by_hand_over_an_offloaded_model_keeps_one_slot(offloaded_parts):
    """Settings that ask to keep prefixes (the default) cannot give an offloaded model a store of
    cache copies in pinned memory: the engine takes the slot from the model itself."""
    engine = Engine(*offloaded_parts, "tiny")
    assert isinstance(engine.prefixes, ConversationSlot) and engine.documents is None
    first = answer(engine, conversation("")[:1])
    follow_up = answer(engine, conversation(first.text))
    from_scratch = answer(Engine(*offloaded_parts, "tiny", settings=OFFLOADED), conversation(first.text))
    assert follow_up.token_ids == from_scratch.token_ids and follow_up.stats.reused_from == "memory"


def test_a_saved_offloaded_document_reloads_after_a_restart_into_the_slot_s_own_cache(offloaded_parts, tmp_path,
                                                                                      monkeypatch):
    from specchat.app.documents import document_tokens
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from specchat.core.engine import Notice
    from specchat.core.kv.document_store import DocumentStore

    model, tokenizer = offloaded_parts

    def started():
        return Engine(model, tokenizer, "tiny", documents=DocumentStore(tmp_path, "tiny:float64", 10**12),
                      settings=OFFLOADED)

    engine = started()
    saved = document_tokens(engine, [], DOCUMENT)
    first = conversation("")[:1]
    events = list(engine.generate(engine.chat_ids(first), Request(12, SamplingParams(), "plain", document_tokens=saved)))
    assert isinstance(events[-1], Finished) and len(list(tmp_path.glob("*.safetensors"))) == 1
    # "Restart": another conversation holds the slot; the document comes back from disk into that
    # same cache, no second one allocated.
    restarted = started()
    answer(restarted, conversation("", document="A different text entirely, about rivers.")[:1])
    held = restarted.prefixes._cache
    allocations = []
    monkeypatch.setattr(model, "new_cache", lambda: allocations.append(1) or OffloadedCache(
        model.hf.config, model.offload_capacity, "cpu", model.hf.dtype))
    messages = [{"role": "user", "content": user_turn("Which line comes last?", DOCUMENT)}]
    reloaded = answer(restarted, messages)
    assert reloaded.stats.reused_from == "disk" and reloaded.stats.reused_prompt_tokens == saved
    assert restarted.prefixes._cache is held and allocations == []
    monkeypatch.undo()
    assert reloaded.token_ids == answer(Engine(*offloaded_parts, "tiny", settings=OFFLOADED), messages).token_ids


def test_an_unreadable_saved_document_leaves_the_slot_its_memory(offloaded_parts, tmp_path):
    # Found: the slot's cache, emptied to read a saved document into, was dropped when the file
    # proved unreadable, and a second offloaded cache was allocated beside it.
    from specchat.app.documents import document_tokens
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from specchat.core.engine import Notice
    from specchat.core.kv.document_store import DocumentStore

    def engine():
        return Engine(*offloaded_parts, "tiny", settings=OFFLOADED,
                      documents=DocumentStore(tmp_path, "tiny@1:float64", 10**12))

    first = engine()
    saved = document_tokens(first, [], DOCUMENT)
    list(first.generate(first.chat_ids(conversation("")[:1]),
                        Request(12, SamplingParams(), "plain", document_tokens=saved)))
    (path,) = tmp_path.glob("*.safetensors")
    with safe_open(path, "pt") as file:  # the header matches the prompt, the ids inside do not
        metadata = file.metadata()
    tensors = load_file(path)
    tensors["token_ids"] = tensors["token_ids"].flip(0)
    save_file(tensors, path, metadata=metadata)
    reopened = engine()
    answer(reopened, conversation("", document="A different text entirely, about rivers.")[:1])
    held = reopened.prefixes._cache
    question = [{"role": "user", "content": user_turn("Which line comes last?", DOCUMENT)}]
    events = list(reopened.generate(reopened.chat_ids(question), Request(12, SamplingParams(), "plain")))
    assert reopened.prefixes._cache is held and not path.exists()
    assert any(isinstance(event, Notice) and "token ids do not match" in event.text for event in events)
    assert events[-1].result.token_ids == answer(Engine(*offloaded_parts, "tiny", settings=OFFLOADED),
                                                 question).token_ids
