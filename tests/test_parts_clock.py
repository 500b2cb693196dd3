"""Summarizing in parts is estimated from the pace of the answers timed so far, then from the
parts done."""

from __future__ import annotations

from types import SimpleNamespace

from specchat.app.parts_clock import Pace, estimate_before, estimate_during, parts_seconds


def result(prompt, reused, new, prefill_s, decode_s):
    return SimpleNamespace(prompt_tokens=prompt, new_tokens=new, stats=SimpleNamespace(
        reused_prompt_tokens=reused, prefill_seconds=prefill_s, decode_seconds=decode_s))


def test_the_pace_counts_only_what_was_read_and_written_after_the_first_token():
    pace = Pace.of(result(prompt=1200, reused=200, new=101, prefill_s=4.0, decode_s=10.0))
    assert pace == Pace(read_tokens_per_s=250.0, written_tokens_per_s=10.0)
    assert Pace.of(result(1200, 1199, 50, 0.1, 5.0)) is not None  # one token read is still timed
    assert Pace.of(result(1200, 1200, 50, 0.1, 5.0)) is None  # all reused: no reading to time
    assert Pace.of(result(1200, 0, 1, 2.0, 0.0)) is None  # one token: no writing to time


def test_the_estimate_before_reads_every_part_and_writes_every_summary_at_its_longest():
    pace = Pace(read_tokens_per_s=100.0, written_tokens_per_s=10.0)
    assert parts_seconds([1000, 1000, 500], 100, pace) == 25.0 + 30.0
    assert estimate_before([1000, 1000, 500], 100, pace) == "about 55 s"
    assert estimate_before([6000] * 4, 256, pace) == "about 6 min"  # 240 s + 102 s
    assert estimate_before([1000], 100, None) == ""


def test_the_estimate_during_goes_by_the_parts_done():
    assert estimate_during(0, 4, 30.0) == ""
    assert estimate_during(1, 4, 20.0) == "about 60 s left"
    assert estimate_during(3, 4, 600.0) == "about 3 min left"
    assert estimate_during(4, 4, 300.0) == "a moment left"
