"""The context meter and document cuts, on the embedded model's real tokenizer and chat template."""

from __future__ import annotations

import re

import pytest

from specchat.app.context_meter import (CUTS, MIN_ANSWER, Meter, cut_document, cut_marker, describe, measure,
                                        split_document)
from specchat.app.documents import user_turn
from specchat.core.engine import Engine
from specchat.core.errors import InputError

# Numbered sentences, so a test can tell which parts of the document a cut kept.
DOCUMENT = " ".join(f"Sentence {i:04d} says something about café prices." for i in range(200))
HISTORY = [{"role": "user", "content": "What is this about?"},
           {"role": "assistant", "content": "It is a list of sentences about prices."}]


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


class TokenizerEngine:
    """An engine without weights: `Engine`'s own token counting on a real tokenizer."""

    chat_ids = Engine.chat_ids
    count_tokens = Engine.count_tokens

    def __init__(self, tokenizer, context_length: int):
        self.tokenizer = tokenizer
        self.context_length = context_length


def tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_parts_add_up_to_at_most_the_prompt(tokenizer):
    engine = TokenizerEngine(tokenizer, 8192)
    meter = measure(engine, "Answer briefly.", HISTORY, DOCUMENT, "Which sentence is first?", 1024)
    assert min(meter.system, meter.history, meter.document, meter.question) > 0
    assert meter.system + meter.history + meter.document + meter.question <= meter.prompt
    assert meter.prompt == len(engine.chat_ids(
        [{"role": "system", "content": "Answer briefly."}] + HISTORY
        + [{"role": "user", "content": f"{DOCUMENT}\n\nWhich sentence is first?"}]))
    assert meter.context == 8192


def test_empty_parts_count_nothing(tokenizer):
    meter = measure(TokenizerEngine(tokenizer, 8192), "", [], "", "Hi?", 1024)
    assert (meter.system, meter.history, meter.document) == (0, 0, 0)
    assert meter.question <= meter.prompt


def test_the_whole_answer_limit_is_kept_so_an_answer_can_end(tokenizer):
    engine = TokenizerEngine(tokenizer, 8192)
    assert measure(engine, "", [], DOCUMENT, "Q?", 1024).reserve == 1024
    assert measure(engine, "", [], DOCUMENT, "Q?", 50).reserve == 50


def test_answer_room_is_what_the_prompt_leaves_unless_too_little():
    meter = Meter(system=0, history=0, document=7900, question=12, prompt=7950, context=8192, reserve=512)
    assert (meter.over, meter.answer_room) == (True, 240)  # a multiple of the slider's step, within the room
    exact = Meter(system=0, history=0, document=7900, question=12, prompt=8192 - 160, context=8192, reserve=512)
    assert exact.answer_room == 144  # never up to the context's very end: the answer would fill it
    tight = Meter(system=0, history=0, document=8000, question=12, prompt=8192 - MIN_ANSWER, context=8192,
                  reserve=512)
    assert tight.answer_room == 0


def test_over_flips_when_prompt_and_reserve_pass_the_context(tokenizer):
    prompt = measure(TokenizerEngine(tokenizer, 8192), "", HISTORY, DOCUMENT, "Q?", 100).prompt
    fits = measure(TokenizerEngine(tokenizer, prompt + 100), "", HISTORY, DOCUMENT, "Q?", 100)
    assert (fits.needed, fits.over, fits.excess, fits.fraction) == (prompt + 100, False, 0, 1.0)
    over = measure(TokenizerEngine(tokenizer, prompt + 99), "", HISTORY, DOCUMENT, "Q?", 100)
    assert (over.over, over.excess) == (True, 1)
    assert over.fraction > 1.0


def test_describe_lists_the_parts():
    meter = Meter(system=20, history=310, document=7402, question=12, prompt=7812, context=8192, reserve=256)
    assert describe(meter) == ("**7,812 + 256 / 8,192 tokens** (prompt + the answer limit) · document 7,402 · "
                               "history 310 · system 20 · question 12")


def test_describe_says_by_how_much_it_is_over_and_skips_empty_parts():
    meter = Meter(system=0, history=0, document=9100, question=12, prompt=9170, context=8192, reserve=256)
    assert describe(meter) == ("**9,170 + 256 / 8,192 tokens** (prompt + the answer limit) · document 9,100 · "
                               "question 12 — **over the limit by 1,234 tokens**")


def sentences(text: str) -> list[str]:
    return re.findall(r"Sentence (\d{4})", text)


@pytest.mark.parametrize("where", CUTS)
def test_cut_removes_enough_marker_included(tokenizer, where):
    new, removed = cut_document(tokenizer, DOCUMENT, 500, where)
    assert removed >= 500
    assert cut_marker(removed) in new
    assert tokens(tokenizer, new) <= tokens(tokenizer, DOCUMENT) - 500


def test_start_cut_keeps_the_end(tokenizer):
    new, removed = cut_document(tokenizer, DOCUMENT, 500, "start")
    assert new.startswith(cut_marker(removed))
    assert new.endswith("Sentence 0199 says something about café prices.")
    assert "0000" not in sentences(new)


def test_end_cut_keeps_the_start(tokenizer):
    new, removed = cut_document(tokenizer, DOCUMENT, 500, "end")
    assert new.startswith("Sentence 0000 says something")
    assert new.endswith(cut_marker(removed))
    assert "0199" not in sentences(new)


def test_middle_cut_keeps_both_ends(tokenizer):
    new, removed = cut_document(tokenizer, DOCUMENT, 500, "middle")
    head, tail = new.split(cut_marker(removed))
    assert head.startswith("Sentence 0000") and tail.rstrip().endswith("café prices.")
    assert "0100" not in sentences(new)
    assert abs(tokens(tokenizer, head) - tokens(tokenizer, tail)) < 20  # the halves kept are even


