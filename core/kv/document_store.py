"""Saved document caches: a long document's KV written to disk once, loaded instead of a prefill
when the same document comes back, also after a restart.

One safetensors file per document prefix: per-layer keys and values (an 8-bit cache's codes and
scales as they are, so a reloaded document is attended to bit for bit as before), the token ids,
and metadata naming the model (weights and revision), the dtype and a hash of the ids. A file
that cannot be read, or whose ids, shapes or dtype do not match what it claims, is reported,
deleted and never trusted. The folder is kept under a disk budget, least recently used first;
a save's temporary file left behind (a process killed mid-write) goes once it is stale.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .full import FullCache
from .int8 import Int8Cache

FORMAT = "specchat-kv-1"
# A save writes for seconds; a temporary older than this was left by a process that died
# (another app sharing the folder may be writing a younger one).
STALE_TEMPORARY_SECONDS = 3600


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class Loaded:
    cache: FullCache
    length: int  # positions it holds (a prefix of the prompt)
    path: Path


class DocumentStore:
    def __init__(self, folder: Path, model_key: str, budget_bytes: int):
        self.folder = folder
        self.model_key = model_key  # names the weights: a cache is valid for these alone
        self.budget_bytes = budget_bytes
        self.problems: list[str] = []  # files found unusable since the last `take_problems`
        self._remove_stale_temporaries()

    def take_problems(self) -> list[str]:
        problems, self.problems = self.problems, []
        return problems

    def path_for(self, ids: list[int]) -> Path:
        return self.folder / f"{hashlib.sha256(f'{self.model_key}:{ids_digest(ids)}'.encode()).hexdigest()[:32]}.safetensors"

    def save_once(self, ids: list[int], cache: FullCache) -> Path | None:
        """`save`, unless this prefix is saved already."""
        path = self.path_for(ids)
        return path if path.is_file() else self.save(ids, cache)

    def save(self, ids: list[int], cache: FullCache) -> Path | None:
        """Write the first `len(ids)` positions of `cache`; None when it alone exceeds the budget."""
        from safetensors.torch import save_file

        layers = cache.packed_layers(len(ids)) if isinstance(cache, Int8Cache) else cache.layers(len(ids))
        tensors = {"token_ids": torch.tensor(ids, dtype=torch.int64)}
        for index, (keys, values) in enumerate(layers):
            tensors[f"keys.{index}"], tensors[f"values.{index}"] = keys.contiguous(), values.contiguous()
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.budget_bytes:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path_for(ids)
        metadata = {"format": FORMAT, "model": self.model_key, "dtype": str(layers[0][0].dtype),
                    "length": str(len(ids)), "ids_sha256": ids_digest(ids)}
        handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        os.close(handle)
        try:
            save_file(tensors, temporary, metadata=metadata)
            os.replace(temporary, path)
        finally:
            Path(temporary).unlink(missing_ok=True)
        self._enforce_budget(keep=path)
        return path

    def load(self, prompt_ids: list[int], template: FullCache, at_least: int) -> Loaded | None:
        """The longest saved prefix of `prompt_ids` for this model that is longer than `at_least`
        (and leaves the last prompt token to run), validated against `template`'s shapes."""
        best: tuple[int, Path] | None = None
        for path, metadata in self._headers():
            if metadata.get("model") != self.model_key or metadata.get("format") != FORMAT:
                continue
            length = int(metadata.get("length", 0))
            if at_least < length < len(prompt_ids) and (best is None or length > best[0]) \
                    and metadata.get("ids_sha256") == ids_digest(prompt_ids[:length]):
                best = (length, path)
        if best is None:
            return None
        length, path = best
        cache = self._read(path, prompt_ids[:length], template)
        if cache is None:
            return None
        os.utime(path)  # recently used: the budget evicts others first
        return Loaded(cache, length, path)

    def _headers(self):
        from safetensors import safe_open

        for path in sorted(self.folder.glob("*.safetensors")) if self.folder.is_dir() else ():
            try:
                with safe_open(path, "pt") as file:
                    yield path, file.metadata() or {}
            except Exception as error:  # any unreadable header: report and drop the file
                self._reject(path, f"unreadable ({type(error).__name__})")

    def _read(self, path: Path, ids: list[int], template: FullCache) -> FullCache | None:
        from safetensors.torch import load_file

        try:
            tensors = load_file(path)
        except Exception as error:
            self._reject(path, f"unreadable ({type(error).__name__})")
            return None
        shape = template.layer_shape(len(ids))
        expected = {"token_ids"} | {f"{kind}.{i}" for kind in ("keys", "values") for i in range(template.num_layers)}
        if set(tensors) != expected:
            self._reject(path, "its layers do not match the model")
            return None
        if not torch.equal(tensors["token_ids"], torch.tensor(ids, dtype=torch.int64)):
            self._reject(path, "its token ids do not match its hash")
            return None
        layers = [(tensors[f"keys.{i}"], tensors[f"values.{i}"]) for i in range(template.num_layers)]
        if any(t.shape != shape for pair in layers for t in pair):
            self._reject(path, "its tensor shapes do not match the model")
            return None
        if isinstance(template, Int8Cache):
            return Int8Cache.from_packed(template.config, template.dtype, layers)
        return FullCache.from_layers(template.config, layers)

    def _reject(self, path: Path, reason: str) -> None:
        self.problems.append(f"ignored the saved document cache {path.name}: {reason}; it was deleted")
        path.unlink(missing_ok=True)

    def _remove_stale_temporaries(self) -> None:
        """Left-over temporaries: ours (`tmp*.tmp`, from `save`) and `.tmp*` (seen once in this
        folder, from a writer killed mid-file); they hold gigabytes outside the budget."""
        if not self.folder.is_dir():
            return
        now = time.time()
        for path in [*self.folder.glob("tmp*.tmp"), *self.folder.glob(".tmp*")]:
            try:
                if path.is_file() and now - path.stat().st_mtime > STALE_TEMPORARY_SECONDS:
                    path.unlink()
            except OSError:  # gone meanwhile, or not ours to delete: the budget does not count it
                pass

    def _enforce_budget(self, keep: Path) -> None:
        self._remove_stale_temporaries()
        files = sorted(self.folder.glob("*.safetensors"), key=lambda path: path.stat().st_mtime)
        total = sum(path.stat().st_size for path in files)
        for path in files:
            if total <= self.budget_bytes:
                break
            if path != keep:
                total -= path.stat().st_size
                path.unlink(missing_ok=True)
