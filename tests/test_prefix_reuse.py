"""KV reuse across turns and saved document caches: the follow-up prefills only its new tokens
and answers exactly as a from-scratch run; memory stays within the LRU budget; a saved document
reloads after a restart, and a bad file is reported and ignored."""

from __future__ import annotations

import io
import threading
from types import SimpleNamespace

import pytest
import torch

from conftest import DATA, needs_cuda, tiny_llama
from specchat.app.documents import document_tokens, user_turn
from specchat.app.terminal import run_chat
from specchat.core.engine import Engine, Finished, Notice, PrefillProgress
from specchat.core.runtime import EngineSettings
from specchat.core.kv.document_store import DocumentStore
from specchat.core.kv.prefix_store import PrefixStore, common_prefix_length
from specchat.core.model import TransformersLM
from specchat.core.placement import LoadOptions
from specchat.core.sampling import SamplingParams
from specchat.core.request import Request

UNLIMITED = 10**12


def filled_cache(model, ids: list[int]):
    cache = model.new_cache()
    model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
    return cache


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(0, vocab_size=97)


def test_take_reuses_the_longest_prefix_and_leaves_the_last_token_to_run(tiny):
    store = PrefixStore(UNLIMITED)
    store.put([1, 2, 3, 4, 5], filled_cache(tiny, [1, 2, 3, 4, 5]))
    store.put([1, 2, 9], filled_cache(tiny, [1, 2, 9]))
    assert store.best_length([1, 2, 3, 4, 5, 6]) == 5
    cache, length = store.take([1, 2, 3, 4, 5, 6])
    assert length == cache.length == 5 and len(store) == 1  # reused whole: it left the store
    assert store.take([7, 8]) is None
    # The same prompt again: all but its last token.
    store.put([1, 2, 3, 4, 5], cache)
    cache, length = store.take([1, 2, 3, 4, 5])
    assert length == cache.length == 4


def test_a_partly_shared_entry_is_copied_so_its_conversation_keeps_it(tiny):
    store = PrefixStore(UNLIMITED)
    original = filled_cache(tiny, [1, 2, 3, 4, 5])
    store.put([1, 2, 3, 4, 5], original)
    cache, length = store.take([1, 2, 3, 7, 8])
    assert length == 3 and cache is not original and original.length == 5 and len(store) == 1
    reference = filled_cache(tiny, [1, 2, 3])
    for (k, v), (rk, rv) in zip(cache.layers(), reference.layers()):
        assert torch.allclose(k, rk, atol=1e-12) and torch.allclose(v, rv, atol=1e-12)  # other batch shape


def test_the_store_stays_within_its_budget_least_recently_used_first(tiny):
    one = filled_cache(tiny, list(range(10))).nbytes
    store = PrefixStore(budget_bytes=int(2.5 * one))
    for first in (10, 20, 30):
        store.put(list(range(first, first + 10)), filled_cache(tiny, list(range(first, first + 10))))
        assert store.nbytes <= store.budget_bytes
    assert len(store) == 2 and store.best_length(list(range(10, 21))) == 0  # the oldest went
    assert store.best_length(list(range(20, 31))) == 10
    store.put(list(range(40, 80)), filled_cache(tiny, list(range(40, 80))))  # larger than the budget
    assert store.best_length(list(range(40, 81))) == 0 and store.nbytes <= store.budget_bytes
    # An entry that starts a newer one is superseded by it.
    store = PrefixStore(UNLIMITED)
    store.put([20, 21], filled_cache(tiny, [20, 21]))
    store.put([20, 21, 22, 5], filled_cache(tiny, [20, 21, 22, 5]))
    assert store.best_length([20, 21, 99]) == 2 and len(store) == 1
    assert common_prefix_length([1, 2, 3], [1, 2]) == 2


def test_a_conversation_keeps_one_entry_and_takes_it_back_where_its_prompt_leaves_it(tiny):
    """A retry, an edit or a turn left out makes a conversation's prompt leave its entry after the
    document: the entry is taken back trimmed, never copied (a copy kept the dead branch, ~380 MB
    per turn at 8K on the embedded model). Another conversation, or one naming none, still copies
    what it shares, so the entry's own conversation keeps it."""
    store = PrefixStore(UNLIMITED)
    original = filled_cache(tiny, [1, 2, 3, 4, 5])
    store.put([1, 2, 3, 4, 5], original, "a")
    for other in ("b", ""):
        cache, length = store.take([1, 2, 3, 7, 8], other)
        assert length == 3 and cache is not original and original.length == 5 and len(store) == 1
    cache, length = store.take([1, 2, 3, 7, 8], "a")  # a's own retry: its entry, trimmed
    assert cache is original and length == cache.length == 3 and len(store) == 0
    model_forward(tiny, cache, [7, 8])
    store.put([1, 2, 3, 7, 8], cache, "a")
    store.put([1, 2, 3, 9], filled_cache(tiny, [1, 2, 3, 9]), "b")
    assert len(store) == 2
    # a's next answer left elsewhere (disk, a longer shared entry): its earlier entry goes anyway.
    store.put([1, 2, 3, 8, 8], filled_cache(tiny, [1, 2, 3, 8, 8]), "a")
    assert sorted(entry.owner for entry in store._entries) == ["a", "b"] and store.best_length([1, 2, 3, 7, 8, 1]) == 3
    # Between entries sharing as much, the conversation's own is taken (no copy of the other's).
    own = store._entries[-1].cache
    assert store.take([1, 2, 3, 5], "a") == (own, 3) and len(store) == 1


