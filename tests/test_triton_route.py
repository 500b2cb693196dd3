"""Where a Triton kernel runs (core/triton_route.py), and what says why it does not."""

import pytest
import torch

from specchat.core import triton_route
from specchat.core.triton_route import TritonRoute

CUDA, CPU, BF16, FP16 = torch.device("cuda", 0), torch.device("cpu"), torch.bfloat16, torch.float16


def test_without_its_module_nothing_runs_and_the_fallback_says_why():
    route = TritonRoute(".no_such_kernel", "bitsandbytes")
    assert route.kernel is None and not route.runs_on(CUDA, BF16)
    assert route.describe(CUDA, BF16) == "bitsandbytes: Triton is not installed"


@pytest.fixture
def route():
    pytest.importorskip("triton", reason="Triton is not installed")
    return TritonRoute(".nf4_kernel", "bitsandbytes")


def test_it_runs_on_a_cuda_gpu_from_compute_capability_7_5_and_bf16_from_8_0(route, monkeypatch):
    monkeypatch.setattr(triton_route, "_capability", lambda index: (8, 6))
    assert route.runs_on(CUDA, BF16) and route.describe(CUDA, BF16) == "fused kernel"
    assert not route.runs_on(CPU, FP16) and route.describe(CPU, FP16) == "bitsandbytes: no fused kernel on cpu"
    monkeypatch.setattr(triton_route, "_capability", lambda index: (7, 5))  # an RTX 20 card: no bf16 tensor cores
    assert route.runs_on(CUDA, FP16) and not route.runs_on(CUDA, BF16)
    assert "compute capability (7, 5) below (8, 0) for torch.bfloat16" in route.describe(CUDA, BF16)
    monkeypatch.setattr(triton_route, "_capability", lambda index: (7, 0))
    assert not route.runs_on(CUDA, FP16) and "below (7, 5)" in route.describe(CUDA, FP16)


def test_a_failure_on_a_device_type_keeps_the_fallback_there_with_the_reason(route, monkeypatch, caplog):
    monkeypatch.setattr(triton_route, "_capability", lambda index: (12, 0))
    route.fail(CUDA, RuntimeError("PTX .version 9.0 does not support .target sm_120"))
    assert not route.runs_on(CUDA, BF16) and not route.runs_on(torch.device("cuda", 1), FP16)
    assert "sm_120" in route.describe(CUDA, BF16) and "sm_120" in caplog.text
