"""Linear layers for few-token forwards on the CPU: `F.linear`, or the same product weight-first.

On the CPU, `F.linear` sends a thin input to one of two kernels: a single row to a matrix-vector
product, 2-8 rows to a GEMM that packs the weight matrix first. Multiplying the other way round,
weight @ input^T, reads each weight once as a wide GEMM; 1 or 3 rows go in with the last one
repeated, as MKL's products over an even number of columns were the fast ones, and the output is
made contiguous, as the next layer's product is slow on a transposed view.

Which is faster depends on the CPU and its BLAS, not on this code: on the 2-core machine where
weight-first was written (bench/2026-11-23-cpu-few-row-linear.json) a one-token forward took
0.57-0.70x its `F.linear` time; on another machine of the same kind it took 1.6-1.8x, and 2-8
rows were 1.4-1.8x slower too (issue 42). So each row count's path is measured per machine and
model (linear_choice.py) and installed here; beyond FEW_ROWS rows the packed GEMM is always used.

The two paths sum in a different order, so their results agree to rounding, not bit for bit: the
choice is made once, when the model is loaded, and kept for the model's life (never switched in
the middle of an answer); lossless speculation compares the target with itself, so it holds
under either choice.
"""

from __future__ import annotations

import torch

FEW_ROWS = 8  # the most rows that may go weight-first
PADDED = {1: 2, 3: 4}  # rows that multiplied faster with their last row repeated (even column counts)


def weight_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as weight @ x^T."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if rows in PADDED:  # a copy: a stride-0 view would be slow again
        flat = torch.cat([flat, flat[-1:].expand(PADDED[rows] - rows, -1)])
    out = (weight @ flat.T)[:, :rows].T.contiguous()  # a transposed view makes the next layer slow
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class FewRowLinear(torch.nn.Linear):
    """`nn.Linear` whose inputs of `weight_first_rows` rows multiply weight-first."""

    weight_first_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] in self.weight_first_rows:
            return weight_first(x, self.weight, self.bias)
        return super().forward(x)


def cpu_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The plain fp32 linear layers of `model` on the CPU, switched or not: those the choice is
    for (quantized and GPU layers, and other dtypes, have kernels of their own)."""
    return [module for module in model.modules()
            if type(module) in (torch.nn.Linear, FewRowLinear) and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32]


def use_few_row_linear(model: torch.nn.Module, rows: frozenset[int] | set[int]) -> int:
    """Send inputs of `rows` rows weight-first in the plain fp32 CPU linears of `model`; with no
    rows they are all plain `nn.Linear` again. Returns how many layers take weight-first."""
    layers = cpu_linears(model)
    for module in layers:
        if rows:
            module.__class__ = FewRowLinear
            module.weight_first_rows = frozenset(rows)
        elif type(module) is FewRowLinear:
            module.__class__ = torch.nn.Linear
            del module.weight_first_rows
    return len(layers) if rows else 0
