"""How long summarizing a document in parts will take: before it starts, from the pace of the
answers this app has measured (reading the prompt, writing the answer); once parts are done, from
their own time, which already holds everything the pace leaves out (templates, stops, warm-up)."""

from __future__ import annotations

from dataclasses import dataclass

from .read_progress import time_left


@dataclass(frozen=True)
class Pace:
    read_tokens_per_s: float
    written_tokens_per_s: float

    @staticmethod
    def of(result) -> Pace | None:
        """The pace of one finished answer (core.engine.Result); None when it read or wrote nothing
        to time (a prompt all reused, an answer of one token)."""
        stats = result.stats
        read = result.prompt_tokens - stats.reused_prompt_tokens
        written = result.new_tokens - 1  # the first token comes with the read
        if read <= 0 or written <= 0 or stats.prefill_seconds <= 0 or stats.decode_seconds <= 0:
            return None
        return Pace(read / stats.prefill_seconds, written / stats.decode_seconds)


def parts_seconds(part_tokens: list[int], summary_tokens: int, pace: Pace) -> float:
    """Reading every part and writing each one's summary at its longest."""
    return sum(part_tokens) / pace.read_tokens_per_s + len(part_tokens) * summary_tokens / pace.written_tokens_per_s


def estimate_before(part_tokens: list[int], summary_tokens: int, pace: Pace | None) -> str:
    """"about 4 min", or "" before any answer has been timed here."""
    if pace is None:
        return ""
    return time_left(parts_seconds(part_tokens, summary_tokens, pace)).removesuffix(" left")


def estimate_during(done: int, count: int, elapsed_s: float) -> str:
    """The parts' time left from the pace of those done; "" before the first is done."""
    if done <= 0 or elapsed_s <= 0:
        return ""
    return time_left(elapsed_s / done * (count - done))
