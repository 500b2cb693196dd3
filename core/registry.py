"""The model pair registry: models.toml -> validated `ModelPair`s.

The shipped models.toml comes with the package; a user file (the user config folder's
models.toml, or `--models-file FILE`) is merged over it table by table, so a user can add a pair
or change one field of a shipped one. Every problem is reported as one line naming the file, the
line and the field.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PAIR_ID = re.compile(r"[a-z0-9][a-z0-9._-]*")
COMMIT = re.compile(r"[0-9a-f]{40}")
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
PATTERN_NAMES = {COMMIT: "a 40-character commit hash (pin a revision, not a branch)",
                 REPO_ID: "a Hub repo id such as owner/name"}
SOURCES = ("hub", "embedded")
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Upper bounds far past any real model, so a typo (or inf) fails here and never reaches the memory
# arithmetic, where it would overflow or make an impossible pair "fit".
MAX_CONTEXT = 1 << 24  # 16M tokens
MAX_ROPE_FACTOR = 64.0
MOST = {"context_length": MAX_CONTEXT, "recommended_vram_gb": 100_000, "params_b": 100_000,
        "download_bytes": 10**15, "layers": 10_000, "hidden_size": 1 << 20, "attention_heads": 10_000,
        "kv_heads": 10_000, "head_dim": 100_000, "vocab_size": 1 << 24, "max_position_embeddings": MAX_CONTEXT,
        "original_max_position_embeddings": MAX_CONTEXT}
PAIR_KEYS = ("name", "source", "context_length", "license", "gated", "chat_template", "recommended_vram_gb",
             "target", "draft")
MODEL_KEYS = ("repo", "revision", "params_b", "download_bytes", "layers", "hidden_size", "attention_heads",
              "kv_heads", "head_dim", "vocab_size", "max_position_embeddings", "dtype", "rope_scaling")


class RegistryError(InputError):
    """models.toml (shipped or the user's) is unusable; the message names file, line and field."""


class UnknownPair(InputError):
    """A pair id that no registry file defines."""


@dataclass(frozen=True)
class ModelSpec:
    """One model of a pair: where it lives and the shapes the memory arithmetic needs."""
    repo: str
    revision: str  # a pinned commit: what was checked is what gets downloaded
    params_b: float  # parameters, billions
    download_bytes: int  # the files specchat fetches (weights, config, tokenizer)
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int  # the config's (embeddings may be padded past the tokenizer)
    max_position_embeddings: int
    dtype: str  # the published weights' dtype
    rope_scaling: dict | None  # applied to the config to reach the pair's context, if any

    def weight_bytes(self, bits: int | None = None) -> int:
        """Bytes of the weights in their published dtype, or at `bits` per parameter."""
        per_param = DTYPE_BYTES[self.dtype] if bits is None else bits / 8
        return int(self.params_b * 1e9 * per_param)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class ModelPair:
    id: str
    name: str
    source: str  # "hub" (downloaded) or "embedded" (shipped in a PyPI package)
    target: ModelSpec
    draft: ModelSpec | None  # None: the target drafts for itself (prompt lookup, layer skip)
    context_length: int  # what the pair supports with the registry's rope scaling
    license: str
    gated: bool  # the Hub wants the licence accepted and a token
    chat_template: str  # notes on the template both models share
    recommended_vram_gb: float

    @property
    def models(self) -> tuple[ModelSpec, ...]:
        return (self.target,) if self.draft is None else (self.target, self.draft)

    @property
    def download_bytes(self) -> int:
        return sum(model.download_bytes for model in self.models) if self.source == "hub" else 0


@dataclass(frozen=True)
class Registry:
    pairs: dict[str, ModelPair]
    files: tuple[Path, ...]  # where they came from, shipped first

    def get(self, pair_id: str) -> ModelPair:
        try:
            return self.pairs[pair_id]
        except KeyError:
            raise UnknownPair(self.unknown_message(pair_id)) from None

    def unknown_message(self, pair_id: str) -> str:
        return (f"unknown model pair {pair_id!r}: known pairs are {', '.join(sorted(self.pairs))} "
                "(see `specchat models list`)")


def shipped_file() -> Path:
    # The package root holds models.toml (package data), one level above core/.
    return Path(__file__).resolve().parent.parent / "models.toml"


def user_file() -> Path:
    import platformdirs

    return Path(platformdirs.user_config_dir("specchat", appauthor=False)) / "models.toml"


def load_registry(models_file: str | Path | None = None) -> Registry:
    """The shipped registry with the user's file merged over it: `models_file` when given (it
    must exist), else the user config folder's models.toml when there is one."""
    paths = [shipped_file()]
    if models_file is not None:
        path = Path(models_file)
        if not path.is_file():
            raise RegistryError(f"--models-file {path}: no such file")
        paths.append(path)
    elif user_file().is_file():
        paths.append(user_file())
    merged: dict[str, Any] = {}
    origin: dict[tuple[str, ...], tuple[Path, str]] = {}  # table path -> (file, text) defining it last
    for path in paths:
        text = _read(path)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            where = re.search(r"\(at line (\d+), column \d+\)$", str(error))
            message = str(error)[:where.start()].strip() if where else str(error)
            raise RegistryError(f"{path}:{where.group(1) if where else '?'}: not valid TOML: {message}") from None
        _merge(merged, data, (), path, text, origin)
    pairs = merged.get("pairs")
    if not isinstance(pairs, dict) or not pairs:
        raise RegistryError(f"{paths[-1]}: no [pairs.<id>] tables")
    _Table(merged, (), origin).check_keys(("pairs",))
    return Registry({pair_id: _pair(pair_id, table, origin) for pair_id, table in pairs.items()}, tuple(paths))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise RegistryError(f"{path}: cannot read it: {error}") from None


def _merge(into: dict, data: dict, table: tuple[str, ...], path: Path, text: str, origin: dict) -> None:
    """Merge tables recursively (a value replaces a value); remember which file set each table
    and each value, so an error points at the file and line that holds it."""
    origin[table] = (path, text)
    for key, value in data.items():
        origin[table + (key,)] = (path, text)
        if isinstance(value, dict):
            if not isinstance(into.get(key), dict):
                into[key] = {}
            _merge(into[key], value, table + (key,), path, text, origin)
        else:
            into[key] = value


class _Table:
    """Typed field access that reports `file:line: pairs.id.field: problem`."""

    def __init__(self, data: Any, table: tuple[str, ...], origin: dict):
        self.table = table
        self.origin = origin
        if not isinstance(data, dict):
            self.fail(None, f"must be a table, got {type(data).__name__}")
        self.data = data

    def check_keys(self, known: tuple[str, ...]) -> None:
        """An unknown key is a typo until proven otherwise: silently ignored, it would leave the
        field it meant at its default."""
        for key in self.data:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean `{close[0]}`?" if close else f"known keys are {', '.join(known)}"
                self.fail(key, f"unknown key: {hint}")

    def fail(self, key: str | None, problem: str):
        name = ".".join(self.table + ((key,) if key else ()))
        path, text = (self.origin.get(self.table + ((key,) if key else ())) or self.origin.get(self.table)
                      or self.origin[self.table[:-1]])
        line, table, inner = None, self.table, key
        while line is None and (table or inner):  # an inline table has no header: point at its key
            line = _line_of(text, table, inner)
            table, inner = table[:-1], table[-1] if table else None
        where = f"{path}:{line}" if line else str(path)
        raise RegistryError(f"{where}: {name}: {problem}")

    def get(self, key: str, kind: type | tuple, default: Any = ..., pattern: re.Pattern | None = None,
            choices: tuple = (), positive: bool = False) -> Any:
        if key not in self.data:
            if default is ...:
                self.fail(None, f"missing field {key!r}")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            self.fail(key, f"must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(key, f"{value!r} is not {PATTERN_NAMES.get(pattern, 'well formed')}")
        if choices and value not in choices:
            self.fail(key, f"must be one of {', '.join(choices)}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(key, f"must be a finite number, got {value!r}")
        if positive and not value > 0:
            self.fail(key, f"must be positive, got {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key in MOST:
            if value < 0:
                self.fail(key, f"cannot be negative, got {value!r}")
            if value > MOST[key]:
                self.fail(key, f"{value:,} is past any real model (at most {MOST[key]:,})")
        return value


def _pair(pair_id: str, data: Any, origin: dict) -> ModelPair:
    table = _Table(data, ("pairs", pair_id), origin)
    if not PAIR_ID.fullmatch(pair_id):
        table.fail(None, "a pair id uses lower-case letters, digits, '.', '_' and '-'")
    table.check_keys(PAIR_KEYS)
    name, source = table.get("name", str), table.get("source", str, choices=SOURCES)
    context_length = table.get("context_length", int, positive=True)
    license_name, gated = table.get("license", str), table.get("gated", bool, False)
    chat_template = table.get("chat_template", str, "")
    recommended_vram_gb = float(table.get("recommended_vram_gb", (int, float), 0))
    target = _model(table, "target", source)
    draft = _model(table, "draft", source) if "draft" in table.data else None
    if context_length > _reach(target):
        table.fail("context_length", f"{context_length} exceeds what the target reaches ({_reach(target)}) "
                                     "with its rope scaling")
    if draft is not None and draft.vocab_size > target.vocab_size:
        table.fail("draft", "the draft's vocabulary is larger than the target's: not a speculation pair")
    return ModelPair(pair_id, name, source, target, draft, context_length, license_name, gated, chat_template,
                     recommended_vram_gb)


def _model(pair: _Table, role: str, source: str) -> ModelSpec:
    if role not in pair.data:
        pair.fail(None, f"missing table [{'.'.join(pair.table + (role,))}]")
    table = _Table(pair.data[role], pair.table + (role,), pair.origin)
    table.check_keys(MODEL_KEYS)
    hub = source == "hub"
    rope_scaling = _rope_scaling(table)
    return ModelSpec(
        repo=table.get("repo", str, pattern=REPO_ID),
        revision=table.get("revision", str, pattern=COMMIT) if hub else table.get("revision", str, ""),
        params_b=float(table.get("params_b", (int, float), positive=True)),
        download_bytes=table.get("download_bytes", int, positive=True) if hub else table.get("download_bytes", int, 0),
        layers=table.get("layers", int, positive=True),
        hidden_size=table.get("hidden_size", int, positive=True),
        attention_heads=table.get("attention_heads", int, positive=True),
        kv_heads=table.get("kv_heads", int, positive=True),
        head_dim=table.get("head_dim", int, positive=True),
        vocab_size=table.get("vocab_size", int, positive=True),
        max_position_embeddings=table.get("max_position_embeddings", int, positive=True),
        dtype=table.get("dtype", str, choices=DTYPES),
        rope_scaling=rope_scaling)


def _rope_scaling(model: _Table) -> dict | None:
    """The rope parameters handed to the model's config, their numbers checked: the factor and the
    original length set how far the pair's context may reach."""
    if model.get("rope_scaling", dict, None) is None:
        return None
    rope = _Table(model.data["rope_scaling"], model.table + ("rope_scaling",), model.origin)
    factor = rope.get("factor", (int, float), 1.0, positive=True)
    if not 1 <= factor <= MAX_ROPE_FACTOR:
        rope.fail("factor", f"must be between 1 and {MAX_ROPE_FACTOR:g}, got {factor!r}")
    rope.get("original_max_position_embeddings", int, None, positive=True)
    for key, value in rope.data.items():  # the other parameters (beta_fast, ...) go to the config as they are
        rope.get(key, (int, float, str, bool, list))
        if isinstance(value, list) and not all(isinstance(item, (int, float)) and not isinstance(item, bool)
                                               and math.isfinite(item) for item in value):
            rope.fail(key, "must be a list of finite numbers")
    return rope.data


def _reach(model: ModelSpec) -> int:
    """The longest context the model reaches: its (original) positions times the rope factor, as
    the loader sets it (core/model.py)."""
    rope = model.rope_scaling or {}
    positions = rope.get("original_max_position_embeddings", model.max_position_embeddings)
    return int(positions * rope.get("factor", 1.0))


def _line_of(text: str, table: tuple[str, ...], key: str | None) -> int | None:
    """1-based line of `key` inside `[table]` (or of the table header when `key` is None)."""
    current: tuple[str, ...] = ()  # keys before the first header belong to the top level
    header_line = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("[") and not stripped.startswith("[["):
            current = _header_keys(stripped.strip("[]"))
            if current == table:
                header_line = number
                if key is None:
                    return number
            continue
        if key is not None and current == table and re.match(rf'\s*"?{re.escape(key)}"?\s*=', line):
            return number
    return header_line


def _header_keys(header: str) -> tuple[str, ...]:
    return tuple(part.strip().strip('"').strip("'") for part in re.findall(r'"[^"]*"|\'[^\']*\'|[^.]+', header))
