"""An answer's engine events drawn as the page's views while it streams.

The page is drawn once per batch of events, at most every `STREAM_UPDATE_SECONDS`: each redraw
rebuilds every output component in Gradio (an unchanged one too) and re-renders the chat in the
browser, and on a small machine that CPU is taken from the engine (bench/notes/page-streaming.md).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Generator

from . import chat_versions as versions
from .answer_job import Started
from .chat_view import View, error_reason
from .engine_queue import Ticket
from .history import HistoryStore
from .read_progress import ReadProgress
from .speculation_view import colored_tokens, stage_table, stats_line

STREAM_UPDATE_SECONDS = 0.25  # a few redraws a second still read as live text
SAVE_EVERY_SECONDS = 2.0  # while an answer streams; bounds what a crash can lose of it
STARTING = "⏳ *Starting…*"


def answer_views(conversation, reply: dict, ticket: Ticket, store: HistoryStore,
                 start: str = "") -> Generator[View, None, object]:
    """The views of `ticket`'s answer, first its place in the engine's line if it waits, written
    into `reply` (the conversation's last message) after `start` (a continued answer's text so far)
    and saved as it goes, from its start; returns the engine's `Result`, or None when the answer never finished
    (cancelled while it waited in line)."""
    from ..core.engine import Finished, Notice, PrefillProgress, TextDelta

    store.save_answer(conversation, reply)  # saved empty at once: another tab or a reload shows it being written
    ahead = ticket.position
    if ahead:
        waiting = f"Waiting for the engine: {ahead} answer{'s' if ahead > 1 else ''} before yours…"
        yield View(conversation=conversation, streaming=True, status=waiting, pending=f"⏳ *{waiting}*")
    mode, pending, result = "", STARTING, None
    earlier = (reply.get("new_tokens") or 0) if start else 0  # a continued answer's tokens so far
    streamed = 0
    reading = ReadProgress()
    saved_at = time.monotonic()
    shown_status = None  # the status line as this answer last drew it
    for batch in ticket.batches(STREAM_UPDATE_SECONDS):
        view, status, wrote = None, "", False
        for event in batch:
            if isinstance(event, Started):
                mode = reply["mode"] = event.mode
            elif isinstance(event, PrefillProgress):
                pending = reading.update(event.done, event.total, time.monotonic())
                view = View(conversation=conversation, streaming=True, status=status, pending=pending)
            elif isinstance(event, Notice):
                status = f"ℹ️ {event.text}"  # stays shown with the batch's text
                view = View(conversation=conversation, streaming=True, status=status, pending=pending)
            elif isinstance(event, TextDelta):
                reply["content"] += event.text
                reply["origins"].extend([text, origin] for text, origin in event.pieces if text)
                reply["stats"] = dataclasses.asdict(event.stats)
                streamed += len(event.token_ids)
                reply["new_tokens"] = earlier + streamed  # counted as it streams: an answer cut off keeps it
                wrote = True
            elif isinstance(event, Finished):
                result = event.result
                view = _finished(conversation, reply, result, store, start, earlier)
        if wrote and result is None:  # drawn once per batch: the figures and tokens cover the whole answer
            view = View(conversation=conversation, streaming=True, status=status,
                        stats=stats_line(reply["stats"], mode), stages=stage_table(reply["stats"]),
                        tokens=colored_tokens(reply["origins"]))
            if time.monotonic() - saved_at > SAVE_EVERY_SECONDS:
                store.save_answer(conversation, reply)
                saved_at = time.monotonic()
        if view is not None:
            if view.status == shown_status:  # left alone: a line another handler drew since (Renamed) stays
                view.status = None
            else:
                shown_status = view.status
            yield view
    return result


def _finished(conversation, reply: dict, result, store: HistoryStore, start: str, earlier: int) -> View:
    """The answer's end written into `reply` and saved; the view that shows it."""
    if start and result.text:
        reply["continued"] = reply.get("continued", 0) + 1
    reply.update(content=start + result.text, partial=False, stats=dataclasses.asdict(result.stats),
                 finish_reason=result.finish_reason, context_full=result.context_full,
                 new_tokens=earlier + result.new_tokens, mode=result.mode)
    store.save_answer(conversation, reply)
    # The list again as the answer ends (its time moved): the one drawn as it began can be
    # overdrawn by a slower event's (CI once kept a list without the conversation).
    return View(conversation=conversation, status="", conversations_changed=True, **versions.figures(reply))


def cut_by_error(reply: dict, error: Exception, start: str) -> None:
    """`reply` ends, ended by `error`. Cut after words of its own past `start` (a continued
    answer's text so far), it says so and why, wherever it shows; with none it is no answer, which
    the caller takes out. One that had ended (only its last save failed) keeps its ending."""
    if reply["partial"] and reply["content"] != start:
        if start:
            reply["continued"] = reply.get("continued", 0) + 1
        reply.update(finish_reason="error", error=error_reason(error))
    reply["partial"] = False
