"""The engine's line (`app/engine_queue.py` through `EngineHandle`): one engine thread, tickets used
from threads and coroutines, cancellation while waiting and running, the bound on the line, the
backstop for consumers that vanish, `call`; and the engine's own release of its lock and its
recovery from running out of GPU memory (on the tiny model)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest
import torch

from specchat.app.engine_handle import EngineHandle
from specchat.app.engine_queue import Busy, CancelledBeforeStart
from specchat.core.engine import Finished, TextDelta
from specchat.core.errors import SpecchatError
from specchat.core.loading import load_engine
from specchat.core.sampling import SamplingParams
from specchat.core.request import Request

WAIT = 10  # seconds: every wait in these tests is bounded


@pytest.fixture
def handle():
    handle = EngineHandle(lambda model, progress: f"engine:{model}", "fake", max_waiting=3, stall_seconds=0.5)
    yield handle
    handle.close()


def counting(n: int, gate: threading.Event | None = None, started: threading.Event | None = None,
             seen: list | None = None):
    """A job yielding 0..n-1; it waits for `gate` first and stops early when cancelled."""
    def job(engine, cancel):
        if started is not None:
            started.set()
        if gate is not None:
            assert gate.wait(WAIT)
        for i in range(n):
            if cancel.is_set():
                if seen is not None:
                    seen.append("cancelled")
                return
            yield (engine, i, threading.current_thread().name)
            time.sleep(0.01)
    return job


def test_a_ticket_streams_its_job_on_the_engine_thread(handle):
    events = list(handle.submit(counting(3)))
    assert [i for _, i, _ in events] == [0, 1, 2]
    assert {(engine, thread) for engine, _, thread in events} == {("engine:fake", "specchat-engine")}


def test_async_consumers_never_block_the_loop(handle):
    gate = threading.Event()

    async def main():
        ticks = 0
        ticket = handle.submit(counting(3, gate))

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        clock = asyncio.ensure_future(ticker())
        asyncio.get_running_loop().call_later(0.3, gate.set)  # the job waits; the loop must go on
        events = [i async for _, i, _ in ticket]
        clock.cancel()
        return events, ticks

    events, ticks = asyncio.run(asyncio.wait_for(main(), WAIT))
    assert events == [0, 1, 2] and ticks >= 10


def test_jobs_run_in_order_and_a_waiting_one_can_leave_the_line(handle):
    gate, started, order = threading.Event(), threading.Event(), []
    first = handle.submit(counting(2, gate, started))
    assert started.wait(WAIT)
    second, third = handle.submit(counting(2)), handle.submit(counting(2))
    assert (first.position, second.position, third.position) == (0, 1, 2)  # jobs before each
    second.cancel()
    assert third.position == 1 and list(second) == []  # removed: it ends at once, having run nothing
    gate.set()
    for ticket in (first, third):
        order.extend(i for _, i, _ in ticket)
    assert order == [0, 1, 0, 1]


def test_cancelling_or_leaving_a_running_job_frees_the_engine(handle):
    seen = []
    ticket = handle.submit(counting(1000, seen=seen))
    events = iter(ticket)
    next(events)
    ticket.cancel()  # the job sees its cancel event at its next step
    assert len(list(events)) < 5 and seen == ["cancelled"]
    leaving = handle.submit(counting(1000))
    for _ in leaving:
        break  # closing the iterator (a consumer that stops listening) cancels the job
    started = time.monotonic()
    assert [i for _, i, _ in handle.submit(counting(1))] == [0]
    assert time.monotonic() - started < 2


def test_an_async_consumer_that_is_cancelled_cancels_its_job(handle):
    seen = []

    async def main():
        ticket = handle.submit(counting(1000, seen=seen))

        async def consume():
            async for _ in ticket:
                await asyncio.sleep(0)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.1)
        task.cancel()  # what Starlette does to a stream whose client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), WAIT))
    assert [i for _, i, _ in handle.submit(counting(1))] == [0]  # the engine thread is free
    assert seen == ["cancelled"]


def test_errors_of_a_job_reach_its_consumer_and_the_line_serves_on(handle):
    def failing(engine, cancel):
        yield 1
        raise SpecchatError("the job failed")

    ticket = handle.submit(failing)
    events = iter(ticket)
    assert next(events) == 1
    with pytest.raises(SpecchatError, match="the job failed"):
        next(events)
    assert len(list(handle.submit(counting(2)))) == 2


def test_batches_hand_over_every_event_in_order_at_most_one_list_per_interval(handle):
    handed = []  # (seconds, the list)
    for batch in handle.submit(counting(60)).batches(0.2):  # about 0.6-1 s of events
        handed.append((time.monotonic(), batch))
    assert [i for _, batch in handed for _, i, _ in batch] == list(range(60))
    gaps = [later - earlier for (earlier, _), (later, _) in zip(handed, handed[1:])]
    assert len(handed) >= 3 and min(gaps[:-1]) >= 0.19, gaps  # the last list: the end, handed at once
    assert len(handed) <= (handed[-1][0] - handed[0][0]) / 0.2 + 2


def test_batches_hand_over_the_end_and_an_error_at_once(handle):
    def two_then_end(engine, cancel):
        yield 0
        time.sleep(0.05)
        yield 1

    started = time.monotonic()
    assert list(handle.submit(two_then_end).batches(5.0)) == [[0], [1]]
    assert time.monotonic() - started < 2  # not held for the 5 s interval

    def failing(engine, cancel):
        yield 1
        time.sleep(0.05)
        raise SpecchatError("the job failed")

    batches = handle.submit(failing).batches(5.0)
    assert next(batches) == [1]
    with pytest.raises(SpecchatError, match="the job failed"):
        next(batches)


def test_leaving_the_batches_early_cancels_the_job(handle):
    seen = []
    for _ in handle.submit(counting(1000, seen=seen)).batches(0.05):
        break  # closing the batches cancels the job, as leaving the events does
    started = time.monotonic()
    assert [i for _, i, _ in handle.submit(counting(1))] == [0]
    assert time.monotonic() - started < 2 and seen == ["cancelled"]


def test_a_full_line_refuses_with_the_count(handle):
    gate, started = threading.Event(), threading.Event()
    running = handle.submit(counting(1, gate, started))
    assert started.wait(WAIT)
    waiting = [handle.submit(counting(1)) for _ in range(3)]
    with pytest.raises(Busy, match="busy: 3 requests waiting, try again shortly"):
        handle.submit(counting(1))
    gate.set()
    assert all(len(list(ticket)) == 1 for ticket in [running, *waiting])


def test_a_consumer_that_vanishes_without_closing_is_cancelled_by_the_backstop(handle):
    seen = []
    ticket = handle.submit(counting(100_000, seen=seen))
    next(iter(ticket))  # one event taken, then nothing: no close, no cancel (stall: 0.5 s)
    started = time.monotonic()
    assert [i for _, i, _ in handle.submit(counting(1))] == [0]
    assert time.monotonic() - started < 3 and seen == ["cancelled"]


def test_call_runs_a_function_alone_on_the_engine_thread(handle):
    assert handle.call(lambda engine: (engine, threading.current_thread().name)) == ("engine:fake", "specchat-engine")
    with pytest.raises(ZeroDivisionError):
        handle.call(lambda engine: 1 / 0)
    # None is an event like any other (it read as "nothing yet", and the caller waited for ever).
    assert handle.call(lambda engine: None) is None
    assert list(handle.submit(lambda engine, cancel: iter([None, 0]))) == [None, 0]

    async def taken():
        return [event async for event in handle.submit(lambda engine, cancel: iter([None, 0]))]
    assert asyncio.run(asyncio.wait_for(taken(), WAIT)) == [None, 0]
    gate, started, cancel = threading.Event(), threading.Event(), threading.Event()
    running = handle.submit(counting(1, gate, started))
    assert started.wait(WAIT)
    threading.Timer(0.2, cancel.set).start()
    with pytest.raises(CancelledBeforeStart):
        handle.call(lambda engine: "never", cancel)  # cancelled while it waited in line
    gate.set()
    assert len(list(running)) == 1


def test_a_model_that_failed_to_load_fails_each_job_with_its_reason():
    def load(model, progress):
        raise OSError("no such model")

    handle = EngineHandle(load, "missing")
    try:
        with pytest.raises(SpecchatError, match="could not be loaded: no such model"):
            list(handle.submit(counting(1)))
    finally:
        handle.close()


def test_a_switch_that_fails_goes_back_to_the_model_before_and_says_why():
    """"Use this pair" on one that cannot load (out of memory, broken weights) left the chat with
    no model at all, a local model folder not even in the list to choose again."""
    def load(model, progress):
        if model == "broken":
            raise OSError("CUDA out of memory")
        return f"engine:{model}"

    handle = EngineHandle(load, "./my-model")
    try:
        assert handle.get(WAIT) == "engine:./my-model" and handle.switch_note() == ""
        handle.switch("broken")
        assert handle.get(WAIT) == "engine:./my-model" and handle.model == "./my-model"
        assert handle.status() == "ready"
        assert handle.switch_note() == "⚠️ could not switch to broken: CUDA out of memory; back on ./my-model"
        handle.switch("other")
        assert handle.get(WAIT) == "engine:other" and handle.switch_note() == ""
    finally:
        handle.close()


# --- the engine itself, on the tiny model -------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return load_engine(str(tiny_model_dir))


def test_an_abandoned_generator_does_not_hold_the_engine(tiny_engine):
    """`Engine.generate` used directly (CLI, terminal chat): a paused generator nobody closes
    must not keep another thread's answer waiting (the lock is never held across a yield)."""
    ids = tiny_engine.chat_ids([{"role": "user", "content": "hello"}])
    paused = tiny_engine.generate(ids, Request(20, SamplingParams(), "plain"))
    next(paused)
    gc.disable()  # no collector to close it for us
    try:
        done = []
        other = threading.Thread(target=lambda: done.extend(tiny_engine.generate(ids, Request(3, SamplingParams(), "plain"))))
        other.start()
        other.join(WAIT)
        assert done and isinstance(done[-1], Finished)
    finally:
        gc.enable()
        paused.close()


