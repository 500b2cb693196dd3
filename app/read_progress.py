"""The prompt read as the answer's bubble shows it: a bar, the tokens read and the time left.

The time left comes from the pace of the latest chunk, not the average: each chunk attends to all
that came before it, so later chunks are the slower ones and the average would promise too much.
The first report cannot tell reused tokens (no work) from read ones, so it makes no estimate.
"""

from __future__ import annotations

import math

BAR_CELLS = 20


class ReadProgress:
    def __init__(self):
        self._last: tuple[float, int] | None = None  # (when, tokens done) at the previous report

    def update(self, done: int, total: int, now: float) -> str:
        """Markdown for the bubble after a report that `done` of `total` prompt tokens are read."""
        left = ""
        if self._last is not None and now > self._last[0] and done > self._last[1]:
            pace = (done - self._last[1]) / (now - self._last[0])
            left = f" · {time_left((total - done) / pace)}"
        self._last = (now, done)
        return reading_markdown(done, total, left)


def reading_markdown(done: int, total: int, left: str = "") -> str:
    fraction = done / total if total else 1.0
    filled = math.floor(fraction * BAR_CELLS)
    bar = "█" * filled + "░" * (BAR_CELLS - filled)
    return (f"⏳ *Reading the prompt before answering*\n\n`{bar}` **{fraction:.0%}** · "
            f"{done:,} / {total:,} tokens{left or ' · estimating the time left…'}")


def time_left(seconds: float) -> str:
    """"about 40 s left", "about 3 min left", "a moment left"."""
    if seconds < 2:
        return "a moment left"
    if seconds < 90:
        return f"about {round(seconds)} s left"
    return f"about {round(seconds / 60)} min left"
