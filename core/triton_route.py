"""Where one of this project's Triton kernels runs: a CUDA GPU of compute capability 8.0 or more
(RTX 30 series on) where Triton is installed and loads (PyTorch's CUDA wheels bring it on Linux;
on Windows the one-click installer adds triton-windows), once the kernel module's `self_check`
passed there for that dtype, and nowhere again on a device type where it once failed to build,
run or check, with the reason kept.
The caller then takes its fallback path. The self-check guards losslessness on GPUs and drivers
no test ran on: a kernel that builds but computes wrongly would change answers silently. Tests
add "cpu" to `devices`, where the kernel runs in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import functools
import importlib
import logging

import torch

# Triton (3.7-3.9) builds the kernels' dot products for an RTX 20 card (7.5) without tensor cores, as
# loops that spill registers (ptxas, tests/test_triton_compile.py's builds); bf16 needs 8.0 anyway.
MIN_CAPABILITY = (8, 0)


class TritonRoute:
    def __init__(self, kernel_module: str, fallback: str):
        self.kernel_module = kernel_module  # imported only when first needed: importing Triton takes seconds
        self.fallback = fallback  # what runs instead, in words
        self.devices = {"cuda"}
        self.failed: dict[str, str] = {}  # device type -> why the kernel did not run there
        self.self_checked = {"cuda"}  # device types where the kernel is checked before its first use
        self.checked: set[tuple[str, int | None, torch.dtype]] = set()
        self.unloadable = ""  # why an installed Triton did not load, if it did not

    @functools.cached_property
    def kernel(self):
        """The kernel's module, or None without a Triton that loads (`unloadable` says why)."""
        try:
            return importlib.import_module(self.kernel_module, __package__)
        except Exception as error:  # a broken install: a part or a native library that fails to load
            if isinstance(error, ModuleNotFoundError) and error.name == "triton":
                return None
            self.unloadable = f"Triton could not be loaded ({type(error).__name__}: {error})"
            logging.getLogger(__name__).warning("%s, %s instead", self.unloadable, self.fallback)
            return None

    def runs_on(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the kernel runs on `device` for inputs of `dtype`."""
        if device.type not in self.devices or device.type in self.failed or self.kernel is None:
            return False
        if device.type == "cuda" and _capability(device.index) < MIN_CAPABILITY:
            return False
        return self._checked(device, dtype)

    def _checked(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the kernel's self-check passed on `device` for `dtype`, running it the first
        time: at the first forward that asks, which is eager (a step is captured as a CUDA graph
        only once it ran eagerly); asked first inside a capture, the fallback is taken there."""
        key = (device.type, device.index, dtype)
        if device.type not in self.self_checked or key in self.checked:
            return True
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        try:
            self.kernel.self_check(device, dtype)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # fails to build or run, or computes wrongly
            self.fail(device, error)
            return False
        self.checked.add(key)
        return True

    def describe(self, device: torch.device, dtype: torch.dtype) -> str:
        """What runs on `device` for `dtype`, in words (the GPU campaign reports it)."""
        if self.runs_on(device, dtype):
            return "fused kernel"
        if device.type in self.failed:
            why = f"the fused kernel failed ({self.failed[device.type]})"
        elif self.kernel is None:
            why = self.unloadable or "Triton is not installed"
        elif device.type not in self.devices:
            why = f"no fused kernel on {device.type}"
        else:
            why = f"compute capability {_capability(device.index)} below {MIN_CAPABILITY}"
        return f"{self.fallback}: {why}"

    def fail(self, device: torch.device, error: Exception) -> None:
        """The kernel failed on `device`: its fallback runs there from now on."""
        self.failed[device.type] = f"{type(error).__name__}: {error}"
        logging.getLogger(__name__).warning("%s failed on %s, %s from now on (%s)", self.kernel_module,
                                            device.type, self.fallback, self.failed[device.type])


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
