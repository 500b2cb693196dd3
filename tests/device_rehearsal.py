"""A GPU rehearsed on the CPU, for the code that handles logits (sampling, verification, drafting).

`OnDevice` tensors stand for tensors on a GPU: they say they are on `FAKE_GPU` (a CPU device with
an index, so every operation still runs on the CPU), stay `OnDevice` through every operation, and
log what a GPU would make costly or refuse:
- `reads`: each read on the host (and each operation that waits for the device), with its size;
- `mixed`: each operation that mixes them with a host tensor of one element or more (CUDA raises
  there; only the indices of `t[index]` may stay on the host).
Tensors the logits-handling modules create on `FAKE_GPU` (by a factory's `device=` or `.to`) are
`OnDevice` too; the caches, whose devices these modules only pass on, are left alone.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.utils._pytree import tree_flatten

FAKE_GPU = torch.device("cpu", 7)
HOST_READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu", "nonzero"}
INDEXING = {"__getitem__", "__setitem__"}  # CUDA takes host index tensors there
LOGITS_MODULES = {f"specchat.core.{name}" for name in (
    "sampling", "decoding", "acceptance", "speculative.verify", "speculative.types", "speculative.drafters",
    "speculative.tree_drafters", "speculative.hierarchy", "speculative.dsi.orchestrator")}
_DEVICE = torch._C.TensorBase.__dict__["device"]
FACTORIES = ("rand", "zeros", "ones", "full", "empty", "arange", "tensor")


class OnDevice(torch.Tensor):
    reads: list[tuple[str, int]] = []
    mixed: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE:
            return FAKE_GPU
        name = getattr(func, "__name__", "")
        if name in HOST_READS and isinstance(args[0], OnDevice):  # nonzero waits; its output stays
            cls.reads.append((name, 1 if name == "nonzero" else args[0].numel()))
        checked = (args[:1] + args[2:]) if name in INDEXING else args
        tensors = [x for x in tree_flatten((checked, kwargs))[0] if isinstance(x, torch.Tensor)]
        if any(isinstance(x, OnDevice) for x in tensors) and any(
                not isinstance(x, OnDevice) and x.dim() > 0 for x in tensors):
            cls.mixed.append(f"{name} from {_caller()}")
        result = super().__torch_function__(func, types, args, kwargs)
        if name == "cpu" or name == "to" and _target(args[1:], kwargs) == torch.device("cpu"):
            return result.as_subclass(torch.Tensor)  # on the host now
        return result


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(OnDevice)


class LogitsOnDevice:
    """A model as if on a GPU: its logits are `OnDevice` (a draft made from it too), its device
    `FAKE_GPU`; its weights and caches stay what they are."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    @property
    def device(self) -> torch.device:
        return FAKE_GPU

    def forward(self, *args, **kwargs):
        return on_device(self.model.forward(*args, **kwargs))

    def forward_with_queries(self, *args, **kwargs):
        logits, queries = self.model.forward_with_queries(*args, **kwargs)
        return on_device(logits), queries

    def truncated(self, num_layers):
        return LogitsOnDevice(self.model.truncated(num_layers))


@contextlib.contextmanager
def rehearsed():
    """While inside: tensors made on `FAKE_GPU` by the logits modules are `OnDevice`; the logs
    start empty."""
    OnDevice.reads, OnDevice.mixed = [], []
    originals = {name: getattr(torch, name) for name in FACTORIES}
    original_to = torch.Tensor.to

    def factory(make):
        def made(*args, **kwargs):
            out = make(*args, **kwargs)
            wanted = kwargs.get("device")
            on_gpu = wanted is not None and torch.device(wanted) == FAKE_GPU and _caller() in LOGITS_MODULES
            return on_device(out) if on_gpu else out
        return made

    def to(self, *args, **kwargs):
        out = original_to(self, *args, **kwargs)
        moved = _target(args, kwargs) == FAKE_GPU and _caller() in LOGITS_MODULES
        return on_device(out) if moved and not isinstance(out, OnDevice) else out

    try:
        for name, make in originals.items():
            setattr(torch, name, factory(make))
        torch.Tensor.to = to
        yield OnDevice
    finally:
        for name, make in originals.items():
            setattr(torch, name, make)
        torch.Tensor.to = original_to


def _target(args, kwargs) -> torch.device | None:
    """The device a `.to(...)` call moves to, if it names one."""
    for value in (*args, kwargs.get("device")):
        if isinstance(value, (str, torch.device)):
            return torch.device(value)
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _caller() -> str:
    """The module of the nearest frame outside torch and this file."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != __name__ and not module.startswith("torch"):
            return module
        frame = frame.f_back
    return ""