def test_a_conversation_s_own_entry_set_aside_comes_back_to_its_devices_trimmed(tiny):
    """On a GPU another conversation's answer sets the entry aside in host memory: the
    conversation's retry takes it back from there, trimmed, onto the devices it was computed on
    (here the CPU plays both: setting aside copies it, and `home` is set)."""
    store = PrefixStore(UNLIMITED, host="cpu", aside=("cpu",))
    store.put([1, 2, 3, 4, 5], filled_cache(tiny, [1, 2, 3, 4, 5]), "a")
    store.put([6, 7, 8], filled_cache(tiny, [6, 7, 8]), "b")
    cache, _ = store.take([6, 7, 8, 9], "b")
    assert store._entries[0].home == [torch.device("cpu")] * tiny.num_layers  # a's, set aside
    store.put([6, 7, 8], cache, "b")
    cache, length = store.take([1, 2, 3, 9], "a")
    assert length == cache.length == 3 and on("cpu", cache) and [entry.owner for entry in store._entries] == ["b"]
    for (keys, values), (expected_keys, expected_values) in zip(cache.layers(), filled_cache(tiny, [1, 2, 3]).layers()):
        assert torch.allclose(keys, expected_keys, atol=1e-12) and torch.allclose(values, expected_values, atol=1e-12)


def model_forward(model, cache, ids: list[int]) -> None:
    model.forward(torch.tensor(ids), torch.arange(cache.length, cache.length + len(ids)), cache)


def on(device: str, cache) -> bool:
    return all(d == torch.device(device) for d in cache.devices)


def test_only_the_cache_handed_out_stays_on_the_device_the_others_are_set_aside(tiny):
    """The plan budgets one KV on a GPU: before another cache is needed there, every entry but the
    one handed out moves to the host. Here the CPU plays the GPU and the meta device the host
    (entries set aside there keep their shape and bytes, not their values)."""
    store = PrefixStore(UNLIMITED, host="meta", aside=("cpu",))
    store.put([1, 2, 3], filled_cache(tiny, [1, 2, 3]))
    store.put([4, 5, 6], filled_cache(tiny, [4, 5, 6]))
    before = store.nbytes
    cache, length = store.take([4, 5, 6, 7])  # the follow-up of the second: handed out where it is
    assert length == 3 and on("cpu", cache) and len(store) == 1 and store.nbytes == before // 2
    assert all(on("meta", entry.cache) and entry.home == [torch.device("cpu")] * tiny.num_layers
               for entry in store._entries)
    store.put([4, 5, 6], cache)
    assert store.spare() is None and all(on("meta", entry.cache) for entry in store._entries)  # a document loads
    assert store.take([9, 9]) is None and len(store) == 2


