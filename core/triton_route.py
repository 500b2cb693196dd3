"""Where one of this project's Triton kernels runs: a CUDA GPU of compute capability 7.5 or more
(tensor-core dot products) where Triton is installed (PyTorch's CUDA wheels bring it on Linux; on
Windows it is absent), and nowhere again on a device type where it once failed to build or run,
with the reason kept. The caller then takes its fallback path. Tests add "cpu" to `devices`, where
the kernel runs in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import functools
import importlib
import logging

import torch

MIN_CAPABILITY = (7, 5)
BF16_CAPABILITY = (8, 0)  # bf16 tensor cores: an RTX 20 card would fail to build a bf16 kernel


class TritonRoute:
    def __init__(self, kernel_module: str, fallback: str):
        self.kernel_module = kernel_module  # imported only when first needed: importing Triton takes seconds
        self.fallback = fallback  # what runs instead, in words
        self.devices = {"cuda"}
        self.failed: dict[str, str] = {}  # device type -> why the kernel did not run there

    @functools.cached_property
    def kernel(self):
        """The kernel's module, or None without Triton."""
        try:
            return importlib.import_module(self.kernel_module, __package__)
        except ImportError:
            return None

    def runs_on(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the kernel runs on `device` for inputs of `dtype`."""
        if device.type not in self.devices or device.type in self.failed or self.kernel is None:
            return False
        return device.type != "cuda" or _capability(device.index) >= self._needed(dtype)

    def describe(self, device: torch.device, dtype: torch.dtype) -> str:
        """What runs on `device` for `dtype`, in words (the GPU campaign reports it)."""
        if self.runs_on(device, dtype):
            return "fused kernel"
        if device.type in self.failed:
            why = f"the fused kernel failed ({self.failed[device.type]})"
        elif self.kernel is None:
            why = "Triton is not installed"
        elif device.type not in self.devices:
            why = f"no fused kernel on {device.type}"
        else:
            why = f"compute capability {_capability(device.index)} below {self._needed(dtype)} for {dtype}"
        return f"{self.fallback}: {why}"

    @staticmethod
    def _needed(dtype: torch.dtype) -> tuple[int, int]:
        return BF16_CAPABILITY if dtype == torch.bfloat16 else MIN_CAPABILITY

    def fail(self, device: torch.device, error: Exception) -> None:
        """The kernel failed on `device`: its fallback runs there from now on."""
        self.failed[device.type] = f"{type(error).__name__}: {error}"
        logging.getLogger(__name__).warning("%s failed on %s, %s from now on (%s)", self.kernel_module,
                                            device.type, self.fallback, self.failed[device.type])


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
