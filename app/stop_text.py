"""Stop strings (the API's `stop`): the answer ends just before the first occurrence of any of
them, and streamed text never shows a piece of one.

Streaming is the hard part: a stop string can arrive split over several deltas, so text that
could be the start of one is held back until the next delta settles it.
"""

from __future__ import annotations


class StopText:
    """Feed the answer's text deltas in order; each `feed` returns what may be shown now."""

    def __init__(self, stops: list[str]):
        self.stops = [stop for stop in stops if stop]
        self.matched = False  # a stop string was found: the answer ends here
        self.text = ""  # everything shown so far: the answer up to the stop string
        self._held = ""  # the end of the text so far that may begin a stop string

    def feed(self, delta: str) -> str:
        if self.matched:
            return ""
        pending = self._held + delta
        found = [at for at in (pending.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.matched, self._held = True, ""
            return self._show(pending[:min(found)])
        held = _longest_start_of_a_stop(pending, self.stops)
        self._held = pending[len(pending) - held:] if held else ""
        return self._show(pending[:len(pending) - held])

    def end_in(self, written: str) -> int:
        """Where the stop string that ended the answer ends in `written`, the text the answer was
        cut from (its length when none did)."""
        cut = len(self.text)
        ends = [cut + len(stop) for stop in self.stops if written.startswith(stop, cut)]
        return min(ends, default=len(written))

    def finish(self) -> str:
        """The held text, once the answer has ended without a stop string."""
        held, self._held = self._held, ""
        return "" if self.matched else self._show(held)

    def _show(self, text: str) -> str:
        self.text += text
        return text


def _longest_start_of_a_stop(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that some stop string begins with (not whole:
    a whole stop string would have been found)."""
    longest = min(len(text), max((len(stop) - 1 for stop in stops), default=0))
    for length in range(longest, 0, -1):
        if any(stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0