def test_a_cache_with_sliding_window_layers_is_never_set_aside():
    """Such a layer keeps a window and its own count of positions, which a copy would not carry:
    it stays where it is, as every cache did before setting aside."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=8, max_window_layers=0)
    model = TransformersLM(Qwen2ForCausalLM(config).double())
    cache = filled_cache(model, list(range(20)))
    assert not cache.movable and cache.length == 20
    store = PrefixStore(UNLIMITED, host="meta", aside=("cpu",))
    store.put(list(range(20)), cache)
    assert store.take([50, 51]) is None and store._entries[0].cache is cache and on("cpu", cache)
    # Nor copied in part: its layers hold the window, not positions 0..n, so only a follow-up of
    # the whole conversation reuses it.
    assert store.best_length(list(range(10)) + [60]) == 0 and store.take(list(range(10)) + [60]) is None
    assert store.take(list(range(21))) == (cache, 20)


def test_a_set_aside_conversation_comes_back_to_its_devices_as_it_was(tiny):
    """What setting aside and bringing back copy, a layer at a time (`copy_to`): the same entries,
    bit for bit, independent of the original, full and 8-bit."""
    from specchat.core.model import TransformersLM as LM

    for model in (tiny, LM(tiny.hf, kv_dtype="int8")):
        cache = filled_cache(model, list(range(20)))
        copy = cache.copy_to([torch.device("cpu")] * model.num_layers)
        assert type(copy) is type(cache) and copy.length == 20 and copy.nbytes == cache.nbytes
        cache.trim(10)
        model.forward(torch.tensor([50] * 5), torch.arange(10, 15), cache)  # overwrites slots 10-14
        for (keys, values), (original_keys, original_values) in zip(copy.stored_layers(10), cache.stored_layers(10),
                                                                    strict=True):
            assert torch.equal(keys, original_keys) and torch.equal(values, original_values)
        assert not torch.equal(copy.stored_layers()[0][0][:, :, 10:15], cache.stored_layers()[0][0][:, :, 10:15])


@pytest.fixture(scope="module")
def tiny_engine_parts(tiny_model_dir):
    """The tiny model in fp64 (so no near-tie can flip between batch shapes) and its tokenizer."""
    from transformers import AutoTokenizer

    model = TransformersLM.from_pretrained(tiny_model_dir, LoadOptions("float64", "cpu", None, None))
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def engine_with(parts, budget=UNLIMITED, documents=None, settings=EngineSettings()) -> Engine:
    model, tokenizer = parts
    return Engine(model, tokenizer, "tiny", prefixes=PrefixStore(budget), documents=documents, settings=settings)


def run(engine, messages, mode="plain", max_new_tokens=12, params=SamplingParams(), **kwargs):
    events = list(engine.generate(engine.chat_ids(messages), Request(max_new_tokens, params, mode, **kwargs)))
    assert isinstance(events[-1], Finished)
    return events[-1].result, [event for event in events if isinstance(event, Notice)]


DOCUMENT = " ".join(f"line {i} of the tiny document." for i in range(12))


def conversation(answer: str, follow_up: str = "And then?") -> list[dict]:
    return [{"role": "user", "content": user_turn("What is it?", DOCUMENT)},
            {"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]


@pytest.mark.parametrize("mode, params", [
    ("plain", SamplingParams()), ("chain", SamplingParams()), ("tree", SamplingParams()),
    ("plain", SamplingParams(temperature=0.9, seed=7)),
])
def test_a_follow_up_prefills_only_its_new_tokens_and_answers_as_from_scratch(tiny_engine_parts, mode, params):
    engine = engine_with(tiny_engine_parts)
    first, _ = run(engine, conversation("")[:1], mode, params=params)
    messages = conversation(first.text)
    follow_up, _ = run(engine, messages, mode, params=params)
    from_scratch, _ = run(engine_with(tiny_engine_parts), messages, mode, params=params)
    assert follow_up.token_ids == from_scratch.token_ids
    prompt = engine.chat_ids(messages)
    assert follow_up.stats.reused_from == "memory"
    assert follow_up.stats.reused_prompt_tokens >= first.prompt_tokens - 1
    # The cache held the first prompt and the answer but its last token (never run).
    assert first.finish_reason == "length"
    assert follow_up.stats.reused_prompt_tokens == min(
        common_prefix_length(prompt, engine.chat_ids(messages[:1]) + first.token_ids[:-1]), len(prompt) - 1)
    assert from_scratch.stats.reused_prompt_tokens == 0


def test_retries_edits_and_turns_left_out_keep_one_kv_per_conversation_and_answer_as_from_scratch(
        tiny_engine_parts):
    """Each answer below leaves the conversation's cached prompt after the document; the store
    keeps one entry per conversation (it kept one more per answer: 11 entries, 1 GB, after 12
    turns at 2K on the embedded model), every answer exact."""
    engine = engine_with(tiny_engine_parts)
    ask = [{"role": "user", "content": user_turn("What is it?", DOCUMENT)}]
    first, _ = run(engine, ask, conversation="c1")
    one = engine.prefixes.nbytes
    other, _ = run(engine, [{"role": "user", "content": user_turn("Who wrote it?", DOCUMENT)}], conversation="c2")
    turns = [ask,  # Retry: the same prompt again
             [{"role": "user", "content": user_turn("What is it about?", DOCUMENT)}],  # the question edited
             ask + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}],
             [{"role": "user", "content": DOCUMENT}, {"role": "user", "content": "And then?"}]]  # left out
    for messages in turns:
        again, _ = run(engine, messages, conversation="c1")
        assert again.stats.reused_from == "memory" and again.stats.reused_prompt_tokens > 0
        assert again.token_ids == run(engine_with(tiny_engine_parts), messages)[0].token_ids
        assert len(engine.prefixes) == 2 and sorted(entry.owner for entry in engine.prefixes._entries) == ["c1", "c2"]
    assert engine.prefixes.nbytes < 3 * one
    follow_up = [{"role": "user", "content": user_turn("Who wrote it?", DOCUMENT)},
                 {"role": "assistant", "content": other.text}, {"role": "user", "content": "Why?"}]
    kept, _ = run(engine, follow_up, conversation="c2")  # the other conversation kept its own
    assert kept.stats.reused_prompt_tokens >= other.prompt_tokens - 1
    assert kept.token_ids == run(engine_with(tiny_engine_parts), follow_up)[0].token_ids


def test_a_stopped_prefill_is_picked_up_where_it_stopped(tiny_engine_parts):
    engine = engine_with(tiny_engine_parts, settings=EngineSettings(prefill_chunk=16))
    cancel = threading.Event()
    ids = engine.chat_ids(conversation("")[:1])
    for event in engine.generate(ids, Request(8, SamplingParams(), "plain"), cancel):
        if isinstance(event, PrefillProgress):
            cancel.set()
    again, _ = run(engine, conversation("")[:1], max_new_tokens=8)
    fresh, _ = run(engine_with(tiny_engine_parts), conversation("")[:1], max_new_tokens=8)
    assert again.stats.reused_prompt_tokens == 16 and again.token_ids == fresh.token_ids


def test_an_answer_stopped_inside_its_first_chunk_leaves_nothing_behind(tiny_engine_parts):
    """Stopped between two layers of the first chunk, a cache holds no position and some layers
    that never ran: nothing to keep, and nothing the next answer's setting aside trips on."""
    model, tokenizer = tiny_engine_parts
    store = PrefixStore(UNLIMITED, host="meta", aside=("cpu",))
    engine = Engine(model, tokenizer, "tiny", prefixes=store)
    stop = threading.Event()
    stop.set()
    events = list(engine.generate(engine.chat_ids(conversation("")[:1]), Request(8, SamplingParams(), "plain"), stop))
    assert events[-1].result.finish_reason == "cancelled" and len(store) == 0
    again, _ = run(engine, conversation("")[:1], max_new_tokens=8)
    assert again.token_ids == run(engine_with(tiny_engine_parts), conversation("")[:1], max_new_tokens=8)[0].token_ids


