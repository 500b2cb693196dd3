"""Stopping inside a forward (core/interrupt.py): a stop during the prompt read ends the answer
within about a layer's time, not a chunk's, and leaves the cache as if the stopped chunk never
ran, so the next answer reuses only whole chunks and reads like a fresh engine's."""

import threading
import time

import pytest
import torch

from conftest import tiny_llama
from specchat.core.engine import Engine, Finished, PrefillProgress
from specchat.core.interrupt import Cancelled, cancellable, stop_between_layers, stoppable
from specchat.core.kv.offload import OffloadedCache
from specchat.core.kv.prefix_store import PrefixStore
from specchat.core.runtime import EngineSettings
from specchat.core.sampling import SamplingParams
from specchat.core.request import Request

LAYERS = 16  # a stop lands within one of them: about a sixteenth of a chunk


@pytest.fixture(scope="module")
def deep(tiny_model_dir):
    """A random 16-layer model with the embedded tokenizer: long enough chunks to time."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tiny_llama(0, vocab_size=len(tokenizer), context=8192, layers=LAYERS), tokenizer


def fresh_engine(deep, chunk: int) -> Engine:
    model, tokenizer = deep
    return Engine(model, tokenizer, "deep", prefixes=PrefixStore(10**12),
                  settings=EngineSettings(prefill_chunk=chunk))


def answer(engine, prompt, cancel=None):
    """(events, each with the time it came, the final result) of a short greedy answer."""
    timed = [(event, time.perf_counter()) for event in engine.generate(prompt, Request(6, SamplingParams(), "plain"), cancel)]
    assert isinstance(timed[-1][0], Finished)
    return timed, timed[-1][0].result


def prefill_done(timed) -> list[int]:
    return [event.done for event, _ in timed if isinstance(event, PrefillProgress)]


def test_a_stop_during_the_prompt_read_ends_it_within_a_layer_not_a_chunk(deep):
    chunk = 1024
    prompt = list(range(1000, 1000 + 4 * chunk + 100))
    reference_events, reference = answer(fresh_engine(deep, chunk), prompt)
    read_at = {event.done: at for event, at in reference_events if isinstance(event, PrefillProgress)}
    third_chunk = read_at[3 * chunk] - read_at[2 * chunk]  # its own time, on this machine now

    engine, cancel, cancelled_at = fresh_engine(deep, chunk), threading.Event(), []

    def stop():  # as the stop button does, from another thread
        cancelled_at.append(time.perf_counter())
        cancel.set()

    read = []
    for event in engine.generate(prompt, Request(6, SamplingParams(), "plain"), cancel):
        if isinstance(event, PrefillProgress):
            read.append(event.done)
            if event.done == 2 * chunk:
                timer = threading.Timer(third_chunk / 3, stop)  # a third into the third chunk
                timer.start()
        elif isinstance(event, Finished):
            finished, result = time.perf_counter(), event.result
    timer.join()
    assert result.finish_reason == "cancelled" and result.new_tokens == 0 and read[-1] < len(prompt)
    # About a layer's time (a sixteenth of the chunk) and the machine's noise; before, the chunk
    # ran to its end, two thirds of a chunk after the stop.
    assert finished - cancelled_at[0] < third_chunk / 3, (finished - cancelled_at[0], third_chunk)

    resumed_events, resumed = answer(engine, prompt)
    assert resumed.stats.reused_prompt_tokens == read[-1]  # the whole chunks read before the stop
    assert prefill_done(resumed_events)[-1] == len(prompt)
    assert resumed.token_ids == reference.token_ids


def test_a_chunk_stopped_between_layers_is_rolled_back_in_every_layer(deep):
    """Stopped after half the layers of the second chunk: the first layers hold it, the rest do
    not. Without the rollback the cache would claim the second chunk (its length is the first
    layer's) and the next answer would reuse KV that half the layers never computed."""
    chunk, cancel, seen = 64, threading.Event(), []
    prompt = list(range(1000, 1000 + 3 * chunk + 10))

    def stop_in_the_second_chunk(module, args, output):
        seen.append(args[0].shape[1])
        if len(seen) == 2:
            cancel.set()

    engine = fresh_engine(deep, chunk)
    model = engine.model
    hook = model.hf.base_model.layers[LAYERS // 2].register_forward_hook(stop_in_the_second_chunk)
    try:
        timed, result = answer(engine, prompt, cancel)
    finally:
        hook.remove()
    assert result.finish_reason == "cancelled" and prefill_done(timed) == [chunk] and seen == [chunk, chunk]
    _, again = answer(engine, prompt)
    _, fresh = answer(fresh_engine(deep, chunk), prompt)
    assert again.stats.reused_prompt_tokens == chunk and again.stats.reused_from == "memory"
    assert again.token_ids == fresh.token_ids


def test_the_hooks_are_installed_once_and_stop_only_the_thread_whose_flag_is_set():
    model = tiny_llama(0)
    ids = torch.arange(10)
    # A layer-skip draft shares the target's layers: they get one hook each, not two.
    assert stoppable(model, model.new_cache()) and stoppable(model.truncated(1), model.new_cache())
    assert [len(layer._forward_pre_hooks) for layer in model.hf.base_model.layers] == [1, 1]
    flag, elsewhere = threading.Event(), []
    flag.set()
    with cancellable(flag):
        with pytest.raises(Cancelled):
            model.forward(ids, ids, model.new_cache())
        # The same model in another thread (a DSI instance beside the engine) runs on.
        worker = threading.Thread(target=lambda: elsewhere.append(model.forward(ids, ids, model.new_cache())))
        worker.start()
        worker.join()
    assert len(elsewhere) == 1
    model.forward(ids, ids, model.new_cache())  # and this thread's, outside `cancellable`


def test_an_offloaded_chunk_stops_between_layers_and_counts_none_of_its_positions():
    """Issue 38: Stop during a prefill chunk into an offloaded KV (up to 13 s a chunk at 128K) takes
    effect at the next layer; the chunk's positions were never counted, and reading it again
    gives what a fresh cache gives."""
    model, ids = tiny_llama(0), torch.arange(20)
    offloaded = OffloadedCache(model.hf.config, 32, "cpu", model.hf.dtype)
    assert stoppable(model, offloaded)
    model.forward(ids[:10], torch.arange(10), offloaded)
    flag, layers_run = threading.Event(), []

    def stop_after_the_first_layer(*_):
        layers_run.append(1)
        flag.set()

    hook = model.hf.base_model.layers[0].register_forward_hook(stop_after_the_first_layer)
    try:
        with pytest.raises(Cancelled), stop_between_layers(model, offloaded, flag):
            model.forward(ids[10:], torch.arange(10, 20), offloaded)
    finally:
        hook.remove()
    assert layers_run == [1] and offloaded.length == 10
    again = model.forward(ids[10:], torch.arange(10, 20), offloaded)
    fresh = model.new_cache()
    model.forward(ids[:10], torch.arange(10), fresh)
    torch.testing.assert_close(again, model.forward(ids[10:], torch.arange(10, 20), fresh))