def test_out_of_memory_ends_the_answer_clearly_and_the_engine_recovers(tiny_engine, monkeypatch):
    ids = tiny_engine.chat_ids([{"role": "user", "content": "out of memory, please"}])
    forward = tiny_engine.model.forward

    def failing_at(call: int):
        """The model's forward, raising CUDA's out-of-memory error (a CPU build has it too) once."""
        calls = []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == call:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return forward(*args, **kwargs)
        return failing

    tiny_engine.prefixes.clear()
    monkeypatch.setattr(tiny_engine.model, "forward", failing_at(3))  # the prefill and a step went well
    events = []
    with pytest.raises(SpecchatError, match="the GPU ran out of memory while writing the answer: try a shorter"):
        for event in tiny_engine.generate(ids, Request(10, SamplingParams(), "plain")):
            events.append(event)
    assert any(isinstance(event, TextDelta) for event in events)
    assert tiny_engine.prefixes.best_length(ids) == 0  # the failed answer's KV was not kept
    monkeypatch.setattr(tiny_engine.model, "forward", failing_at(1))
    with pytest.raises(SpecchatError, match="while reading the prompt: try a shorter document or a smaller pair"):
        list(tiny_engine.generate(ids, Request(10, SamplingParams(), "plain")))
    monkeypatch.setattr(tiny_engine.model, "forward", forward)
    *_, finished = tiny_engine.generate(ids, Request(5, SamplingParams(), "plain"))
    assert finished.result.new_tokens >= 1 and finished.result.finish_reason in ("stop", "length")


def test_the_loading_models_progress_lines_reach_the_page_until_it_is_loaded():
    noted, release = threading.Event(), threading.Event()

    def load(model, progress):
        progress("Calibrating on this machine, once: forward times at 256 tokens of context (1/4)...")
        noted.set()
        release.wait(5)
        return f"engine:{model}"

    handle = EngineHandle(load, "fake")
    try:
        assert noted.wait(5)
        assert handle.status() == "loading" and handle.progress().startswith("Calibrating on this machine")
        release.set()
        assert handle.get(5) == "engine:fake" and handle.progress() == ""
    finally:
        release.set()
        handle.close()
