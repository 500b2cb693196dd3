"""Stopping a forward between two decoder layers, and undoing what it wrote.

A long forward (a prefill chunk of thousands of tokens, a DSI task nobody needs any more) would
otherwise run to its end after a stop. Each decoder layer gets a forward pre-hook that raises
`Cancelled` once the calling thread's cancel flag is set. The flag is per thread: the same model
object can run in the engine's thread and in a DSI instance's thread at once, and a stop reaches
only the thread it was set for. A thread with no flag (every forward outside `cancellable`)
passes the hooks untouched.

A forward stopped that way has written the new positions into the first layers only, so the
cache is rolled back layer by layer (`roll_back`); `FullCache.trim` would go by the first layer's
length and leave the others short. An offloaded cache counts a forward's positions only once its
last layer has run, so it needs no rollback, only its streaming state reset (`abandon_forward`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from .kv.full import FullCache, GrowingLayer
from .kv.offload import OffloadedCache

_thread = threading.local()  # the calling thread's cancel flag (a threading or multiprocessing Event)
_installing = threading.Lock()


class Cancelled(Exception):
    """The work running in this thread was cancelled."""


def cancel_flag():
    """This thread's cancel flag, or None outside `cancellable`."""
    return getattr(_thread, "cancel", None)


@contextlib.contextmanager
def cancellable(flag) -> Iterator[None]:
    """Inside, a forward this thread runs through `stoppable` layers stops between two of them
    once `flag` is set (raising `Cancelled`)."""
    previous = cancel_flag()
    _thread.cancel = flag
    try:
        yield
    finally:
        _thread.cancel = previous


def _stop_if_cancelled(*_) -> None:
    """Before each decoder layer (a forward pre-hook)."""
    flag = cancel_flag()
    if flag is not None and flag.is_set():
        raise Cancelled


def stoppable(model, cache) -> bool:
    """Whether forwards of `model` on `cache` may stop between layers, with the hooks installed
    (once per layer, whichever thread comes first) where they may: a full cache of full-attention
    layers crops back exactly, an offloaded one never counted the stopped forward; a
    sliding-window cache cannot be rolled back mid-forward, so its forwards always run whole."""
    full = isinstance(cache, FullCache) and all(isinstance(layer, GrowingLayer)
                                                for layer in cache.transformers_cache.layers)
    if not (hasattr(model, "decoder_layers") and (full or isinstance(cache, OffloadedCache))):
        return False
    with _installing:
        for layer in model.decoder_layers:
            # A marker on the layer itself: a layer-skip draft shares the target's layers, and
            # a deep copy of the model copies the hook and the marker together.
            if not getattr(layer, "_stops_when_cancelled", False):
                layer.register_forward_pre_hook(_stop_if_cancelled)
                layer._stops_when_cancelled = True
    return True


def roll_back(cache, length: int) -> None:
    """Every layer of `cache` back to `length` positions: a forward stopped between layers left
    the first layers longer than the rest."""
    if isinstance(cache, OffloadedCache):
        cache.abandon_forward()
        cache.trim(length)
    elif isinstance(cache, FullCache):
        for layer in cache.transformers_cache.layers:
            excess = layer.get_seq_length() - length
            if excess > 0:
                layer.crop(-excess)
    else:  # never stopped mid-forward (not `stoppable`): only whole forwards to undo
        cache.trim(length)


@contextlib.contextmanager
def stop_between_layers(model, cache, flag) -> Iterator[None]:
    """One forward of `model` on `cache`, stopped between two layers once `flag` is set where the
    cache can be rolled back: it then raises `Cancelled` with the cache as before the forward.
    Elsewhere (no flag, or a cache that cannot be rolled back) the forward runs whole."""
    if flag is None or not stoppable(model, cache):
        yield
        return
    length = cache.length
    with cancellable(flag):
        try:
            yield
        except Cancelled:
            roll_back(cache, length)
            raise
