"""One engine thread, a bounded line of jobs, and tickets that hand each job's events to whoever
asked for them (a worker thread of the page, a coroutine of the API).

Why a thread and not a lock: a lock held by a paused generator stays held until someone closes
the generator, and that someone may be a client who has gone away (the engine then waits for the
garbage collector). Here only the engine thread ever touches the engine; it never waits for a
consumer (events are buffered), so a slow or vanished client cannot hold it, and it ends a job
as soon as the job is cancelled, its consumer closes the ticket, or the consumer stops taking
events for `stall_seconds` while some are waiting (the backstop for consumers that vanish
without closing anything).

Vocabulary: a *job* is `job(engine, cancel) -> Iterator[event]`, run on the engine thread; its
*ticket* is the caller's end: iterate it (`for` or `async for`), read `position` while it waits,
`cancel()` it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
import threading
import time
from typing import Any, Callable, Iterator

from ..core.env_settings import env_number
from ..core.errors import SpecchatError, first_line

Job = Callable[[Any, threading.Event], Iterator[Any]]
_END = object()  # the job ended (finished, cancelled or removed from the line)
_NOTHING = object()  # no event has arrived yet (a job's event may be None: `call` of a function returning None)


class Busy(SpecchatError):
    """The line is full: the caller should try again shortly (the API answers 503)."""

    def __init__(self, waiting: int):
        super().__init__(f"busy: {waiting} requests waiting, try again shortly")
        self.waiting = waiting


class CancelledBeforeStart(SpecchatError):
    """`call` was cancelled before its function could run."""


class Ticket:
    """The consumer's end of one job. Events arrive in a buffer filled by the engine thread;
    taking them is blocking for `for` and awaiting (never blocking the loop) for `async for`.
    Leaving either loop early (break, an exception, GeneratorExit, CancelledError) cancels the
    job; an exception raised by the job is raised again in the consumer."""

    def __init__(self, job: Job, line: "EngineLine"):
        self.job = job
        self.cancel_event = threading.Event()  # the running job's: it ends at its next step
        self._line = line
        self._lock = threading.Condition()
        self._events: collections.deque = collections.deque()
        self._error: BaseException | None = None
        self._ended = False
        self.abandoned = False  # nobody will read on: the engine thread drops the job at once
        self._waiting_since: float | None = None  # when the oldest untaken event arrived
        self._wakers: list[Callable[[], None]] = []  # async consumers waiting for an event

    @property
    def position(self) -> int:
        """How many jobs run before this one (the running job and those ahead in line); 0 once
        it runs, has ended, or runs next on an idle engine."""
        return self._line.position(self)

    def cancel(self) -> None:
        """Remove the job from the line, or tell the running job to end at its next step (its
        last events, a `Finished` say, still arrive)."""
        self.cancel_event.set()
        self._line.remove(self)

    def close(self) -> None:
        """The consumer is gone: cancel, and let the engine thread drop the job's events."""
        self.abandoned = True
        self.cancel()

    # --- the engine thread's side --------------------------------------------------------------

    def put(self, event) -> None:
        with self._lock:
            if not self._events:
                self._waiting_since = time.monotonic()
            self._events.append(event)
            self._wake()

    def end(self, error: BaseException | None = None) -> None:
        with self._lock:
            if not self._ended:
                self._ended, self._error = True, error
                self._wake()

    def stalled(self, seconds: float) -> bool:
        """An event has waited `seconds` for a consumer that takes none."""
        with self._lock:
            return self._waiting_since is not None and time.monotonic() - self._waiting_since > seconds

    def _wake(self) -> None:  # holding self._lock
        self._lock.notify_all()
        wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    # --- the consumer's side -------------------------------------------------------------------

    def _take(self):
        """The next event, `_END`, or `_NOTHING` when nothing is there yet (holding self._lock)."""
        if self._events:
            event = self._events.popleft()
            self._waiting_since = time.monotonic() if self._events else None
            return event
        if self._ended:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            return _END
        return _NOTHING

    def __iter__(self) -> Iterator:
        return self._iterate()

    def _iterate(self) -> Iterator:
        with self._closed_if_left():
            while True:
                with self._lock:
                    event = self._take()
                    while event is _NOTHING:
                        self._lock.wait()
                        event = self._take()
                if event is _END:
                    return
                yield event

    def batches(self, every: float) -> Iterator[list]:
        """The events as lists, at most one list every `every` seconds: each holds whatever arrived
        meanwhile, and the job's end is handed over at once. For a consumer whose work per hand-over
        (a page redrawn) would otherwise take CPU from the engine at every step."""
        with self._closed_if_left():
            due = 0.0
            while True:
                with self._lock:
                    while not self._ended and not (self._events and time.monotonic() >= due):
                        self._lock.wait(max(0.0, due - time.monotonic()) if self._events else None)
                    batch, finished = list(self._events), self._ended
                    self._events.clear()
                    self._waiting_since = None
                if batch:
                    due = time.monotonic() + every
                    yield batch
                if finished:
                    with self._lock:
                        self._take()  # `_END`, or the job's error raised
                    return

    def __aiter__(self):
        return self._aiterate()

    async def _aiterate(self):
        loop = asyncio.get_running_loop()
        with self._closed_if_left():
            while True:
                woken = asyncio.Event()
                with self._lock:
                    event = self._take()
                    if event is _NOTHING:
                        self._wakers.append(lambda: _call_soon(loop, woken.set))
                if event is _NOTHING:
                    await woken.wait()
                    continue
                if event is _END:
                    return
                yield event

    @contextlib.contextmanager
    def _closed_if_left(self) -> Iterator[None]:
        """Around a consumer's loop: leaving it before the job has ended (break, an exception,
        GeneratorExit, CancelledError) closes the ticket, which cancels the job. The job's own
        error ends the job first."""
        try:
            yield
        finally:
            if not self._ended:
                self.close()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the loop has closed: its consumer is gone
        pass


