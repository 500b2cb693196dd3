"""The narrow model interface the engine speaks, and its adapter over transformers causal LMs.

Everything above this file sees `forward(ids, positions, cache, mask) -> logits` and nothing of
transformers, so drafters, verifiers and tests can swap in any model (tiny random ones included).
"""

from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from .env_settings import env_switch
from .errors import ModelUnavailable
from .hardware import cap_cuda_allocator
from .host_embedding import compute_device, embedding_on_cpu
from .kv.cache import KVCache
from .kv.full import FullCache
from .kv.int8 import Int8Cache
from .kv.offload import OffloadedCache
from .kv.queries import ATTENTION, new_tokens_see_the_past, record_queries
from .linear_choice import choose_cpu_linear
from .nf4_linear import use_fused_nf4
from .step_graphs import StepGraphs

if TYPE_CHECKING:
    from .placement import LoadOptions

# With grouped-query attention, transformers' SDPA path copies every layer's whole KV
# (`repeat_kv`) for multi-token forwards unless SDPA's own GQA is forced: measured 5x slower
# verification at 8K context on CPU, identical logits. Read at call time, so setting it here works.
os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


class CausalLM(Protocol):
    """What the engine, the caches and the decoders may know of a model: nothing reaches past it
    into transformers (the `.hf` module stays inside this file)."""

    vocab_size: int  # logits width; may exceed the tokenizer's vocabulary (padded embeddings)
    context_length: int  # most positions the model was trained for
    eos_token_ids: tuple[int, ...]  # the ids that end a turn
    num_layers: int
    device: torch.device  # where a forward computes (its first layers' device)
    dtype: torch.dtype  # the compute dtype of its weights
    config: object  # the transformers config: the shapes a cache is built from

    def new_cache(self) -> KVCache: ...

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Run `ids` [n] at `positions` [n] after what `cache` holds, appending their KV.

        `mask` (optional) is a 4-D attention mask [1, 1, n, cache.length + n]; without it the
        new tokens attend causally. Returns fp32 logits [n, vocab_size] ([1, vocab_size] when
        `last_only`, which spares the vocabulary projection during prefill) on `device`: warping,
        sampling and verification run there (core/sampling.py), nothing vocabulary-wide crosses
        to the host.
        """
        ...

    def forward_with_queries(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                             mask: torch.Tensor | None = None, last_only: bool = False
                             ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`forward`, and each layer's queries after RoPE, {layer: [1, heads, n, head_dim]}: the
        retrieval cache scores its chunks with them (kv/retrieval.py)."""
        ...


