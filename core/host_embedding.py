"""The input embedding kept in CPU memory while the rest of the model runs on a GPU.

Why: Llama-3.1-8B's embedding table is 1 GB in bf16, an eighth of an 8 GB card, yet a forward
reads one row of it per token. Looking the rows up on the CPU and sending hidden_size values per
token across the link costs microseconds, and frees that gigabyte for the caches (the plan puts it
there only when nothing else fits). The output head is a matmul over the whole table and stays on
the GPU.
"""

from __future__ import annotations

import torch


class HostEmbedding(torch.nn.Module):
    """Wraps the model's embedding module (its own scaling, as Gemma's, included)."""

    def __init__(self, embedding: torch.nn.Module, compute_device: torch.device):
        super().__init__()
        _drop_dispatch_hook(embedding)
        self.inner = embedding.to("cpu")
        self.compute_device = compute_device

    @property
    def weight(self) -> torch.Tensor:  # what transformers reads off an input embedding
        return self.inner.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids.to("cpu")).to(self.compute_device, non_blocking=True)


def compute_device(hf_model) -> torch.device:
    """Where a forward runs: the first decoder layer's device (the embedding may be on the CPU)."""
    return next(hf_model.base_model.layers[0].parameters()).device


def embedding_on_cpu(hf_model) -> None:
    """Move `hf_model`'s input embedding to the CPU, the rest staying where it is; not where the
    output head shares its weight, as the head must stay with the layers."""
    embedding, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    if head is None or head.weight is not embedding.weight:
        hf_model.set_input_embeddings(HostEmbedding(embedding, compute_device(hf_model)))


def _drop_dispatch_hook(module: torch.nn.Module) -> None:
    """A model split over devices by accelerate moves each module's inputs to the module's
    device; this one's inputs must stay on the CPU."""
    if hasattr(module, "_hf_hook"):
        from accelerate.hooks import remove_hook_from_module

        remove_hook_from_module(module)
