"""The engine on the real embedded model: lossless speculation on long documents, events,
cancellation, and clear errors."""

import threading

import pytest

from conftest import DATA
from specchat.core.engine import Finished, PrefillProgress, TextDelta
from specchat.core.loading import load_engine
from specchat.core.errors import InputError
from specchat.core.sampling import SamplingParams
from specchat.core.request import Request


def excerpt(name: str, chars: int) -> str:
    """The start of a fixture document, cut at the last paragraph break before `chars`."""
    text = (DATA / name).read_text()
    return text[:text.rfind("\n\n", 0, chars)]


def answer(engine, content, mode, max_new_tokens=96, cancel=None, params=SamplingParams()):
    ids = engine.chat_ids([{"role": "user", "content": content}])
    events = list(engine.generate(ids, Request(max_new_tokens, params, mode), cancel))
    assert isinstance(events[-1], Finished)
    return events, events[-1].result


@pytest.mark.slow
def test_greedy_speculation_equals_plain_on_a_long_document(embedded_engine):
    content = (DATA / "apache-2.0.txt").read_text() + "\n\nWhat does section 4 require when redistributing?"
    _, plain = answer(embedded_engine, content, "plain")
    embedded_engine.answers.clear()  # else the tree replays plain's answer from the history: one deep path
    tree_events, tree = answer(embedded_engine, content, "tree")
    embedded_engine.prefixes.clear()  # a full prefill again, to check its progress events
    events, chain = answer(embedded_engine, content, "chain")
    assert plain.prompt_tokens > 2000
    assert chain.token_ids == plain.token_ids and chain.text == plain.text
    assert tree.token_ids == plain.token_ids
    assert plain.stats.mean_accepted_per_forward == 1.0 and plain.stats.tree_size == 0
    assert chain.stats.target_forwards < plain.stats.target_forwards
    assert tree.stats.target_forwards < plain.stats.target_forwards
    assert tree.stats.accepted_draft_tokens > 0 and tree.stats.tree_size >= 2  # its trees: test_suffix_drafter.py
    # Text deltas add up to the answer; prefill progress was reported up to the whole prompt.
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == chain.text
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert progress[-1].done == progress[-1].total == chain.prompt_tokens and len(progress) >= 3
    assert tree.stats.reused_prompt_tokens == plain.prompt_tokens - 1  # the same prompt: all but its last token
    # Each token's origin (the app colors by it): one per token, drafts as many as accepted.
    for answer_events, result in ((events, chain), (tree_events, tree)):
        deltas = [e for e in answer_events if isinstance(e, TextDelta)]
        assert "".join(text for delta in deltas for text, _ in delta.pieces) == result.text
        origins = [origin for delta in deltas if delta.token_ids for _, origin in delta.pieces]
        assert len(origins) == result.new_tokens and set(origins) <= {"draft", "recovered", "bonus", "plain"}
        assert 0 < origins.count("draft") <= result.stats.accepted_draft_tokens
        assert len(origins) - origins.count("draft") <= result.stats.target_forwards


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampled_answers_are_reproducible_with_a_seed(embedded_engine, mode):
    """Tree mode's drafter also searches earlier answers, so a second run drafted otherwise and
    spent the seeded random numbers otherwise: a Retry with the same seed wrote another answer."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=42)
    _, first = answer(embedded_engine, "Write a short poem about the sea.", mode, 32, params=params)
    _, second = answer(embedded_engine, "Write a short poem about the sea.", mode, 32, params=params)
    assert first.token_ids == second.token_ids and first.new_tokens > 0


def test_cancel_stops_the_answer(embedded_engine):
    cancel = threading.Event()
    ids = embedded_engine.chat_ids([{"role": "user", "content": "Tell me a long story about a dragon."}])
    tokens, result = 0, None
    for event in embedded_engine.generate(ids, Request(200, SamplingParams(), "plain"), cancel):
        if isinstance(event, TextDelta):
            tokens += len(event.token_ids)
            cancel.set()  # as a stop button would, while the answer streams
        elif isinstance(event, Finished):
            result = event.result
    assert result.finish_reason == "cancelled" and result.new_tokens == tokens <= 2


def test_stops_at_end_of_turn(embedded_engine):
    _, result = answer(embedded_engine, "What is the capital of France?", "auto", 64)
    assert result.finish_reason == "stop" and "Paris" in result.text
    assert result.mode == "chain"  # auto resolves to a concrete mode


def test_bad_requests_are_refused_before_any_work(embedded_engine):
    with pytest.raises(InputError, match="empty"):
        next(embedded_engine.generate([], Request(10)))
    too_long = [1] * (embedded_engine.context_length + 5)
    with pytest.raises(InputError, match="at least 6 tokens"):
        next(embedded_engine.generate(too_long, Request(10)))
    with pytest.raises(InputError, match="unknown mode"):
        next(embedded_engine.generate([1, 2], Request(10, mode="fast")))


def test_answer_is_cut_at_the_context_end_and_says_so(tiny_model_dir):
    """finish_reason "length" for both limits (a public contract); `context_full` tells them apart."""
    engine = load_engine(str(tiny_model_dir))
    ids = [5] * (engine.context_length - 3)
    *_, finished = engine.generate(ids, Request(50, SamplingParams(), "plain"))
    result = finished.result
    assert (result.finish_reason, result.new_tokens, result.context_full) == ("length", 3, True)
    *_, finished = engine.generate(ids[:20], Request(3, SamplingParams(), "plain"))  # the answer limit, with room left
    result = finished.result
    assert (result.finish_reason, result.new_tokens, result.context_full) == ("length", 3, False)
