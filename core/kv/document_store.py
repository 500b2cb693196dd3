"""Saved document caches: a long document's KV written to disk once, loaded instead of a prefill
when the same document comes back, also after a restart.

One safetensors file per document prefix: per-layer keys and values (an 8-bit cache's codes and
scales as they are, so a reloaded document is attended to bit for bit as before), the token ids,
and metadata naming the model (weights and revision), the dtype and a hash of the ids. A file
that cannot be read, or whose ids, shapes or dtype do not match what it claims, is reported,
deleted and never trusted. The folder is kept under a disk budget, least recently used first;
a save's temporary file left behind (a process killed mid-write) goes once it is stale. The
conversations that use a file are listed beside it, and it goes with the last of them
(`document_owners`).

Files are written and read a layer at a time: an offloaded KV (`OffloadedCache`, 17 GB at 128K
for an 8B model) is written from its pinned buffers and read back into them, never copied whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from . import document_owners
from .cache import KVCache
from .full import FullCache
from .int8 import Int8Cache
from .offload import OffloadedCache

FORMAT = "specchat-kv-1"
# A save writes for seconds; a temporary older than this was left by a process that died
# (another app sharing the folder may be writing a younger one).
STALE_TEMPORARY_SECONDS = 3600
FREE_DISK_KEPT = 2 * 10**9  # a save never leaves the disk with less free
# safetensors' names of the dtypes a KV is kept in (its format's header, written by `_write`).
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int8: "I8", torch.int64: "I64"}


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


class SavableCache(KVCache, Protocol):
    """A cache whose slots are its positions (full, 8-bit or offloaded): what a saved file holds."""

    @property
    def num_layers(self) -> int: ...

    def layer_shape(self, length: int) -> tuple[int, ...]:
        """One layer's keys (or values) for `length` positions, as saved."""
        ...

    def stored_layers(self, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) of the first `length` positions as stored (an 8-bit cache's
        packed rows), as views: what a saved file holds, bit for bit."""
        ...


@dataclass(frozen=True)
class Loaded:
    cache: SavableCache
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

    def save_once(self, ids: list[int], cache: SavableCache, owner: str = "") -> Path | None:
        """`save`, unless this prefix is saved already; either way the file is listed as used by
        `owner` (a conversation's id; "": none named)."""
        path = self.path_for(ids)
        saved = path if path.is_file() else self.save(ids, cache)
        if saved is not None and owner:
            try:
                document_owners.add_owner(saved, owner)
            except OSError:  # a folder now read-only, a full disk: the budget still bounds the file
                pass
        return saved

    def save(self, ids: list[int], cache: SavableCache) -> Path | None:
        """Write the first `len(ids)` positions of `cache`; None when it alone exceeds the budget
        or would leave the disk under FREE_DISK_KEPT free."""
        layers = cache.stored_layers(len(ids))
        tensors = [("token_ids", torch.tensor(ids, dtype=torch.int64))]
        for index, (keys, values) in enumerate(layers):
            tensors += [(f"keys.{index}", keys), (f"values.{index}", values)]
        size = sum(t.numel() * t.element_size() for _, t in tensors)
        if size > self.budget_bytes:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        if size + FREE_DISK_KEPT > shutil.disk_usage(self.folder).free:
            return None  # a document read again costs minutes; a full disk costs the user more
        path = self.path_for(ids)
        metadata = {"format": FORMAT, "model": self.model_key, "dtype": str(layers[0][0].dtype),
                    "length": str(len(ids)), "ids_sha256": ids_digest(ids)}
        handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        os.close(handle)
        try:
            _write(Path(temporary), tensors, metadata)
            os.replace(temporary, path)
        finally:
            Path(temporary).unlink(missing_ok=True)
        self._enforce_budget(keep=path)
        return path

    def load(self, prompt_ids: list[int], empty_cache: Callable[[], SavableCache], at_least: int,
             device: torch.device | str = "cpu") -> Loaded | None:
        """The longest saved prefix of `prompt_ids` for this model that is longer than `at_least`
        (and leaves the last prompt token to run), read into `empty_cache()` (called only once a
        file is chosen: an offloaded cache is the conversation's own) on `device` (where the
        model computes; an offloaded cache keeps its own host memory), validated against it."""
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
        cache = self._read(path, prompt_ids[:length], empty_cache, device)
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

    def _read(self, path: Path, ids: list[int], empty_cache: Callable[[], SavableCache],
              device: torch.device | str) -> SavableCache | None:
        from safetensors import safe_open

        cache = empty_cache()
        try:
            with safe_open(path, "pt") as file:
                problem = _mismatch(file, ids, cache)
                if problem is None:
                    layers = ((file.get_tensor(f"keys.{i}"), file.get_tensor(f"values.{i}"))
                              for i in range(cache.num_layers))
                    return _filled(cache, layers, len(ids), device)
        except Exception as error:
            problem = f"unreadable ({type(error).__name__})"
        self._reject(path, problem)
        return None

    def _reject(self, path: Path, reason: str) -> None:
        self.problems.append(f"ignored the saved document cache {path.name}: {reason}; it was deleted")
        path.unlink(missing_ok=True)
        document_owners.forget(path)

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
                document_owners.forget(path)


def _mismatch(file, ids: list[int], cache: SavableCache) -> str | None:
    """Why an open saved file cannot fill `cache` with `ids`' keys and values, or None."""
    expected = {"token_ids"} | {f"{kind}.{i}" for kind in ("keys", "values") for i in range(cache.num_layers)}
    if set(file.keys()) != expected:
        return "its layers do not match the model"
    if not torch.equal(file.get_tensor("token_ids"), torch.tensor(ids, dtype=torch.int64)):
        return "its token ids do not match its hash"
    shape = list(cache.layer_shape(len(ids)))
    if any(file.get_slice(name).get_shape() != shape for name in expected - {"token_ids"}):
        return "its tensor shapes do not match the model"
    return None


def _filled(cache: SavableCache, layers, length: int, device: torch.device | str) -> SavableCache:
    """`cache` (empty) holding the per-layer (keys, values) of `layers`, read one at a time."""
    if isinstance(cache, OffloadedCache):
        cache.fill(layers, length)  # into its pinned buffers, a layer in memory at a time
        return cache
    # A layer on the device at a time, copied into the cache's buffers: never the KV twice there.
    layers = ((keys.to(device), values.to(device)) for keys, values in layers)
    if isinstance(cache, Int8Cache):
        return Int8Cache.from_packed(cache.config, cache.dtype, layers, cache.max_positions)
    return FullCache.from_layers(cache.config, layers, cache.max_positions)


def _write(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """A safetensors file written a tensor at a time (its format: a little-endian u64 header
    length, the JSON header padded to 8 bytes, the tensors' bytes in order): `save_file` wants
    every tensor contiguous at once, a second copy of the whole KV."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for _, tensor in tensors:
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            file.write(flat.view(torch.uint8).numpy().data)
