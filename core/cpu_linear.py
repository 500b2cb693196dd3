"""Linear layers for few-token forwards on the CPU.

A speculative verification runs 2-5 tokens through the model. On the CPU, `F.linear` sends such
a thin input to a GEMM that packs the whole weight matrix first, so a 2-token forward of
SmolLM2-135M took 1.6x a 1-token one (measured at 2K context on this project's 2-core machine,
bench/2026-11-23-cpu-few-row-linear.json). Multiplying the other way round, weight @ input^T,
reads each weight once, as the 1-token path does: 2-4 tokens then cost about one token. Beyond
4 rows the packed GEMM wins again.
"""

from __future__ import annotations

import torch

FEW_ROWS = 4  # the most rows that go weight-first (measured: 5-16 rows are faster packed)


class FewRowLinear(torch.nn.Linear):
    """`nn.Linear` whose 2..FEW_ROWS-row inputs multiply weight-first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if not 1 < rows <= FEW_ROWS:
            return super().forward(x)
        out = (self.weight @ x.reshape(rows, x.shape[-1]).T).T
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def use_few_row_linear(model: torch.nn.Module) -> int:
    """Switch the plain fp32 `nn.Linear` layers of a CPU model to `FewRowLinear` (quantized and
    GPU layers are left alone); returns how many were switched."""
    switched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu" \
                and module.weight.dtype == torch.float32:
            module.__class__ = FewRowLinear
            switched += 1
    return switched
