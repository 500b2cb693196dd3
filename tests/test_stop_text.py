"""Stop strings over streamed text: cut before the first occurrence, never a piece shown."""

import pytest

from specchat.app.stop_text import StopText


def stream(stops, deltas):
    stop = StopText(stops)
    shown = [stop.feed(delta) for delta in deltas]
    shown.append(stop.finish())
    assert "".join(shown) == stop.text
    return shown, stop


def test_the_answer_ends_before_the_first_occurrence():
    shown, stop = stream(["END"], ["Hello ", "world END and more", " after"])
    assert stop.text == "Hello world " and stop.matched


def test_a_stop_string_split_over_deltas_is_never_shown_in_part():
    shown, stop = stream(["</answer>"], ["The answer is 4<", "/ans", "wer> trailing"])
    assert shown[0] == "The answer is 4" and shown[1] == ""  # "<" and "</ans" were held back
    assert stop.text == "The answer is 4" and stop.matched


def test_held_text_that_turns_out_not_to_be_a_stop_is_shown():
    shown, stop = stream(["\n\n"], ["line one\n", "line two\n", "end"])
    assert shown == ["line one", "\nline two", "\nend", ""] and not stop.matched
    _, ended = stream(["STOP"], ["almost ST"])
    assert ended.text == "almost ST" and not ended.matched  # the answer ended: what was held shows


def test_the_earliest_of_several_stops_wins():
    _, stop = stream(["zz", "b"], ["a", "bzz"])
    assert stop.text == "a"
    _, overlapping = stream(["abc", "bcd"], ["xabcd"])
    assert overlapping.text == "x"


@pytest.mark.parametrize("cut", range(1, 12))
def test_any_split_gives_the_same_answer(cut):
    text = "one two three four"
    shown, stop = stream(["three", "our"], [text[:cut], text[cut:]])
    assert stop.text == "one two "


def _answer(steps: list[list[str]], stops: list[str]):
    """An answer streamed a step at a time (each step commits its tokens' texts at once), through
    the API's stop strings; the result it ends with."""
    import threading

    from specchat.app.api import _until_stop
    from specchat.core.engine import Finished, Result, Stats, TextDelta

    def events():
        ids = iter(range(1000))
        committed = []
        for step in steps:
            step_ids = [next(ids) for _ in step]
            committed += step_ids
            yield TextDelta("".join(step), step_ids, Stats(), tuple((text, "draft") for text in step))
        yield Finished(Result("".join(map("".join, steps)), committed, 3, len(committed), "chain", "length"))

    *_, finished = _until_stop(events(), StopText(stops), threading.Event())
    return finished.result


def test_the_usage_counts_the_tokens_until_the_stop_string_whatever_a_step_committed_after():
    """A speculative step commits several tokens at once: those past the stop string were counted,
    so the same request reported other completion_tokens in each mode."""
    one_at_a_time = _answer([["Hel"], ["lo"], [" wor"], ["ld"], ["!"]], ["wor"])
    at_once = _answer([["Hel", "lo"], [" wor", "ld", "!"]], ["wor"])
    assert one_at_a_time.text == at_once.text == "Hello "
    assert one_at_a_time.new_tokens == at_once.new_tokens == 3 and at_once.token_ids == [0, 1, 2]
    assert one_at_a_time.finish_reason == at_once.finish_reason == "stop"
    unmatched = _answer([["Hel", "lo"], [" wor", "ld"]], ["xyz"])
    assert unmatched.new_tokens == 4 and unmatched.finish_reason == "length"
