"""Target instances for DSI (orchestrator.py): each a model with a cache of its own, served by a
thread (tests, the simulation) or a process of its own (one per GPU, or CPU processes standing in
for GPUs).

An instance follows whatever text its tasks bring: it keeps the KV of the longest prefix the new
task shares with the last, reads the rest of the context in chunks, and computes logits only for
the task's last positions. So the first task of an answer reads the prompt, and later ones only
the few tokens past the instance's last task.

A task the decoder no longer needs (built on a rejected draft) is cancelled: the instance stops
between two layers and rolls its cache back to what it had finished, so it is free for the next
task at once instead of after a whole forward nobody will use.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch

from ...errors import SpecchatError
from ...interrupt import Cancelled, cancel_flag, cancellable, roll_back, stoppable
from ...model import CausalLM
from ..token_cache import TokenCache

WAKE = -1  # the task id of `InstancePool.wake`'s message
CLOSE_WAIT_S = 10.0  # for the instances to stop, before processes are terminated


class TargetPool(Protocol):
    """What the orchestrator needs of its target instances, each with a cache of its own."""
    size: int

    def idle(self) -> int:
        """Instances with nothing to do."""
        ...

    def submit(self, tokens: torch.Tensor, count: int) -> int:
        """Give `tokens` [E] to an idle instance: its logits after each of the last `count`
        tokens. Returns the task's id."""
        ...

    def results(self, timeout: float | None) -> list[tuple[int, torch.Tensor, float]]:
        """Finished tasks as (id, logits [count, vocab], seconds it ran), waiting up to
        `timeout` seconds (None: until one finishes, or `wake`) for the first."""
        ...

    def wake(self) -> None:
        """Make a waiting `results` return, from another thread."""
        ...

    def cancel(self, task_ids: set[int]) -> None:
        """Stop these tasks where they are (their results never come)."""
        ...


def wait_unless_cancelled(seconds: float) -> None:
    """A simulated forward's wait, cut short by cancellation."""
    flag = cancel_flag()
    if flag is None:
        time.sleep(seconds)
    elif flag.wait(seconds):
        raise Cancelled


class CacheInstance(TokenCache):
    """A target instance: the model over a new cache of its own, read in prefill chunks, whose
    forwards a cancelled task stops between layers (core/interrupt.py)."""

    def __init__(self, model: CausalLM, prefill_chunk: int):
        super().__init__(model, model.new_cache(), prefill_chunk=prefill_chunk)
        stoppable(model, self.cache)

    def logits(self, tokens: torch.Tensor, count: int) -> torch.Tensor:
        """As `TokenCache.logits`; a cancelled task raises `Cancelled` with the cache holding
        exactly the prompt chunks that finished."""
        try:
            return super().logits(tokens, count)
        except Cancelled:
            roll_back(self.cache, self.ids.shape[0])
            raise


@dataclass(frozen=True)
class TargetLoader:
    """How a process builds its own copy of the target: the model directory and the plan's load
    options, on the device given (picklable, so spawned processes can call it)."""
    path: str
    options: object = None  # placement.LoadOptions, or None: fp32 on the CPU

    def __call__(self, device: str) -> CausalLM:
        import transformers

        from ...model import TransformersLM

        transformers.utils.logging.set_verbosity_error()  # a process's loading bars are noise
        transformers.utils.logging.disable_progress_bar()

        options = self.options
        if options is not None:
            # A "cpu" instance stands in for a GPU beside a target on one (a single-card plan):
            # it runs on the CPU in the plan's dtype, without the GPU-only options.
            gpu_only = {} if device != "cpu" else dict(quantization=None, quantize_head=False,
                                                        offload_capacity=None, embedding_on_cpu=False)
            options = replace(options, device_map=device, **gpu_only)
        return TransformersLM.from_pretrained(self.path, options)


def _serve(make_model: Callable[[str], CausalLM], device: str, threads: int, prefill_chunk: int, index: int,
           inbox, outbox, cancel) -> None:
    """An instance's loop: (task id, tokens, count) in, (task id, instance, logits, an error or
    None when cancelled, seconds) out; None stops it. `cancel` (an event) stops the task."""
    if threads:
        torch.set_num_threads(threads)
    try:
        instance = CacheInstance(make_model(device), prefill_chunk)
    except Exception as error:  # reported to the pool's owner, who shows it
        outbox.put((None, index, f"{type(error).__name__}: {error}", 0.0))
        return
    outbox.put((None, index, None, 0.0))  # ready
    with cancellable(cancel):  # for the thread's life: every forward it runs is a task's
        while (task := inbox.get()) is not None:
            task_id, tokens, count = task
            cancel.clear()  # set only for this instance's task, and never once its result is read
            started = time.perf_counter()
            try:  # numpy arrays cross the process boundary as plain bytes (no shared-memory handles)
                result = instance.logits(torch.from_numpy(tokens), count).cpu().numpy()
            except Cancelled:
                result = None
            except Exception as error:
                result = f"{type(error).__name__}: {error}"
            outbox.put((task_id, index, result, time.perf_counter() - started))


