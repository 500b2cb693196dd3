"""Where a Triton kernel runs (core/triton_route.py), and what says why it does not."""

import pytest
import torch

from specchat.core import triton_route
from specchat.core.triton_route import TritonRoute

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_without_its_module_nothing_runs_and_the_fallback_says_why():
    route = TritonRoute(".no_such_kernel", "bitsandbytes")
    assert route.kernel is None and not route.runs_on(CUDA)
    assert route.describe(CUDA) == "bitsandbytes: Triton is not installed"


@pytest.fixture
def route():
    pytest.importorskip("triton", reason="Triton is not installed")
    return TritonRoute(".nf4_kernel", "bitsandbytes")


def test_it_runs_on_a_cuda_gpu_from_compute_capability_7_5(route, monkeypatch):
    monkeypatch.setattr(triton_route, "_capability", lambda index: (8, 6))
    assert route.runs_on(CUDA) and route.describe(CUDA) == "fused kernel"
    assert not route.runs_on(CPU) and route.describe(CPU) == "bitsandbytes: no fused kernel on cpu"
    monkeypatch.setattr(triton_route, "_capability", lambda index: (7, 0))
    assert not route.runs_on(CUDA) and "compute capability (7, 0) below (7, 5)" in route.describe(CUDA)


def test_a_failure_on_a_device_type_keeps_the_fallback_there_with_the_reason(route, monkeypatch, caplog):
    monkeypatch.setattr(triton_route, "_capability", lambda index: (12, 0))
    route.fail(CUDA, RuntimeError("PTX .version 9.0 does not support .target sm_120"))
    assert not route.runs_on(CUDA) and not route.runs_on(torch.device("cuda", 1))
    assert "sm_120" in route.describe(CUDA) and "sm_120" in caplog.text