def test_conversations_share_memory_under_the_budget(tiny_engine_parts):
    probe = engine_with(tiny_engine_parts)
    run(probe, conversation("")[:1])
    one = probe.prefixes.nbytes
    engine = engine_with(tiny_engine_parts, budget=int(2.5 * one))
    firsts = {}
    for topic in ("apples", "boats", "clouds"):
        messages = [{"role": "user", "content": f"{DOCUMENT} Now tell me about {topic}."}]
        firsts[topic], _ = run(engine, messages)
        assert engine.prefixes.nbytes <= engine.prefixes.budget_bytes
    reuse = {}
    for topic in ("clouds", "apples"):
        messages = [{"role": "user", "content": f"{DOCUMENT} Now tell me about {topic}."},
                    {"role": "assistant", "content": firsts[topic].text}, {"role": "user", "content": "More."}]
        result, _ = run(engine, messages)
        reuse[topic] = result.stats.reused_prompt_tokens
        assert engine.prefixes.nbytes <= engine.prefixes.budget_bytes
    assert reuse["clouds"] >= firsts["clouds"].prompt_tokens  # still in memory
    # "apples" was evicted; only the document part is shared, with another conversation.
    assert reuse["apples"] < firsts["apples"].prompt_tokens - 1


def test_a_saved_document_reloads_in_a_new_engine(tiny_engine_parts, tmp_path):
    def store():
        return DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED)

    engine = engine_with(tiny_engine_parts, documents=store())
    saved = document_tokens(engine, [], DOCUMENT)
    first, _ = run(engine, conversation("")[:1], document_tokens=saved)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    # "Restart": nothing in memory, the same folder on disk; a different question about the document.
    messages = [{"role": "user", "content": user_turn("Which line comes last?", DOCUMENT)}]
    restarted, notices = run(engine_with(tiny_engine_parts, documents=store()), messages)
    fresh, _ = run(engine_with(tiny_engine_parts), messages)
    assert restarted.stats.reused_from == "disk" and restarted.stats.reused_prompt_tokens == saved
    assert restarted.token_ids == fresh.token_ids and notices == []
    # Another model's caches are not even considered.
    other, _ = run(engine_with(tiny_engine_parts, documents=DocumentStore(tmp_path, "other:float64", UNLIMITED)),
                   messages)
    assert other.stats.reused_prompt_tokens == 0


