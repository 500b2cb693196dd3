"""Model ids -> a loaded `Engine`: a pair from the registry (the embedded model, or a Hub pair
downloaded on first use) or a local transformers directory."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from . import embedded
from .download import ProgressCallback, download_pair
from .speculative.dsi.pool import TargetLoader
from .engine import Engine
from .hardware import curve_key
from .runtime import EngineSettings, settings_from_plan
from .step_calibration import IdleCalibration, calibrated_step_times, saved_step_times
from .errors import InputError, ModelUnavailable, first_line
from .kv.document_store import DocumentStore
from .memory_release import release_cached_memory
from .model import TransformersLM, require_bitsandbytes
from .placement import LoadOptions, draft_options, target_options
from .registry import Registry, UnknownPair, load_registry

DOCUMENT_CACHE_BYTES = 8 * 10**9  # disk for saved document caches, least recently used dropped first


def load_engine(model_id: str = "embedded", progress: Callable[[str], None] = print,
                registry: Registry | None = None, download_progress: ProgressCallback | None = None,
                context: int | None = None, calibrate_when_idle: bool = False) -> Engine:
    """Load a pair id from the registry, or a local directory with a config.json.

    A Hub pair is downloaded first if it is not in the cache (offline, a missing file is an error
    that names it); its draft must share the target's tokenizer. The first load on a machine
    calibrates the target's step times (step_calibration.py) before it returns, or, with
    `calibrate_when_idle`, leaves that to `engine.idle_calibration`. A pair is planned, and then reads,
    at `context` tokens (default: its full context): a shorter one may fit where the full does not.
    What a model dropped before held is given back first, so the plan sees it free.
    """
    release_cached_memory()
    registry = registry or load_registry()
    if context is not None and model_id not in registry.pairs:
        raise InputError(f"--context applies to a pair of `specchat models list` (it sets the context its plan "
                         f"is made for); the model directory {model_id!r} reads its own full context")
    if model_id not in registry.pairs:
        path = Path(model_id)
        if (path / "config.json").is_file():
            return _load(path, model_id, f"{path.resolve()}@{_newest_weights(path)}", progress, calibrate_when_idle)
        if path.exists():
            raise ModelUnavailable(f"no model at {model_id!r}: a model directory needs a config.json")
        if "/" in model_id or os.sep in model_id:
            raise ModelUnavailable(f"no model at {model_id!r}: no such directory (registry pairs go by id: "
                                   f"{', '.join(sorted(registry.pairs))})")
        raise UnknownPair(f"{registry.unknown_message(model_id)}, or give a local model directory")
    pair = registry.get(model_id)
    if context is not None and context > pair.context_length:
        raise InputError(f"--context {context:,}: {pair.id} reads at most {pair.context_length:,} tokens")
    plan = _plan(pair, registry, context or pair.context_length)
    options = target_options(plan, pair.target)
    if options.quantization is not None:
        require_bitsandbytes(options.quantization)  # before a download of gigabytes it could not load
    if pair.source == "embedded":
        path, name = embedded.ensure_converted(progress), embedded.EMBEDDED_ID
        weights_key = f"{embedded.EMBEDDED_ID}@conversion-{embedded.CONVERSION_VERSION}"
        paths = {"target": path}
    else:
        progress(f"Checking {pair.name}...")
        paths = download_pair(pair, download_progress)
        progress(f"Loading {pair.target.repo}...")
        name, weights_key = pair.id, f"{pair.target.repo}@{pair.target.revision}"
    tokenizer, model = _load_model(paths["target"], options)
    draft, draft_name = None, ""
    if "draft" in paths and draft_options(plan) is not None:
        progress(f"Loading the draft {pair.draft.repo}...")
        draft, draft_name = _load_draft(tokenizer, model, paths["draft"], pair.draft.repo, draft_options(plan)), pair.draft.repo
    key = curve_key(pair.target.repo, pair.target.revision, plan.weights, plan.kv_label())
    times, unmeasured = _step_times(model, key, plan.context, progress, calibrate_when_idle)
    engine = Engine(model, tokenizer, name, documents=_document_store(weights_key, model, plan.context),
                    settings=settings_from_plan(plan, times, draft is not None), draft=draft, draft_name=draft_name,
                    plan=plan, calibration_key=key, target_loader=TargetLoader(str(paths["target"]), options))
    return _calibrating_when_idle(engine, unmeasured)


def _step_times(model, key: str, context: int, progress: Callable[[str], None], when_idle: bool):
    """(the step times to answer by now, the contexts left to measure when the engine is idle)."""
    if when_idle:
        return saved_step_times(model, key, context)
    return calibrated_step_times(model, key, context, progress), []


def _calibrating_when_idle(engine: Engine, unmeasured: list[int]) -> Engine:
    if unmeasured:
        engine.idle_calibration = IdleCalibration(engine, engine.calibration_key, unmeasured)
    return engine


def _plan(pair, registry: Registry, context: int):
    """The plan for this machine at `context` tokens. A pair that does not fit is refused here,
    before any download, with the plan's reason and the nearest requests that fit (`PlanRefused`,
    an input error: exit code 2), never loaded in whatever precision happens to work."""
    from .hardware import load_or_probe
    from .planning import Overrides, make_plan, precision_setting

    return make_plan(load_or_probe(), pair, context, Overrides(precision=precision_setting()), registry=registry)


def _load(path: Path, name: str, weights_key: str, progress: Callable[[str], None], calibrate_when_idle: bool) -> Engine:
    """A local model directory, without a plan: fp32 on the CPU, calibrated like a pair."""
    tokenizer, model = _load_model(path, None)
    key = curve_key(str(path.resolve()), weights_key, "float32")
    times, unmeasured = _step_times(model, key, model.context_length, progress, calibrate_when_idle)
    engine = Engine(model, tokenizer, name, documents=_document_store(weights_key, model, model.context_length),
                    settings=EngineSettings(step_times=times), calibration_key=key,
                    target_loader=TargetLoader(str(path)))
    return _calibrating_when_idle(engine, unmeasured)


def _load_model(path: Path, options: LoadOptions | None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path), TransformersLM.from_pretrained(path, options)
    except (OSError, ValueError) as error:
        raise ModelUnavailable(f"cannot load the model at {path}: {first_line(error) or type(error).__name__}") from None


def _document_store(weights_key: str, model: TransformersLM, context: int) -> DocumentStore:
    """`weights_key` names these exact weights; with the dtype (and an 8-bit KV's) it keys saved
    document caches. The disk budget holds at least one document as long as `context` (an 8B
    model's 128K KV is 17 GB, and reading the document again takes minutes)."""
    kv = f":kv-{model.kv_dtype}" if model.kv_dtype else ""  # unchanged without one: saved documents stay valid
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    row_bytes = head_dim + 4 if model.kv_dtype == "int8" else head_dim * model.dtype.itemsize  # int8: a scale per row
    one_document = 2 * config.num_hidden_layers * config.num_key_value_heads * row_bytes * context
    return DocumentStore(embedded.documents_folder(), f"{weights_key}:{model.dtype}{kv}",
                         max(DOCUMENT_CACHE_BYTES, one_document))


def _newest_weights(path: Path) -> int:
    """A local model changes when its weights do: their newest modification time."""
    return max((int(file.stat().st_mtime) for file in path.glob("*.safetensors")), default=0)


def _load_draft(target_tokenizer, target: TransformersLM, path: Path, name: str,
                options: LoadOptions | None = None) -> TransformersLM:
    """Load the draft, padded to the target's logits width (some pairs pad their embeddings
    differently), after checking that it tokenizes exactly as the target does."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ModelUnavailable(f"the draft {name} does not share the target's tokenizer: not a speculation pair")
        return TransformersLM.from_pretrained(path, options, vocab_size=target.vocab_size)
    except (OSError, ValueError) as error:
        raise ModelUnavailable(f"cannot load the draft at {path}: {first_line(error) or type(error).__name__}") from None
