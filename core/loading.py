"""Model ids -> a loaded `Engine`: a pair from the registry (the embedded model, or a Hub pair
downloaded on first use) or a local transformers directory."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from . import embedded
from .download import ProgressCallback, download_pair
from .engine import Engine
from .errors import ModelUnavailable, first_line
from .kv.document_store import DocumentStore
from .kv.prefix_store import PrefixStore
from .model import TransformersLM
from .placement import LoadOptions, draft_options, offload_capacity, target_options
from .registry import Registry, UnknownPair, load_registry

DOCUMENT_CACHE_BYTES = 8 * 10**9  # disk for saved document caches, least recently used dropped first


def load_engine(model_id: str = "embedded", progress: Callable[[str], None] = print,
                registry: Registry | None = None, download_progress: ProgressCallback | None = None) -> Engine:
    """Load a pair id from the registry, or a local directory with a config.json.

    A Hub pair is downloaded first if it is not in the cache (offline, a missing file is an error
    that names it); its draft must share the target's tokenizer.
    """
    registry = registry or load_registry()
    if model_id not in registry.pairs:
        path = Path(model_id)
        if (path / "config.json").is_file():
            return _load(path, model_id, f"{path.resolve()}@{_newest_weights(path)}")
        if path.exists():
            raise ModelUnavailable(f"no model at {model_id!r}: a model directory needs a config.json")
        if "/" in model_id or os.sep in model_id:
            raise ModelUnavailable(f"no model at {model_id!r}: no such directory (registry pairs go by id: "
                                   f"{', '.join(sorted(registry.pairs))})")
        raise UnknownPair(f"{registry.unknown_message(model_id)}, or give a local model directory")
    pair = registry.get(model_id)
    plan = _plan(pair, registry)
    options = target_options(plan, pair.target)
    if pair.source == "embedded":
        engine = _load(embedded.ensure_converted(progress), embedded.EMBEDDED_ID,
                       f"{embedded.EMBEDDED_ID}@conversion-{embedded.CONVERSION_VERSION}", options)
        return _follow_plan(engine, plan)
    progress(f"Checking {pair.name}...")
    paths = download_pair(pair, download_progress)
    progress(f"Loading {pair.target.repo}...")
    engine = _load(paths["target"], pair.id, f"{pair.target.repo}@{pair.target.revision}", options)
    draft = draft_options(plan)
    if "draft" in paths and draft is not None:
        progress(f"Loading the draft {pair.draft.repo}...")
        _attach_draft(engine, paths["draft"], pair.draft.repo, draft)
    return _follow_plan(engine, plan)


def _plan(pair, registry: Registry):
    """The plan for this machine at the pair's full context. A pair that fits nowhere is refused
    here, before any download, with the plan's reason and the nearest requests that fit
    (`PlanRefused`, an input error: exit code 2), never loaded in whatever precision happens to
    work."""
    from .hardware import load_or_probe
    from .plan import make_plan

    return make_plan(load_or_probe(), pair, pair.context_length, registry=registry)


def _follow_plan(engine: Engine, plan) -> Engine:
    """What the plan decides beyond loading: where the full KV lives, what `--mode auto` runs,
    and TriForce's budgets."""
    from .decoding import TriforceSettings

    engine.plan, engine.auto_mode = plan, plan.mode
    capacity = offload_capacity(plan)
    if capacity is not None:
        # An offloaded cache is pinned memory the size of the whole context: one conversation at a
        # time, so no kept prefixes or saved documents (which copy caches) for now.
        engine.model.offload_capacity = capacity
        engine.prefixes, engine.documents = PrefixStore(0), None
    if plan.mode == "triforce":
        gamma2 = plan.gamma2 or TriforceSettings.gamma2
        engine.triforce = TriforceSettings(
            draft="pair" if engine.draft is not None else "lookup",
            gamma1=plan.gamma1 or TriforceSettings.gamma1, gamma2=gamma2,
            budget=plan.retrieval_budget, chunk_size=plan.retrieval_chunk,
            # With the KV offloaded a rebuild streams every layer once more (scoring reads all
            # keys), so it waits for a few verifications' worth of tokens instead of one.
            stride=TriforceSettings.stride if capacity is None else 4 * gamma2,
            sinks=plan.draft_sinks or TriforceSettings.sinks, window=plan.draft_window or TriforceSettings.window)
    return engine


def _load(path: Path, name: str, weights_key: str, options: LoadOptions | None = None) -> Engine:
    """`weights_key` names these exact weights; with the dtype it keys saved document caches."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = TransformersLM.from_pretrained(path, options)
    except (OSError, ValueError) as error:
        raise ModelUnavailable(f"cannot load the model at {path}: {first_line(error) or type(error).__name__}") from None
    documents = DocumentStore(embedded.cache_root() / "documents", f"{weights_key}:{model.hf.dtype}",
                              DOCUMENT_CACHE_BYTES)
    return Engine(model, tokenizer, name, documents=documents)


def _newest_weights(path: Path) -> int:
    """A local model changes when its weights do: their newest modification time."""
    return max((int(file.stat().st_mtime) for file in path.glob("*.safetensors")), default=0)


def _attach_draft(engine: Engine, path: Path, name: str, options: LoadOptions | None = None) -> None:
    """Load the draft, padded to the target's logits width (some pairs pad their embeddings
    differently), after checking that it tokenizes exactly as the target does."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.get_vocab() != engine.tokenizer.get_vocab():
            raise ModelUnavailable(f"the draft {name} does not share the target's tokenizer: not a speculation pair")
        draft = TransformersLM.from_pretrained(path, options, vocab_size=engine.model.vocab_size)
    except (OSError, ValueError) as error:
        raise ModelUnavailable(f"cannot load the draft at {path}: {first_line(error) or type(error).__name__}") from None
    engine.draft, engine.draft_name = draft, name