def test_a_document_attached_to_a_later_question_reloads_in_a_new_engine(tiny_engine_parts, tmp_path):
    """The saved prefix runs through the earlier turns to the end of the document (what the chat
    page saves for the latest document); reloaded, it answers as from scratch."""
    engine = engine_with(tiny_engine_parts, documents=DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED))
    hello, _ = run(engine, [{"role": "user", "content": "Hello."}])
    before = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": hello.text}]
    saved = document_tokens(engine, before, DOCUMENT)
    ask = before + [{"role": "user", "content": user_turn("What is it?", DOCUMENT)}]
    first, _ = run(engine, ask, document_tokens=saved)
    # Its turn's opening stands where the assistant's does in `before`'s ids; the document's last
    # token may merge with what follows it.
    assert saved >= len(engine.chat_ids(before)) + engine.count_tokens(DOCUMENT) - 1
    messages = ask + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    restarted, _ = run(engine_with(tiny_engine_parts, documents=DocumentStore(tmp_path, "tiny@1:float64",
                                                                              UNLIMITED)), messages)
    assert restarted.stats.reused_from == "disk" and restarted.stats.reused_prompt_tokens == saved
    assert restarted.token_ids == run(engine_with(tiny_engine_parts), messages)[0].token_ids


def test_the_saved_prefix_is_the_document_alone_so_its_turn_left_out_reloads_the_same_file(tiny_engine_parts,
                                                                                         tmp_path):
    """The first question left out (documents stay) makes the turn the document alone: it read a
    second file for the same document when the saved prefix ran into the question's separator
    (t2: 1 -> 2 files, 174 -> 349 MB)."""
    def store():
        return DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED)

    engine = engine_with(tiny_engine_parts, documents=store())
    saved = document_tokens(engine, [], DOCUMENT)
    first, _ = run(engine, conversation("")[:1], document_tokens=saved)
    left_out = [{"role": "user", "content": user_turn("", DOCUMENT)}, {"role": "user", "content": "And then?"}]
    assert saved == common_prefix_length(engine.chat_ids(conversation("")[:1]), engine.chat_ids(left_out))
    run(engine, left_out, document_tokens=document_tokens(engine, [], DOCUMENT))
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    restarted, _ = run(engine_with(tiny_engine_parts, documents=store()), left_out)
    assert restarted.stats.reused_from == "disk" and restarted.stats.reused_prompt_tokens == saved
    assert restarted.token_ids == run(engine_with(tiny_engine_parts), left_out)[0].token_ids


def test_a_saved_document_goes_with_the_last_conversation_that_used_it(tiny_engine_parts, tmp_path):
    """Each conversation that saves or reloads a document is listed beside its file; releasing
    conversations deletes the files none of the others uses, never one saved with no owner."""
    from specchat.core.kv import document_owners

    saved = document_tokens(engine_with(tiny_engine_parts), [], DOCUMENT)
    run(engine_with(tiny_engine_parts, documents=DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED)),
        conversation("")[:1], document_tokens=saved, conversation="a")
    (path,) = tmp_path.glob("*.safetensors")
    again, _ = run(engine_with(tiny_engine_parts, documents=DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED)),
                   [{"role": "user", "content": user_turn("Which line comes last?", DOCUMENT)}],
                   document_tokens=saved, conversation="b")
    assert again.stats.reused_from == "disk" and document_owners.owners(path) == {"a", "b"}
    other = f"{DOCUMENT} Another version."
    run(engine_with(tiny_engine_parts, documents=DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED)),
        [{"role": "user", "content": user_turn("What is it?", other)}],
        document_tokens=document_tokens(engine_with(tiny_engine_parts), [], other))  # the command line's: no owner
    ownerless = next(file for file in tmp_path.glob("*.safetensors") if file != path)
    assert document_owners.release(tmp_path, {"a", "c"}) == [] and path.exists()
    assert document_owners.owners(path) == {"b"}
    assert document_owners.release(tmp_path, {"b"}) == [path]
    assert not path.exists() and not document_owners.owners_path(path).exists() and ownerless.exists()
    assert [file.suffix for file in tmp_path.iterdir()] == [".safetensors"]


@pytest.mark.parametrize("damage, reason", [
    (lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]), "unreadable"),
    (lambda path: path.write_bytes(b"\x00" * 64), "unreadable"),
    ("ids", "token ids do not match"),
    ("shape", "shapes do not match"),
])
def test_a_damaged_or_mismatched_cache_file_is_reported_and_ignored(tiny_engine_parts, tmp_path, damage, reason):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    engine = engine_with(tiny_engine_parts, documents=DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED))
    saved = document_tokens(engine, [], DOCUMENT)
    run(engine, conversation("")[:1], document_tokens=saved)
    (path,) = tmp_path.glob("*.safetensors")
    if callable(damage):
        damage(path)
    else:  # rewrite it consistently but wrongly, keeping the metadata that makes it match the prompt
        with safe_open(path, "pt") as file:
            metadata = file.metadata()
        tensors = load_file(path)
        if damage == "ids":
            tensors["token_ids"] = tensors["token_ids"].flip(0)
        else:
            tensors = {name: (t[:, :1] if name != "token_ids" else t) for name, t in tensors.items()}
        save_file(tensors, path, metadata=metadata)
    messages = [{"role": "user", "content": user_turn("Which line comes last?", DOCUMENT)}]
    result, notices = run(engine_with(tiny_engine_parts, documents=DocumentStore(tmp_path, "tiny@1:float64",
                                                                                 UNLIMITED)), messages)
    fresh, _ = run(engine_with(tiny_engine_parts), messages)
    assert result.stats.reused_prompt_tokens == 0 and result.token_ids == fresh.token_ids
    assert len(notices) == 1 and reason in notices[0].text and not path.exists()


