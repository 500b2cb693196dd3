"""Document readers run in a process of their own, with a time limit and (where the OS enforces one)
a memory limit, so no file can pin the app.

A PDF page of text-showing operators kept pypdf busy for over five minutes, and a .docx of
millions of empty paragraphs took two minutes and 2.3 GB, though both passed every size check: the
work a reader does is not bounded by the bytes it is given. A separate process can be stopped
whatever it is doing, and its memory given back at once.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..core.env_settings import env_number
from ..core.errors import InputError

SECONDS_VARIABLE = "SPECCHAT_DOCUMENT_READ_SECONDS"
MEMORY_VARIABLE = "SPECCHAT_DOCUMENT_READ_MEMORY_MB"
DEFAULT_SECONDS = 8.0  # with the start allowance, a refusal within 10 s
DEFAULT_MEMORY_MB = 1024  # address space of the reader's process: Python and pypdf take ~150 MB of it
POLL_S = 0.05  # how often the worker's memory is read: a reader allocates at most a few hundred MB meanwhile
BACKSTOP = 2  # the address space the OS allows the worker, times the limit: bounds what a poll can miss
START_ALLOWANCE_S = 2.0  # a new interpreter and the reader's imports, not counted against the file


def read_in_worker(reader: Callable[[bytes, Path], str], data: bytes, path: Path) -> str:
    """`reader(data, path)` in a new process: its text, its `InputError`, or an `InputError` that
    names the limit it passed and the variable that raises it."""
    seconds = env_number(SECONDS_VARIABLE, DEFAULT_SECONDS, wanted="a positive number of seconds")
    memory_mb = env_number(MEMORY_VARIABLE, DEFAULT_MEMORY_MB, wanted="a positive number of MB")
    # spawn, not fork: the app has threads (Gradio, torch), and a forked child may inherit a held lock.
    context = multiprocessing.get_context("spawn")
    receiving, sending = context.Pipe(duplex=False)
    worker = context.Process(target=_read, args=(reader, data, path, int(BACKSTOP * memory_mb * 2**20), sending),
                             name="specchat-document-reader", daemon=True)
    worker.start()
    sending.close()  # the child holds its own end: a crash then shows here as end of file
    try:
        outcome = _wait(worker, receiving, seconds + START_ALLOWANCE_S, int(memory_mb * 2**20))
    finally:
        if worker.is_alive():
            worker.kill()
        worker.join()
        receiving.close()
    kind, value = outcome
    if kind == "text":
        return value
    if kind == "time":
        raise InputError(f"reading {path} took longer than {seconds:g} s (a document built to keep a reader "
                         f"busy?); set {SECONDS_VARIABLE} to allow more")
    if kind == "memory":
        raise InputError(f"reading {path} needs more than {memory_mb:g} MB of memory (a document built to exhaust "
                         f"it?); set {MEMORY_VARIABLE} to allow more")
    raise InputError(value)


def _wait(worker, receiving, seconds: float, memory_bytes: int) -> tuple[str, object]:
    """The worker's result, or ("time" | "memory", None) once it passes a limit. Its memory is read
    from outside (psutil, on every OS): a reader that runs out inside may report anything at all
    (lxml calls a failed allocation a syntax error)."""
    import psutil

    watched = psutil.Process(worker.pid)
    deadline = time.monotonic() + seconds
    while not receiving.poll(POLL_S):
        try:
            if watched.memory_info().rss > memory_bytes:
                return "memory", None
        except psutil.NoSuchProcess:  # it ended: its result, if any, is in the pipe
            pass
        if not worker.is_alive() and not receiving.poll():
            return "memory", None  # killed by the OS: the address-space backstop, or the OOM killer
        if time.monotonic() > deadline:
            return "time", None
    try:
        return receiving.recv()
    except EOFError:
        return "memory", None


def _read(reader, data: bytes, path: Path, memory_bytes: int, sending) -> None:
    _limit_memory(memory_bytes)
    try:
        result = ("text", reader(data, path))
    except InputError as error:
        result = ("error", str(error))
    except MemoryError:
        result = ("memory", None)
    except Exception as error:  # the reader's own catch-all missed it: still one clear line
        result = ("error", f"cannot read {path}: {type(error).__name__}: {error}")
    sending.send(result)
    sending.close()


def _limit_memory(memory_bytes: int) -> None:
    """Cap the process's address space where the OS can (Linux, macOS): a backstop for the memory
    watched from outside, which is what Windows has."""
    if sys.platform == "win32":
        return
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ValueError, OSError):  # a hard limit already lower, or none settable: keep what is there
        pass
