"""Shared fixtures: tiny random-weight models (fast, fp64 so greedy ties cannot flip between
batched and single-token forwards) and the real embedded model (converted once per machine)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach the Hub
# Tests check decoding, not this machine's speed: no first-use calibration (step_calibration.py),
# in this process and the `specchat` processes the tests start.
os.environ.setdefault("SPECCHAT_CALIBRATE", "0")
# Without a GPU, the Triton kernels (core/kv/int8_kernel.py, core/nf4_kernel.py) run in Triton's
# interpreter: it reads this when Triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (packaging/test.sh) each worker gets its share of the cores, and so do the
# processes its tests start: a second OpenMP thread per worker only spins on tiny models.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)
DATA = Path(__file__).parent / "data"
# A test that needs a CUDA GPU: skipped without one, and marked `cuda` so that `pytest -m cuda`
# (and `specchat bench --suite gpu`) finds every one of them.
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


# Where the sampling and verification tests run: the CPU, and a CUDA GPU when there is one (the
# device path: logits stay there, random numbers are drawn there).
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def needs_cuda(test):
    for mark in CUDA:
        test = mark(test)
    return test


def tiny_llama(seed: int, vocab_size: int = 97, dtype=torch.float64, context: int = 512,
               weight_scale: float = 1.0, layers: int = 2):
    """A small Llama (2 layers unless told) with grouped-query attention and random weights, in `dtype`.

    `weight_scale` sharpens its distributions (random init alone gives near-uniform logits).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from specchat.core.model import TransformersLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, attn_implementation="sdpa",
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(weight_scale)
    return TransformersLM(model)


@pytest.fixture
def undisturbed(monkeypatch):
    """Every curve taken as measured on a quiet machine, when measured and when read back: a busy
    machine legitimately measures a context again or gives up (tests/test_busy_calibration.py)."""
    from specchat.core import hardware, step_calibration

    for module in (step_calibration, hardware):
        monkeypatch.setattr(module, "disturbed", lambda curves: {})


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    from specchat.core import embedded

    return embedded.ensure_converted()


@pytest.fixture(scope="session")
def embedded_engine(embedded_dir):
    from specchat.core.loading import load_engine

    return load_engine("embedded")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir) -> Path:
    """A tiny random model saved with the embedded tokenizer: the real CLI path in a second.
    Its 256-token context makes 'too long' easy to reach."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("tiny-model")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_pair(embedded_dir, tmp_path_factory):
    """A tiny draft/target pair as Hub repositories (tests/hub_pairs.py)."""
    from hub_pairs import build_tiny_pair

    return build_tiny_pair(embedded_dir, tmp_path_factory.mktemp("tiny-pair"))


@pytest.fixture
def hub(tiny_pair):
    """The loopback stand-in Hub serving the tiny pair."""
    from standin_hub import StandinHub

    with StandinHub(tiny_pair.repos) as server:
        yield server


def holding(handle):
    """Hold the engine thread with a job until the returned gate is set."""
    gate, started = threading.Event(), threading.Event()

    def job(engine, cancel):
        started.set()
        gate.wait(30)
        yield "held"

    ticket = handle.submit(job)
    assert started.wait(30)
    return gate, ticket


@pytest.fixture
def logic(tiny_model_dir, tmp_path):
    """The chat page's logic on the tiny model, its conversations in a temporary folder."""
    from specchat.app.engine_handle import EngineHandle
    from specchat.app.history import HistoryStore
    from specchat.app.ui_chat import ChatLogic
    from specchat.core.loading import load_engine

    handle = EngineHandle(lambda model, progress: load_engine(model, progress), str(tiny_model_dir))
    handle.get()
    yield ChatLogic(handle, HistoryStore(tmp_path / "conversations"))
    handle.close()


def run(views):
    """Every view a chat handler yields."""
    return list(views)


def saved(logic):
    """The one conversation the logic has saved, read back."""
    (summary,) = logic.store.list()
    return logic.store.load(summary.id)


def route_on_cpu(monkeypatch, route, kernel_module, function: str) -> list[list[tuple[int, ...]]]:
    """A Triton kernel's route (core/triton_route.py) taken on the CPU, the kernel in Triton's
    interpreter, with no failure recorded; returns a list to which each kernel call appends the
    shapes of its tensor arguments."""
    monkeypatch.setattr(route, "devices", {"cuda", "cpu"})
    monkeypatch.setattr(route, "failed", {})
    calls = []
    kernel = getattr(kernel_module, function)

    def counted(*args, **kwargs):
        calls.append([tuple(arg.shape) for arg in args if isinstance(arg, torch.Tensor)])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(kernel_module, function, counted)
    return calls

