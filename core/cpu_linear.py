"""Linear layers for few-token forwards on the CPU.

On the CPU, `F.linear` sends a thin input to one of two slow paths: a single row to a
matrix-vector product that streams the weights at about half the rate the 2-column product
does, and 2-8 rows to a GEMM that packs the whole weight matrix first (a 2-token forward of
SmolLM2-135M took 1.6x a 1-token one). Multiplying the other way round, weight @ input^T, reads
each weight once at full speed; 1 or 3 rows go in with the last one repeated, as MKL's products
over an even number of columns are the fast ones, and the output is made contiguous, as the next
layer's product is slow on a transposed view. Measured on this project's 2-core machine
(bench/2026-11-23-cpu-few-row-linear.json): a one-token forward takes 0.57-0.70x its time
through `F.linear` (greedy plain decoding 1.5x as fast), 5-8-token verifications 0.74-0.83x
their time before this change. Beyond 8 rows the packed GEMM is as fast.
"""

from __future__ import annotations

import torch

FEW_ROWS = 8  # the most rows that go weight-first
PADDED = {1: 2, 3: 4}  # rows that multiply faster with their last row repeated (even column counts)


class FewRowLinear(torch.nn.Linear):
    """`nn.Linear` whose 1..FEW_ROWS-row inputs multiply weight-first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > FEW_ROWS:
            return super().forward(x)
        flat = x.reshape(rows, x.shape[-1])
        if rows in PADDED:  # a copy: a stride-0 view would be slow again
            flat = torch.cat([flat, flat[-1:].expand(PADDED[rows] - rows, -1)])
        out = (self.weight @ flat.T)[:, :rows].T.contiguous()  # a transposed view makes the next layer slow
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