def require_bitsandbytes(quantization: str) -> None:
    """`ModelUnavailable` naming what to install when a plan's quantized weights need bitsandbytes
    and it is missing (checked before a download; transformers would fail deep in the load)."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        bits = "4-bit" if quantization == "nf4" else "8-bit"
        raise ModelUnavailable(f"this plan keeps the weights in {bits} with bitsandbytes, which is not installed: "
                               "`pip install bitsandbytes` (the installers add it with an NVIDIA GPU), or choose "
                               "a smaller pair or a shorter --context")


def _bitsandbytes(quantization: str, compute_dtype: torch.dtype, quantize_head: bool):
    from transformers import BitsAndBytesConfig

    require_bitsandbytes(quantization)

    # bitsandbytes skips the output head unless given its own (here empty) list of modules to skip.
    skip = [] if quantize_head else None
    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                                  llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)


class TransformersLM:
    """A transformers causal LM (batch of one) behind the `CausalLM` interface."""

    def __init__(self, hf_model, vocab_size: int | None = None, offload_capacity: int | None = None,
                 kv_dtype: str | None = None, cache_positions: int | None = None, resident_layers: int = 0):
        self.hf = hf_model.eval()
        # SDPA that can also record queries, which the retrieval cache scores with (kv/queries.py).
        self.hf.set_attn_implementation(ATTENTION)
        # This CPU's faster path for few-token forwards, measured once per machine and model
        # (linear_choice.py); fixed for the model's life, so never changes in mid-answer.
        choose_cpu_linear(self.hf)
        # A verification's few tokens through 4-bit layers in one kernel, where Triton runs (nf4_linear.py).
        use_fused_nf4(self.hf)
        config = hf_model.config
        own_width = hf_model.get_output_embeddings().out_features  # a quantized head's weight is packed
        # A draft whose embeddings are padded less than its target's answers with the target's
        # width; the extra ids get probability zero.
        self.vocab_size = max(own_width, vocab_size or 0)
        self._pad = self.vocab_size - own_width
        self.context_length = int(config.max_position_embeddings)
        eos = getattr(hf_model.generation_config, "eos_token_id", None)
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        # Positions of full KV kept in (pinned) CPU memory and streamed per layer; None: on the device.
        self.offload_capacity = offload_capacity
        # Of an offloaded KV, the layers whose KV stays on the GPU (kv/offload.py: a partial offload).
        self.resident_layers = resident_layers
        # None: the KV in the compute dtype; "int8": 8-bit codes with a scale per token and KV head.
        if kv_dtype not in (None, "int8"):
            raise ValueError(f"kv_dtype must be None or 'int8', got {kv_dtype!r}")
        self.kv_dtype = kv_dtype
        # The plan's context: the KV grows in steps of 25% and must not reserve room past it.
        self.cache_positions = cache_positions
        if kv_dtype == "int8":
            Int8Cache(config, self.hf.dtype)  # a model it cannot serve fails at load, not at its first answer
        # transformers 5.24 renamed `past_key_values` to `cache` and warns on every forward with
        # the old name (a line per token); older 5.x knows only the old name.
        forward_parameters = inspect.signature(self.hf.forward).parameters
        self._cache_argument = "cache" if "cache" in forward_parameters else "past_key_values"
        self._graphs: StepGraphs | None = None
        self._graphs_wanted: bool | None = None  # decided at the first forward, where the weights are then

    @classmethod
    def from_pretrained(cls, path: Path | str, options: LoadOptions | None = None,
                        vocab_size: int | None = None) -> "TransformersLM":
        """fp32 on the CPU by default; `options` (from the plan) set dtype, devices, bitsandbytes
        quantization, rope scaling and where and in what precision the KV is kept."""
        from transformers import AutoConfig, AutoModelForCausalLM

        kwargs = {"dtype": torch.float32, "attn_implementation": "sdpa", "use_safetensors": True}
        if options is not None:
            kwargs["dtype"] = getattr(torch, options.dtype)
            if options.device_map != "cpu":
                kwargs["device_map"] = options.device_map
            if options.quantization is not None:
                kwargs["quantization_config"] = _bitsandbytes(options.quantization, kwargs["dtype"], options.quantize_head)
            if options.rope_scaling is not None:
                config = AutoConfig.from_pretrained(path)
                config.rope_parameters = {**(config.rope_parameters or {}), **options.rope_scaling}
                config.max_position_embeddings = int(
                    options.rope_scaling["original_max_position_embeddings"] * options.rope_scaling["factor"])
                kwargs["config"] = config
        cap_cuda_allocator(dict(options.allocator_caps) if options is not None else None)
        hf_model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if options is not None and options.embedding_on_cpu:
            embedding_on_cpu(hf_model)
        if options is None:
            return cls(hf_model, vocab_size)
        return cls(hf_model, vocab_size, options.offload_capacity, options.kv_dtype, options.cache_positions,
                   options.resident_layers)

    def truncated(self, num_layers: int) -> "TransformersLM":
        """A layer-skip self-draft: the first `num_layers` decoder layers, then the final norm and
        LM head, sharing this model's weights (nothing is copied), with its own `new_cache`.

        Why: on a CPU a draft step costs about its weight reads plus fixed per-forward overhead,
        so the target's own first layers are the cheapest draft there is, with the same tokenizer
        and no second model to load or keep in memory.
        """
        base = self.hf.base_model
        total = len(base.layers)
        if not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be between 1 and {total}, got {num_layers}")
        config = copy.deepcopy(self.hf.config)  # sizes the draft's cache; the layers loop reads it
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[:num_layers]
        # Shallow copies with their own submodule tables: replacing `layers` or `config` on them
        # leaves this model untouched, while every parameter and buffer stays shared.
        hf, short_base = copy.copy(self.hf), copy.copy(base)
        hf._modules, short_base._modules = dict(self.hf._modules), dict(base._modules)
        short_base.layers = torch.nn.ModuleList(base.layers[:num_layers])
        hf.config = short_base.config = config
        setattr(hf, self.hf.base_model_prefix, short_base)
        draft = TransformersLM(hf, self.vocab_size)
        if self._graphs is not None:  # replays as the target does (the CPU rehearsal included)
            draft.set_step_graphs(self._graphs.capture)
        return draft

    @property
    def num_layers(self) -> int:
        return len(self.hf.base_model.layers)

    @property
    def device(self) -> torch.device:
        return compute_device(self.hf)

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype

    @property
    def config(self):
        return self.hf.config

    @property
    def decoder_layers(self) -> torch.nn.ModuleList:
        """The decoder layers in order, for hooks that run between them (core/interrupt.py)."""
        return self.hf.base_model.layers

    def to(self, device: str | torch.device) -> "TransformersLM":
        """Move every weight to `device` (tests and the self-test; loading places weights itself)."""
        self.hf.to(device)
        self._graphs = self._graphs_wanted = None  # decided again where the weights now are
        return self

    def new_cache(self) -> FullCache | OffloadedCache:
        int8 = self.kv_dtype == "int8"
        if self.offload_capacity is not None:
            return OffloadedCache(self.hf.config, self.offload_capacity, self.device, self.hf.dtype, int8=int8,
                                  resident_layers=self.resident_layers)
        if int8:
            return Int8Cache(self.hf.config, self.hf.dtype, self.cache_positions)
        return FullCache(self.hf.config, self.cache_positions)

    @torch.inference_mode()
    def forward(self, ids, positions, cache, mask=None, last_only=False):
        def eager() -> torch.Tensor:
            device_mask = None if mask is None else mask.to(self.device, self.hf.dtype)
            with new_tokens_see_the_past(device_mask, len(ids)):
                out = self.hf(
                    input_ids=ids[None].to(self.hf.get_input_embeddings().weight.device),
                    position_ids=positions[None].to(self.device),
                    attention_mask=device_mask,
                    use_cache=True,
                    **{self._cache_argument: cache.transformers_cache},
                    logits_to_keep=1 if last_only else 0,
                )
            return out.logits[0]

        graphs = self.step_graphs
        replayed = None if graphs is None or last_only else graphs.forward(ids, positions, cache, mask, eager)
        logits = (eager() if replayed is None else replayed).float()
        return torch.nn.functional.pad(logits, (0, self._pad), value=-torch.inf) if self._pad else logits

    @property
    def step_graphs(self) -> StepGraphs | None:
        """Decode steps replayed as CUDA graphs (step_graphs.py), made at the first forward on a
        GPU; None on the CPU or with `SPECCHAT_CUDA_GRAPHS=off`. `set_step_graphs` sets it."""
        if self._graphs is None and self._graphs_wanted is None:
            self._graphs_wanted = (self.device.type == "cuda"
                                   and env_switch("SPECCHAT_CUDA_GRAPHS", True))
            if self._graphs_wanted:
                self._graphs = StepGraphs(self.hf, self._cache_argument, capture=True)
        return self._graphs

    def set_step_graphs(self, capture: bool | None) -> StepGraphs | None:
        """From now on, steps captured and replayed on a GPU (`capture` True), the same static path
        run eagerly as the CPU rehearses it (False), or every forward eager (None)."""
        self._graphs_wanted = capture is not None
        self._graphs = None if capture is None else StepGraphs(self.hf, self._cache_argument, capture)
        return self._graphs

    def forward_with_queries(self, ids, positions, cache, mask=None, last_only=False):
        # transformers keeps the queries inside its attention call: kv/queries.py's attention
        # records them while asked, for this forward only.
        with record_queries() as queries:
            logits = self.forward(ids, positions, cache, mask, last_only)
        return logits, dict(queries)