def test_the_document_folder_stays_within_its_disk_budget(tiny_engine_parts, tmp_path):
    store = DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED)
    engine = engine_with(tiny_engine_parts, documents=store)
    for index in range(3):
        document = f"{DOCUMENT} Version {index}."
        run(engine, [{"role": "user", "content": user_turn("What is it?", document)}],
            document_tokens=document_tokens(engine, [], document))
        if index == 0:
            store.budget_bytes = int(1.5 * next(tmp_path.glob("*.safetensors")).stat().st_size)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


def test_temporaries_left_by_a_killed_save_are_removed_once_stale(tiny_engine_parts, tmp_path):
    import os
    import time

    stale = [tmp_path / "tmpa1b2c3d4.tmp", tmp_path / ".tmpyVGmDu"]
    young = tmp_path / "tmpe5f6g7h8.tmp"  # another app's save in progress
    for path in (*stale, young):
        path.write_bytes(b"\x00" * 1024)
    hours_ago = time.time() - 2 * 3600
    for path in stale:
        os.utime(path, (hours_ago, hours_ago))
    store = DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED)
    assert not any(path.exists() for path in stale) and young.exists()
    os.utime(young, (hours_ago, hours_ago))  # its writer died too: the next save sweeps it
    run(engine_with(tiny_engine_parts, documents=store), [{"role": "user", "content": user_turn("What?", DOCUMENT)}],
        document_tokens=document_tokens(engine_with(tiny_engine_parts), [], DOCUMENT))
    assert not young.exists() and len(list(tmp_path.glob("*.safetensors"))) == 1


def test_terminal_chat_about_a_document_reuses_the_conversation(tiny_engine_parts, tmp_path):
    engine = engine_with(tiny_engine_parts, documents=DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED))
    args = SimpleNamespace(system=None, max_new_tokens=6, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                           mode="plain", dsi_workers=None, dsi_always=False, document="doc.txt", cache_document=True)
    stdout = io.StringIO()
    assert run_chat(engine, args, DOCUMENT, stdin=io.StringIO("What is it?\nAnd then?\n/exit\n"), stdout=stdout) == 0
    answers = [line for line in stdout.getvalue().splitlines() if line.startswith("[")]
    assert len(answers) == 2 and "reused" not in answers[0] and "prompt tokens reused" in answers[1]
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


@pytest.mark.slow
def test_embedded_model_follow_up_and_reloaded_document_on_a_7k_document(embedded_engine, tmp_path):
    """The issue's acceptance test: on a 7K-token document the follow-up reuses the whole first
    turn and a restarted engine reloads the saved document, both answering exactly as a
    from-scratch run. (Times are reported by `specchat bench --suite prefill`.)"""
    model, tokenizer = embedded_engine.model, embedded_engine.tokenizer
    key = "embedded-test:float32"

    def fresh_engine(documents=True):
        return Engine(model, tokenizer, "embedded", prefixes=PrefixStore(UNLIMITED),
                      documents=DocumentStore(tmp_path, key, UNLIMITED) if documents else None)

    document = (DATA / "gpl-3.0.txt").read_text()
    engine = fresh_engine()
    first_turn = [{"role": "user", "content": user_turn("Summarize this document in two sentences.", document)}]
    saved = document_tokens(engine, [], document)
    first, _ = run(engine, first_turn, "chain", 24, document_tokens=saved)
    assert first.prompt_tokens > 7000
    messages = first_turn + [{"role": "assistant", "content": first.text},
                             {"role": "user", "content": "Who publishes this licence?"}]
    follow_up, _ = run(engine, messages, "chain", 24)
    reference, _ = run(fresh_engine(documents=False), messages, "chain", 24)
    assert follow_up.token_ids == reference.token_ids
    assert follow_up.stats.reused_prompt_tokens >= first.prompt_tokens
    assert follow_up.prompt_tokens - follow_up.stats.reused_prompt_tokens < 100  # only the new turn ran

    restarted, notices = run(fresh_engine(), messages, "chain", 24)
    assert restarted.stats.reused_from == "disk" and restarted.stats.reused_prompt_tokens == saved > 7000
    assert restarted.token_ids == reference.token_ids and notices == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int8])