class InstancePool:
    """A `TargetPool` over workers that each serve one instance."""

    def __init__(self, size: int, start: Callable[[int, object, object, object], threading.Thread],
                 make_queue: Callable[[], object], make_event: Callable[[], object]):
        self.size = size
        self._outbox = make_queue()
        self._inboxes = [make_queue() for _ in range(size)]
        self._cancels = [make_event() for _ in range(size)]
        self._running: dict[int, int] = {}  # instance -> the task it runs
        self.finished = [0] * size  # tasks each instance ran to the end, over the pool's life
        self._ids = itertools.count()
        self._workers = [start(index, self._inboxes[index], self._outbox, self._cancels[index])
                         for index in range(size)]  # threads or processes
        _open_pools.add(self)
        self._idle: list[int] = []
        self._await_ready()

    def _await_ready(self) -> None:
        for _ in range(self.size):
            _, index, error, _ = self._get(None)
            if error is not None:
                self.close()
                raise SpecchatError(f"a DSI target instance could not start: {error}")
            self._idle.append(index)

    def idle(self) -> int:
        return len(self._idle)

    def submit(self, tokens: torch.Tensor, count: int) -> int:
        task_id, index = next(self._ids), self._idle.pop()
        self._running[index] = task_id
        self._inboxes[index].put((task_id, tokens.numpy(), count))
        return task_id

    def cancel(self, task_ids: set[int]) -> None:
        for index, task_id in list(self._running.items()):
            if task_id in task_ids:
                self._cancels[index].set()

    def results(self, timeout: float | None) -> list[tuple[int, torch.Tensor, float]]:
        finished = []
        try:
            finished.append(self._get(timeout))
            while True:
                finished.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        finished = [message for message in finished if message[0] != WAKE]
        for _, index, result, _ in finished:
            self._running.pop(index, None)
            self._idle.append(index)
            if isinstance(result, str):
                raise SpecchatError(f"a DSI target instance failed: {result}")
            self.finished[index] += result is not None
        return [(task_id, torch.from_numpy(logits), seconds) for task_id, _, logits, seconds in finished
                if logits is not None]

    def wake(self) -> None:
        """Make a waiting `results` return (with nothing, if nothing finished)."""
        self._outbox.put((WAKE, -1, None, 0.0))

    def _get(self, timeout: float | None):
        """The next message; raises queue.Empty after `timeout`, and SpecchatError when an
        instance died (out of memory, killed) instead of waiting for it forever."""
        if timeout == 0:
            return self._outbox.get_nowait()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            try:
                return self._outbox.get(timeout=wait)
            except queue.Empty:
                if not all(worker.is_alive() for worker in self._workers):
                    raise SpecchatError("a DSI target instance stopped (out of memory?): "
                                        "try fewer --dsi-workers or another mode") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def close(self) -> None:
        """Stop every instance and wait for it: a thread still inside torch when the
        interpreter exits aborts it. Meanwhile results still on their way are read and dropped:
        a process ends only once its queue's pipe took what it sent, and at exit this process
        would wait to send its own messages (a `wake`) into a pipe nobody reads any more (a CLI
        answer, printed, then hung at exit in CI)."""
        for inbox, cancel in zip(self._inboxes, self._cancels):
            inbox.put(None)
            cancel.set()
        deadline = time.monotonic() + CLOSE_WAIT_S
        while any(worker.is_alive() for worker in self._workers) and time.monotonic() < deadline:
            try:
                self._outbox.get(timeout=0.1)
            except queue.Empty:
                pass
        for worker in self._workers:
            if worker.is_alive() and hasattr(worker, "terminate"):
                worker.terminate()
                worker.join(timeout=1)
        for messages in (self._outbox, *self._inboxes):
            if hasattr(messages, "cancel_join_thread"):  # a process's queue: what is unsent is moot now
                messages.cancel_join_thread()
        _open_pools.discard(self)


_open_pools: weakref.WeakSet[InstancePool] = weakref.WeakSet()
atexit.register(lambda: [pool.close() for pool in list(_open_pools)])


def thread_pool(models: list[CausalLM], prefill_chunk: int) -> InstancePool:
    """One thread per model (in this process): the tests' and the simulation's instances."""
    def start(index, inbox, outbox, cancel):
        model = models[index]
        thread = threading.Thread(target=_serve, daemon=True, name=f"dsi-instance-{index}",
                                  args=(lambda device: model, "cpu", 0, prefill_chunk, index, inbox, outbox, cancel))
        thread.start()
        return thread

    return InstancePool(len(models), start, queue.Queue, threading.Event)


def process_pool(loader: Callable[[str], CausalLM], devices: list[str], prefill_chunk: int,
                 local: CausalLM | None = None) -> InstancePool:
    """One spawned process per device ("cpu" entries: CPU processes standing in for GPUs), each
    loading its own copy of the target; CPU processes share the cores evenly. `local`: the
    engine's own target, already on `devices[0]`, serves that device from a thread instead (a
    card holds one copy of the target, as the plan budgets)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    cpu_workers = devices.count("cpu")
    threads = max(1, (os.cpu_count() or 1) // cpu_workers) if cpu_workers else 0

    def start(index, inbox, outbox, cancel):
        device = devices[index]
        if index == 0 and local is not None:
            worker = threading.Thread(target=_serve, daemon=True, name="dsi-instance-0",
                                      args=(lambda _: local, device, 0, prefill_chunk, index, inbox, outbox, cancel))
        else:
            worker = context.Process(target=_serve, daemon=True, name=f"specchat-dsi-{index}",
                                     args=(loader, device, threads if device == "cpu" else 0, prefill_chunk, index,
                                           inbox, outbox, cancel))
        worker.start()
        return worker

    return InstancePool(len(devices), start, context.Queue, context.Event)
