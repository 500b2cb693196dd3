"""DSI's instances for one engine: where they run, started on first use (each loads the target),
kept for later answers on the same devices and closed with their owner. One DSI answer at a time:
a task's result must come from the pool its answer started."""

from __future__ import annotations

import threading
import weakref
from typing import Callable

from ...errors import InputError
from ...model import CausalLM
from ..drafters import PromptLookupDrafter
from ..hierarchy import ModelDrafter
from .orchestrator import DsiDecoder
from .pool import InstancePool, process_pool

CPU_WORKERS = 2  # CPU processes standing in for GPUs, unless the request asks for more
START_LOOKAHEAD = 4  # until latencies are measured, where the plan predicts none


class DsiRuntime:
    def __init__(self, target: CausalLM, loader: Callable[[str], CausalLM] | None, name: str,
                 prefill_chunk: int, draft: CausalLM | None = None, plan_devices: tuple[str, ...] = (),
                 draft_cache: tuple[int, int] = (4, 256), lookahead: int | None = None):
        self.target, self.loader, self.name = target, loader, name
        self.draft = draft  # the pair's draft model drafts when there is one, else prompt lookup
        self.plan_devices = plan_devices  # one instance per device the plan names; () on one card or a CPU
        self.prefill_chunk = prefill_chunk
        self.draft_cache = draft_cache  # the draft's StreamingLLM (sinks, window)
        self.lookahead = lookahead or START_LOOKAHEAD
        self.pool: InstancePool | None = None
        self._devices: tuple[str, ...] = ()
        self._answering: DsiDecoder | None = None
        self._lock = threading.Lock()

    def devices(self, workers: int | None) -> tuple[str, ...]:
        """Where the instances run: the plan's GPUs, else `workers` CPU processes."""
        if self.loader is None:
            raise InputError(f"dsi mode needs a model loaded from disk; {self.name} was built in memory")
        if self.plan_devices and workers is None:
            return self.plan_devices
        return ("cpu",) * (CPU_WORKERS if workers is None else workers)

    def decoder(self, workers: int | None = None, plain_steps: bool = True) -> DsiDecoder:
        """This answer's decoder over the pool for its devices (started, or restarted for other
        devices). `release` it when the answer ends."""
        devices = self.devices(workers)
        with self._lock:
            if self._answering is not None:
                raise InputError("another dsi answer is running: one at a time")
            if self.pool is None or self._devices != devices:
                self.close()
                # On GPUs the engine's own target is the first instance; CPU processes stand in
                # for GPUs, so there every instance is a process of its own.
                local = self.target if devices[0] != "cpu" else None
                self.pool = process_pool(self.loader, list(devices), self.prefill_chunk, local)
                weakref.finalize(self, self.pool.close)  # the processes end with their owner
                self._devices = devices
            sinks, window = self.draft_cache
            drafter = (ModelDrafter(self.draft, sinks, window, False, "pair", self.prefill_chunk) if self.draft is not None
                       else PromptLookupDrafter(min_ngram=1))
            self._answering = DsiDecoder(drafter, self.pool, start=self.lookahead, plain_steps=plain_steps)
            return self._answering

    @property
    def answering(self) -> DsiDecoder | None:
        """The decoder of the DSI answer running now, if any."""
        return self._answering

    def release(self, decoder) -> None:
        """The answer `decoder` served has ended (any decoder may be passed: only DSI's frees)."""
        with self._lock:
            if decoder is self._answering:
                self._answering = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool, self._devices = None, ()