def test_a_file_written_a_layer_at_a_time_reads_as_safetensors_writes_it(tmp_path, dtype):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from specchat.core.kv.document_store import _write

    whole = (torch.arange(2 * 40 * 8, dtype=torch.float64).reshape(2, 40, 8) - 300).to(dtype)
    tensors = [("token_ids", torch.arange(7)), ("keys.0", whole[:, :7][None]), ("values.0", whole[:, 3:10][None])]
    assert not tensors[1][1].is_contiguous()  # views of a larger buffer, as an offloaded cache gives them
    _write(tmp_path / "streamed.safetensors", tensors, {"format": "x"})
    save_file({name: t.contiguous() for name, t in tensors}, tmp_path / "whole.safetensors", metadata={"format": "x"})
    streamed, whole_file = load_file(tmp_path / "streamed.safetensors"), load_file(tmp_path / "whole.safetensors")
    assert streamed.keys() == whole_file.keys() and all(torch.equal(streamed[k], whole_file[k]) for k in streamed)
    assert all(streamed[name].dtype == t.dtype and torch.equal(streamed[name], t) for name, t in tensors)
    with safe_open(tmp_path / "streamed.safetensors", "pt") as file:
        assert file.metadata() == {"format": "x"}


@needs_cuda
def test_a_saved_document_reloads_onto_the_gpu_and_answers_as_from_scratch(tiny_model_dir, tmp_path):
    """safetensors reads onto the CPU: the layers go to the device the model computes on."""
    from transformers import AutoTokenizer

    parts = (TransformersLM.from_pretrained(tiny_model_dir, LoadOptions("float64", "cuda:0", None, None)),
             AutoTokenizer.from_pretrained(tiny_model_dir))
    engine = engine_with(parts, documents=DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED))
    saved = document_tokens(engine, [], DOCUMENT)
    run(engine, conversation("")[:1], document_tokens=saved)
    messages = [{"role": "user", "content": user_turn("Which line comes last?", DOCUMENT)}]
    restarted, _ = run(engine_with(parts, documents=DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED)), messages)
    assert restarted.stats.reused_from == "disk" and restarted.token_ids == run(engine_with(parts), messages)[0].token_ids


@needs_cuda
def test_a_second_conversation_sets_the_first_aside_and_the_first_comes_back_from_memory(tiny_model_dir):
    """On a GPU only the answer's KV stays there: the other conversation waits in host memory,
    and its follow-up copies it back instead of reading the document again."""
    from transformers import AutoTokenizer

    parts = (TransformersLM.from_pretrained(tiny_model_dir, LoadOptions("float64", "cuda:0", None, None)),
             AutoTokenizer.from_pretrained(tiny_model_dir))
    engine = engine_with(parts)
    first, _ = run(engine, conversation("")[:1])
    run(engine, [{"role": "user", "content": user_turn("What is it?", DOCUMENT.replace("line", "row"))}])
    stored = engine.prefixes._entries
    assert len(stored) == 2 and [entry.home is None for entry in stored] == [False, True]  # the last answer's stays
    assert all(device.type == "cpu" for device in stored[0].cache.devices)
    assert all(device.type == "cuda" for device in stored[1].cache.devices)
    follow_up = conversation(first.text)
    again, _ = run(engine, follow_up)
    assert again.stats.reused_from == "memory" and again.stats.reused_prompt_tokens >= first.prompt_tokens - 1
    assert again.token_ids == run(engine_with(parts), follow_up)[0].token_ids
    assert [entry.home is None for entry in engine.prefixes._entries][-2:] == [False, True]  # one on the GPU
    assert sum(entry.home is None for entry in engine.prefixes._entries) == 1


@needs_cuda
def test_a_kv_reaches_the_gpu_a_layer_at_a_time_from_the_host_and_from_disk(tmp_path):
    """A conversation copied back and a saved document loaded hold the KV once on the GPU, plus
    one layer in transit (a 32K document on an 8 GB card has no room for two)."""
    from transformers import LlamaConfig

    from specchat.core.kv.full import FullCache

    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4,
                         max_position_embeddings=4096)
    generator = torch.Generator().manual_seed(0)
    host = FullCache.from_layers(config, [tuple(torch.randn(1, 8, 4096, 128, generator=generator).bfloat16()
                                                for _ in range(2)) for _ in range(4)])
    ids = list(range(4096))
    DocumentStore(tmp_path, "shape", 10**10).save(ids, host)
    gpu = [torch.device("cuda", 0)] * 4
    for arrive in (lambda: host.copy_to(gpu),
                   lambda: DocumentStore(tmp_path, "shape", 10**10).load(ids + [1], lambda: FullCache(config),
                                                                         at_least=0, device="cuda:0").cache):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        arrived = arrive()
        assert torch.cuda.max_memory_allocated() - base <= host.nbytes * (1 + 1.5 / 4)  # all four at once: 2x
        assert arrived.devices == gpu and all(torch.equal(a.cpu(), b) for pair in zip(arrived.layers(), host.layers())
                                              for a, b in zip(*pair))
        del arrived


