"""Where a Triton kernel runs (core/triton_route.py), and what says why it does not."""

from types import SimpleNamespace

import pytest
import torch

from specchat.core import triton_route
from specchat.core.triton_route import TritonRoute

CUDA, CPU, BF16, FP16 = torch.device("cuda", 0), torch.device("cpu"), torch.bfloat16, torch.float16


def test_without_triton_nothing_runs_and_the_fallback_says_why(monkeypatch):
    def no_triton(name, package=None):
        raise ModuleNotFoundError("No module named 'triton'", name="triton")
    monkeypatch.setattr(triton_route.importlib, "import_module", no_triton)
    route = TritonRoute(".nf4_kernel", "bitsandbytes")
    assert route.kernel is None and not route.runs_on(CUDA, BF16)
    assert route.describe(CUDA, BF16) == "bitsandbytes: Triton is not installed"
    monkeypatch.undo()
    missing_part = TritonRoute(".no_such_kernel", "bitsandbytes")  # anything else missing is a broken install
    assert missing_part.kernel is None and "could not be loaded (ModuleNotFoundError" in missing_part.describe(CUDA, BF16)


def test_a_triton_that_fails_to_load_leaves_the_fallback_with_the_reason(monkeypatch, caplog):
    def broken(name, package=None):  # as a native library that does not load raises it on Windows
        raise ImportError("DLL load failed while importing libtriton: The specified module could not be found.")
    monkeypatch.setattr(triton_route.importlib, "import_module", broken)
    route = TritonRoute(".int8_kernel", "dequantized")
    assert route.kernel is None and not route.runs_on(CUDA, BF16)
    assert route.describe(CUDA, BF16).startswith("dequantized: Triton could not be loaded (ImportError: DLL load")
    assert "DLL load failed" in caplog.text


@pytest.fixture
def route():
    """The 4-bit kernel's route, its self-check left out (no GPU here to run it on)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    route = TritonRoute(".nf4_kernel", "bitsandbytes")
    route.self_checked = set()
    return route


def test_it_runs_on_a_cuda_gpu_from_compute_capability_8_0(route, monkeypatch):
    monkeypatch.setattr(triton_route, "_capability", lambda index: (8, 6))
    assert route.runs_on(CUDA, BF16) and route.describe(CUDA, BF16) == "fused kernel"
    assert not route.runs_on(CPU, FP16) and route.describe(CPU, FP16) == "bitsandbytes: no fused kernel on cpu"
    monkeypatch.setattr(triton_route, "_capability", lambda index: (7, 5))  # an RTX 20 card: no tensor cores in Triton
    assert not route.runs_on(CUDA, FP16) and not route.runs_on(CUDA, BF16)
    assert "compute capability (7, 5) below (8, 0)" in route.describe(CUDA, FP16)


def test_a_failure_on_a_device_type_keeps_the_fallback_there_with_the_reason(route, monkeypatch, caplog):
    monkeypatch.setattr(triton_route, "_capability", lambda index: (12, 0))
    route.fail(CUDA, RuntimeError("PTX .version 9.0 does not support .target sm_120"))
    assert not route.runs_on(CUDA, BF16) and not route.runs_on(torch.device("cuda", 1), FP16)
    assert "sm_120" in route.describe(CUDA, BF16) and "sm_120" in caplog.text


def self_checking(route, monkeypatch, capability, self_check):
    """`route` with its self-check on CUDA being `self_check`, on a GPU of `capability`, outside
    any CUDA graph capture."""
    monkeypatch.setattr(triton_route, "_capability", lambda index: capability)
    route.self_checked = {"cuda"}
    monkeypatch.setattr(route, "kernel", SimpleNamespace(self_check=self_check))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_the_self_check_runs_once_per_device_and_dtype_before_the_first_use(route, monkeypatch):
    checks = []
    self_checking(route, monkeypatch, (8, 9), lambda device, dtype: checks.append(dtype))
    for _ in range(3):
        assert route.runs_on(CUDA, BF16) and route.runs_on(CUDA, FP16)
    assert checks == [BF16, FP16]


def test_a_kernel_that_computes_wrongly_leaves_the_fallback_with_the_reason(route, monkeypatch):
    def wrong(device, dtype):
        raise RuntimeError("self-check: the 4-bit matmul kernel is off by 3.1")

    self_checking(route, monkeypatch, (12, 0), wrong)
    assert not route.runs_on(CUDA, BF16) and not route.runs_on(CUDA, FP16)
    assert route.describe(CUDA, BF16).startswith("bitsandbytes: the fused kernel failed (RuntimeError: self-check")


def test_asked_first_inside_a_cuda_graph_capture_the_fallback_is_taken_unchecked(route, monkeypatch):
    checks = []
    self_checking(route, monkeypatch, (8, 6), lambda device, dtype: checks.append(dtype))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not route.runs_on(CUDA, BF16) and checks == [] and not route.failed
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert route.runs_on(CUDA, BF16) and checks == [BF16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_both_kernels_pass_their_self_check_and_a_wrong_kernel_fails_it(dtype, monkeypatch):
    """In Triton's interpreter: the real kernels pass; one whose output is slightly off, or whose
    packing flips a code, does not."""
    int8_kernel = pytest.importorskip("specchat.core.kv.int8_kernel", reason="Triton is not installed")
    from specchat.core import nf4_kernel
    int8_kernel.self_check(CPU, dtype)
    nf4_kernel.self_check(CPU, dtype)
    attend, matmul, pack = int8_kernel.attend_packed, nf4_kernel.nf4_matmul, int8_kernel.pack_rows

    def off_attention(*args, **kwargs):
        out, lse = attend(*args, **kwargs)
        return out * 1.1, lse

    monkeypatch.setattr(int8_kernel, "attend_packed", off_attention)
    with pytest.raises(RuntimeError, match="attention kernel"):
        int8_kernel.self_check(CPU, dtype)
    monkeypatch.setattr(nf4_kernel, "nf4_matmul", lambda *args: matmul(*args) * 1.1)
    with pytest.raises(RuntimeError, match="4-bit matmul"):
        nf4_kernel.self_check(CPU, dtype)

    def flipped(states, rows, at):
        pack(states, rows, at)
        rows[0, at, 0] += 1

    monkeypatch.setattr(int8_kernel, "pack_rows", flipped)
    with pytest.raises(RuntimeError, match="packing kernel"):
        int8_kernel.self_check(CPU, dtype)
