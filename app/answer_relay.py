"""A handler's views drawn by three Gradio events in a row, so that a streaming answer redraws a few
components instead of all of them.

Gradio rebuilds every output component of an event at each redraw, the unchanged ones too, and
the page runs a status timer for each output while the event runs (bench/notes/page-streaming.md).
So an answer is drawn by:
1. `start` (every output): the views until the answer streams, the first streaming view included;
2. `stream` (`STREAM_FIELDS` only): the streaming views that change nothing else;
3. `end` (every output): the first other view (the answer's end, an error) and the rest.
Between two events the handler's generator waits here, under the browser session's key. A session
answers one question at a time: a new `start` ends the one still waiting to stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Iterator

from .chat_view import View, problem_text

# What a streaming view may change and still be drawn by `stream` (`ui_chat_page.ChatPage.stream_outputs`).
STREAM_FIELDS = ("conversation", "status", "stats", "stages", "tokens", "streaming", "pending")
_UNCHANGED = View()


def streams_only(view: View) -> bool:
    """True for a streaming view that changes nothing outside `STREAM_FIELDS`."""
    return view.streaming and dataclasses.replace(view, **{name: getattr(_UNCHANGED, name)
                                                           for name in STREAM_FIELDS}) == _UNCHANGED


def guarded(views: Callable[[], Iterator[View]]) -> Iterator[View]:
    """The handler's views; an error ends them as a line in the page, and an over-limit panel shown
    before it goes (its choices were for what failed). Only the handler's own steps are caught: a
    failure while it is closed is never answered with a view."""
    with contextlib.closing(views()) as stream:
        while True:
            try:
                view = next(stream)
            except StopIteration:
                return
            except Exception as error:
                yield View(status=problem_text(error), over_limit="")
                return
            yield view


class AnswerRelay:
    def __init__(self):
        self._lock = threading.Lock()
        self._to_stream: dict[str, Iterator[View]] = {}  # by session: parked by `start`, for `stream`
        self._to_end: dict[str, tuple[View, Iterator[View]]] = {}  # by session: parked by `stream`, for `end`

    def start(self, session: str, views: Iterator[View]) -> Iterator[View]:
        """The views up to the first that `streams_only` (drawn here, so that the components
        `stream` leaves alone are drawn as they stream); the rest wait for `stream`."""
        self.discard_waiting(session)
        parked = False
        try:
            for view in views:
                yield view
                if streams_only(view):
                    with self._lock:
                        self._to_stream[session] = views
                    parked = True
                    return
        finally:
            if not parked:
                views.close()

    def stream(self, session: str) -> Iterator[View]:
        """The waiting views while they `streams_only`; the first other one, with the rest, waits
        for `end`. Closed early (the page left), the answer is closed with it."""
        with self._lock:
            views = self._to_stream.pop(session, None)
        if views is None:
            return
        parked = False
        try:
            for view in views:
                if not streams_only(view):
                    with self._lock:
                        self._to_end[session] = (view, views)
                    parked = True
                    return
                yield view
        finally:
            if not parked:
                views.close()

    def end(self, session: str) -> Iterator[View]:
        """The view `stream` stopped at, and the rest."""
        with self._lock:
            waiting = self._to_end.pop(session, None)
        if waiting is None:
            return
        first, views = waiting
        with contextlib.closing(views):
            yield first
            yield from views

    def discard_waiting(self, session: str) -> None:
        """Close the session's answer that waits to stream (its generator ends as a page that left
        would end it)."""
        with self._lock:
            views = self._to_stream.pop(session, None)
        if views is not None:
            views.close()

    def discard(self, session: str) -> None:
        """Close whatever of the session's waits between two events: the page moved on."""
        self.discard_waiting(session)
        with self._lock:
            waiting = self._to_end.pop(session, None)
        if waiting is not None:
            waiting[1].close()