class EngineLine:
    """The waiting line and the thread that serves it, in order, one job at a time.

    `get_engine()` returns the engine a job runs on (waiting for a model that is still loading;
    its error becomes the job's). `idle_work()` returns, without waiting, work for the thread's
    idle time, an object with `steps() -> Iterator` (the first use's calibration), or None: a
    step runs only while no job waits, and a job that comes closes the steps (the work starts
    them again at the next idle spell, from where its own bookkeeping says); a different object
    (another model loaded) replaces the steps of the one before."""

    def __init__(self, get_engine: Callable[[], Any], max_waiting: int | None = None,
                 stall_seconds: float | None = None, idle_work: Callable[[], Any] = lambda: None):
        self._get_engine = get_engine
        self._idle_work = idle_work
        self._idle_steps: Iterator | None = None  # the idle work's steps, paused between them
        self._idle_owner = None  # the work they belong to
        self.max_waiting = max_waiting or env_number("SPECCHAT_MAX_WAITING", 128, int)
        self.stall_seconds = stall_seconds or env_number("SPECCHAT_STALL_SECONDS", 30.0)
        self._lock = threading.Condition()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._closed = False
        self._running: Ticket | None = None
        self._thread = threading.Thread(target=self._serve, name="specchat-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Ticket:
        ticket = Ticket(job, self)
        with self._lock:
            if self._closed:
                raise SpecchatError("the server is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise Busy(len(self._waiting))
            self._waiting.append(ticket)
            self._lock.notify()
        return ticket

    def call(self, fn: Callable[[Any], Any], cancel: threading.Event | None = None):
        """`fn(engine)` run alone on the engine thread; its result (or its error). `cancel`, when
        set, removes the call from the line (raising `CancelledBeforeStart`) or sets the running job's
        cancel event (which `fn` may watch through its own reference to `cancel`)."""
        ticket = self.submit(lambda engine, _cancel: iter([fn(engine)]))
        done = threading.Event()
        if cancel is not None:
            threading.Thread(target=_link, args=(cancel, ticket, done), daemon=True).start()
        try:
            for result in ticket:
                return result
            raise CancelledBeforeStart("cancelled before it started")
        finally:
            done.set()

    def position(self, ticket: Ticket) -> int:
        with self._lock:
            try:
                return self._waiting.index(ticket) + (self._running is not None)
            except ValueError:
                return 0

    def remove(self, ticket: Ticket) -> None:
        with self._lock:
            try:
                self._waiting.remove(ticket)
            except ValueError:
                return  # running or ended: its cancel event does the rest
        ticket.end()

    def stop_serving(self) -> None:
        """Take no more jobs; each waiting one and the running one end at once with an error
        their consumers can tell their clients (the running one is cancelled too). Returns at
        once: called as the server begins to shut down, while clients can still be answered."""
        shutting_down = SpecchatError("the server is shutting down")
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._lock.notify_all()
        for ticket in waiting:
            ticket.end(shutting_down)
        running = self._running
        if running is not None:
            running.end(shutting_down)
            running.cancel()

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving (`stop_serving`), the running job abandoned; waits up to `timeout` for
        the engine thread (a forward cannot be interrupted)."""
        self.stop_serving()
        running = self._running
        if running is not None:
            running.close()
        self._thread.join(timeout)

    # --- the engine thread ---------------------------------------------------------------------

    def wake(self) -> None:
        """Look for idle work again (a model has loaded)."""
        with self._lock:
            self._lock.notify()

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._closed and not self._start_idle_steps():
                    self._lock.wait()
                if self._closed:
                    self._stop_idle_steps()
                    return
                ticket = self._running = self._waiting.popleft() if self._waiting else None
            if ticket is None:
                self._idle_step()
                continue
            self._stop_idle_steps()  # the job has the machine to itself
            try:
                self._run(ticket)
            finally:
                with self._lock:
                    self._running = None

    def _start_idle_steps(self) -> bool:
        """Whether idle work is there to step (holding self._lock)."""
        work = self._idle_work()
        if work is not self._idle_owner:
            self._stop_idle_steps()
            self._idle_owner = work
        if self._idle_steps is None and work is not None:
            self._idle_steps = work.steps()
        return self._idle_steps is not None

    def _idle_step(self) -> None:
        try:
            next(self._idle_steps)
        except StopIteration:
            self._idle_steps = self._idle_owner = None
        except Exception as error:  # idle work never takes the engine thread down
            self._idle_steps = self._idle_owner = None
            print(f"specchat: idle work stopped: {first_line(error) or type(error).__name__}", file=sys.stderr)

    def _stop_idle_steps(self) -> None:
        if self._idle_steps is not None:
            self._idle_steps.close()
            self._idle_steps = None

    def _run(self, ticket: Ticket) -> None:
        try:
            engine = self._get_engine()
            if ticket.cancel_event.is_set():  # cancelled as it left the line
                ticket.end()
                return
            events = ticket.job(engine, ticket.cancel_event)
            try:
                for event in events:
                    ticket.put(event)
                    if ticket.stalled(self.stall_seconds):
                        ticket.close()  # a consumer that took nothing for so long is gone
                    if ticket.abandoned:
                        break
            finally:
                close = getattr(events, "close", None)
                if close is not None:
                    close()  # the job's own cleanup runs now, on this thread
        except BaseException as error:  # the consumer's to handle; the thread serves on
            ticket.end(error)
        else:
            ticket.end()


def _link(cancel: threading.Event, ticket: Ticket, done: threading.Event) -> None:
    """Cancel `ticket` when `cancel` is set, until the caller is `done` with it."""
    while not done.is_set():
        if cancel.wait(0.1):
            ticket.cancel()
            return