def test_cutting_the_excess_makes_the_conversation_fit(tokenizer):
    fits = measure(TokenizerEngine(tokenizer, 8192), "", HISTORY, DOCUMENT, "Q?", 256)
    engine = TokenizerEngine(tokenizer, fits.needed - 700)
    over = measure(engine, "", HISTORY, DOCUMENT, "Q?", 256)
    assert over.excess == 700
    for where in CUTS:
        shorter, _ = cut_document(tokenizer, DOCUMENT, over.excess, where)
        assert not measure(engine, "", HISTORY, shorter, "Q?", 256).over


def test_parts_and_cuts_never_split_a_character(tokenizer):
    """Emoji and CJK characters span several byte-level tokens: a part or a cut ending inside one
    lost it from both sides (36 of 6,300 characters over 109 parts)."""
    text = ("日本語の文章です。" * 200 + "\n") * 3 + "🙂🙃😀" * 300
    characters = "".join(text.split())
    parts = split_document(tokenizer, text, 100)
    assert len(parts) > 50 and "".join("".join(parts).split()) == characters
    for where in CUTS:
        kept, removed = cut_document(tokenizer, text, 500, where)
        assert "\ufffd" not in kept and removed >= 500
        assert cut_marker(removed) in kept


def test_nothing_to_remove_leaves_the_document_alone(tokenizer):
    assert cut_document(tokenizer, DOCUMENT, 0, "middle") == (DOCUMENT, 0)


def test_a_document_too_short_to_cut(tokenizer):
    with pytest.raises(InputError, match="cannot be cut enough: .*start a new conversation"):
        cut_document(tokenizer, DOCUMENT, tokens(tokenizer, DOCUMENT), "end")


def test_unknown_cut(tokenizer):
    with pytest.raises(InputError, match="unknown cut 'top': choose from start, middle, end"):
        cut_document(tokenizer, DOCUMENT, 10, "top")


class CountingTokenizer:
    """A real tokenizer that records how many characters it was asked to tokenize."""

    def __init__(self, tokenizer, extra: int = 0):
        self.tokenizer, self.extra, self.tokenized = tokenizer, extra, 0
        self.added_tokens_decoder = tokenizer.added_tokens_decoder

    def encode(self, text, add_special_tokens=False):
        self.tokenized += len(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens) + [0] * self.extra

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return self.encode(text) if tokenize else text


def long_history(turns: int) -> list[dict]:
    return [{"role": role, "content": f"Turn {turn}: {DOCUMENT}"} for turn in range(turns)
            for role in ("user", "assistant")]


def test_a_reopened_conversation_is_not_tokenized_again(tokenizer):
    # Found: the meter, recounted at each keystroke and reopening, tokenized the whole
    # conversation every time (145 s and 11 GB at 60 MB).
    engine = TokenizerEngine(CountingTokenizer(tokenizer), 1_000_000)
    history = long_history(20)
    first = measure(engine, "Answer briefly.", history, "", "What is first?", 512)
    engine.tokenizer.tokenized = 0
    again = measure(engine, "Answer briefly.", history, "", "What is last?", 512)
    assert engine.tokenizer.tokenized < 200  # the new question and the turn around it, not the history
    assert again.history == first.history
    assert again.prompt == len(Engine.chat_ids(TokenizerEngine(tokenizer, 0), [
        {"role": "system", "content": "Answer briefly."}, *history, {"role": "user", "content": "What is last?"}]))


def test_a_tokenizer_whose_pieces_do_not_add_up_is_counted_whole(tokenizer):
    # Each encode call makes one token more than its text: counting between the template's
    # markers would overcount, so the whole prompt is counted, exactly.
    engine = TokenizerEngine(CountingTokenizer(tokenizer, extra=1), 8192)
    meter = measure(engine, "Answer briefly.", HISTORY, "", "Which?", 512)
    whole = engine.chat_ids([{"role": "system", "content": "Answer briefly."}, *HISTORY,
                             {"role": "user", "content": "Which?"}])
    assert meter.prompt == len(whole)


def test_typing_under_a_long_document_tokenizes_only_the_end(tokenizer):
    # Found: each keystroke re-tokenized the document with the question (0.67 s at 1.2M characters).
    from specchat.app.token_counts import HEAD_STEP

    document = " ".join(f"Sentence {i:05d} says something about café prices." for i in range(2_000))
    assert len(document) > 4 * HEAD_STEP
    engine = TokenizerEngine(CountingTokenizer(tokenizer), 1_000_000)
    measure(engine, "Answer briefly.", HISTORY, document, "W", 512)
    for question in ("Wh", "What is it?", "What is it about, in two lines?"):
        engine.tokenizer.tokenized = 0
        meter = measure(engine, "Answer briefly.", HISTORY, document, question, 512)
        assert engine.tokenizer.tokenized < 3 * HEAD_STEP
        assert meter.prompt == len(Engine.chat_ids(TokenizerEngine(tokenizer, 0), [
            {"role": "system", "content": "Answer briefly."}, *HISTORY,
            {"role": "user", "content": user_turn(question, document)}]))


def test_a_head_that_does_not_add_up_is_never_trusted(tokenizer):
    # One token more per encode call: head + tail overcounts the whole, so each count stays whole.
    document = " ".join(f"Sentence {i:05d} says something about café prices." for i in range(2_000))
    engine = TokenizerEngine(CountingTokenizer(tokenizer, extra=1), 1_000_000)
    for question in ("W", "Wh"):
        meter = measure(engine, "", [], document, question, 512)
        assert meter.prompt == len(engine.chat_ids([{"role": "user", "content": user_turn(question, document)}]))
