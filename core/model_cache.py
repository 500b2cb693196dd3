"""What the Hugging Face cache holds of a pair's models, read from disk only: where each model's
snapshot lives, whether it is complete (a small manifest under specchat's cache lists the files
a model needs, so offline mode can say exactly what is missing), and removing a pair.
`download.py` fills it."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from .embedded import cache_root
from .errors import InputError, ModelUnavailable
from .files import human_size, write_atomically
from .registry import ModelPair, ModelSpec, Registry


class NotDownloaded(ModelUnavailable):
    """Offline (or not yet downloaded) and some files of the model are not in the cache."""


@dataclass(frozen=True)
class ModelStatus:
    repo: str
    complete: bool
    present_bytes: int  # cached files and partial downloads
    missing: tuple[str, ...]  # files known to be missing (empty when nothing is known yet)


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def manifest_path(model: ModelSpec) -> Path:
    return cache_root() / "downloads" / f"{model.repo.replace('/', '--')}--{model.revision}.json"


def read_manifest(model: ModelSpec) -> dict | None:
    try:
        manifest = json.loads(manifest_path(model).read_text())
        return manifest if isinstance(manifest.get("files"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def write_manifest(model: ModelSpec, sizes: dict[str, int], verified: bool) -> None:
    write_atomically(manifest_path(model), json.dumps(
        {"repo": model.repo, "revision": model.revision, "files": sizes, "verified": verified}, indent=1))


def repo_folder(model: ModelSpec) -> Path:
    return hub_cache() / f"models--{model.repo.replace('/', '--')}"


def snapshot_folder(model: ModelSpec) -> Path:
    return repo_folder(model) / "snapshots" / model.revision


def model_status(model: ModelSpec) -> ModelStatus:
    """What the cache holds of `model`, read from disk only."""
    manifest = read_manifest(model)
    present = _partial_bytes(model)
    if manifest is None:
        return ModelStatus(model.repo, False, present, ())
    snapshot = snapshot_folder(model)
    missing = tuple(name for name, size in manifest["files"].items()
                    if not has_file(snapshot / name, size))
    present += sum(size for name, size in manifest["files"].items() if name not in missing)
    return ModelStatus(model.repo, not missing and bool(manifest.get("verified")), present, missing)


def has_file(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size  # follows the snapshot's symlink to the blob
    except OSError:
        return False


def _partial_bytes(model: ModelSpec) -> int:
    blobs = repo_folder(model) / "blobs"
    return sum(part.stat().st_size for part in blobs.glob("*.specchat-part")) if blobs.is_dir() else 0


def local_model_path(model: ModelSpec, pair_id: str) -> Path:
    """The snapshot folder of a complete, verified download, or `NotDownloaded` saying what is missing."""
    status = model_status(model)
    if status.complete:
        return snapshot_folder(model)
    if status.missing:
        listed = ", ".join(status.missing[:4]) + (f" and {len(status.missing) - 4} more" if len(status.missing) > 4 else "")
        raise NotDownloaded(f"{model.repo} is not fully downloaded: missing {listed} "
                            f"(in {hub_cache()}); run `specchat models download {pair_id}` while online")
    what = "only partly downloaded" if status.present_bytes else "not downloaded"
    raise NotDownloaded(f"{model.repo} is {what} (needs {human_size(model.download_bytes)} in {hub_cache()}); "
                        f"run `specchat models download {pair_id}` while online")


def remove_pair(pair: ModelPair, registry: Registry) -> tuple[list[str], list[str]]:
    """Delete the pair's models from the cache, except those another downloaded pair uses.
    Returns (removed repos, kept repos)."""
    if pair.source != "hub":
        raise InputError(f"{pair.id} is built in ({pair.source}); there is nothing to remove")
    in_use = {(model.repo, model.revision) for other in registry.pairs.values()
              if other.id != pair.id and other.source == "hub" and all(model_status(m).complete for m in other.models)
              for model in other.models}
    removed, kept = [], []
    for model in pair.models:
        if (model.repo, model.revision) in in_use:
            kept.append(model.repo)
            continue
        _remove_revision(model)
        manifest_path(model).unlink(missing_ok=True)
        removed.append(model.repo)
    return removed, kept


def _remove_revision(model: ModelSpec) -> None:
    """Delete one revision's snapshot, the blobs no other snapshot links to, and partial files."""
    folder = repo_folder(model)
    if not folder.is_dir():
        return
    linked = _linked_blobs(snapshot_folder(model))
    shutil.rmtree(snapshot_folder(model), ignore_errors=True)
    for blob in linked - _linked_blobs(folder / "snapshots"):
        blob.unlink(missing_ok=True)
    blobs = folder / "blobs"
    # Partial files: specchat's, and huggingface_hub's orphans from killed downloads.
    for part in [*blobs.glob("*.specchat-part"), *blobs.glob("*.incomplete")]:
        part.unlink(missing_ok=True)
    snapshots = folder / "snapshots"
    if not snapshots.is_dir() or not any(snapshots.iterdir()):
        shutil.rmtree(folder, ignore_errors=True)


def _linked_blobs(folder: Path) -> set[Path]:
    return {link.resolve() for link in folder.rglob("*") if link.is_symlink()} if folder.is_dir() else set()