def test_the_disk_budget_holds_a_whole_context_s_document_and_a_save_leaves_the_disk_room(
        tiny_engine_parts, tmp_path, monkeypatch):
    from specchat.core import loading
    from specchat.core.kv import document_store

    llama_8b = SimpleNamespace(num_hidden_layers=32, num_key_value_heads=8, head_dim=128, hidden_size=4096,
                               num_attention_heads=32)
    bf16 = SimpleNamespace(config=llama_8b, kv_dtype=None, dtype=torch.bfloat16)
    assert loading._document_store("x@1", bf16, 131072).budget_bytes == 2 * 32 * 8 * 128 * 2 * 131072  # 17.2 GB
    assert loading._document_store("x@1", bf16, 8192).budget_bytes == loading.DOCUMENT_CACHE_BYTES
    int8 = SimpleNamespace(config=llama_8b, kv_dtype="int8", dtype=torch.bfloat16)
    assert loading._document_store("x@1", int8, 131072).budget_bytes == 2 * 32 * 8 * (128 + 4) * 131072

    store = DocumentStore(tmp_path, "tiny@1:float64", UNLIMITED)
    engine = engine_with(tiny_engine_parts, documents=store)
    cache = filled_cache(engine.model, list(range(40)))
    monkeypatch.setattr(document_store.shutil, "disk_usage",
                        lambda path: SimpleNamespace(free=document_store.FREE_DISK_KEPT + 1000))
    assert store.save(list(range(40)), cache) is None and not list(tmp_path.glob("*.safetensors"))
    monkeypatch.undo()
    assert store.save(list(range(40)), cache) is not None



def test_a_pair_draft_reads_a_follow_up_s_new_tokens_only_and_triforce_stays_plain(tiny_engine_parts, tiny_model_dir):
    """The engine keeps its pair draft's reading between answers (issue 38): in a follow-up the
    draft reads from where the first turn's prompt ended, never the document again."""
    from specchat.core.decoding import TriforceSettings

    model, tokenizer = tiny_engine_parts
    draft = TransformersLM.from_pretrained(tiny_model_dir, LoadOptions("float64", "cpu", None, None))
    starts = []  # the first position of each draft forward
    forward = draft.forward
    draft.forward = lambda ids, positions, *args, **kwargs: starts.append(int(positions[0])) or forward(
        ids, positions, *args, **kwargs)
    engine = Engine(model, tokenizer, "tiny", prefixes=PrefixStore(UNLIMITED), draft=draft,
                    settings=EngineSettings(prefill_chunk=16))
    triforce = TriforceSettings(draft="pair", budget=24, chunk_size=4, recent=8, stride=8, sinks=2, window=16)
    first, _ = run(engine, conversation("")[:1], "triforce", options=triforce)
    assert starts[0] == 0 and first.stats.stages["pair"]["forwards"] > 0
    messages = conversation(first.text)
    starts.clear()
    follow_up, _ = run(engine, messages, "triforce", options=triforce)
    plain, _ = run(engine_with(tiny_engine_parts), messages, "plain")
    assert follow_up.token_ids == plain.token_ids
    assert min(starts) >= first.prompt_tokens - 1, starts  # the document is not read again


def test_tree_mode_s_suffix_index_carries_over_to_a_follow_up(tiny_engine_parts):
    """Tree mode's suffix drafter is the engine's: a follow-up's prompt extends what it indexed,
    so the index grows by the new tokens instead of being built again (about a second at 128K)."""
    engine = engine_with(tiny_engine_parts)
    first, _ = run(engine, conversation("")[:1], "tree")
    index = engine._suffix.index
    indexed = len(index)
    messages = conversation(first.text)
    follow_up, _ = run(engine, messages, "tree")
    assert engine._suffix.index is index and len(index) > indexed >= first.prompt_tokens
    assert follow_up.token_ids == run(engine_with(tiny_engine_parts), messages, "plain")[0].token_ids
    other, _ = run(engine, [{"role": "user", "content": "Something else entirely."}], "tree")
    assert engine._suffix.index is not index  # another conversation: indexed afresh
    assert other.token_ids == run(engine_with(tiny_engine_parts), [{"role": "user", "content": "Something else entirely."}],
                                  "plain")[0].token_ids
