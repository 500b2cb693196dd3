"""Which conversations use a saved document cache: beside each file `<name>.safetensors` that a
conversation saved or reused, `<name>.owners` lists their ids (JSON). When a conversation is
deleted for good, `release` deletes the files no other conversation uses: a document's KV holds its
token ids, so its text could be read back from the file long after the conversation is gone.

A file saved with no owner named (the command line's `--cache-document`, the API) has no list and
is left to the disk budget. Torch-free: the conversation store calls `release` as the app starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..files import write_atomically

SUFFIX = ".owners"
CACHE_SUFFIX = ".safetensors"


def owners_path(path: Path) -> Path:
    """The list of owners beside the saved file `path`."""
    return path.with_suffix(SUFFIX)


def owners(path: Path) -> set[str] | None:
    """The ids listed for the saved file `path`; None when it has no readable list."""
    try:
        listed = json.loads(owners_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(listed, list) or not all(isinstance(owner, str) for owner in listed):
        return None
    return set(listed)


def add_owner(path: Path, owner: str) -> None:
    """List `owner` as using the saved file `path`."""
    listed = owners(path) or set()
    if owner and owner not in listed:
        write_atomically(owners_path(path), json.dumps(sorted(listed | {owner})))


def forget(path: Path) -> None:
    """The list of a saved file that goes (evicted, rejected)."""
    owners_path(path).unlink(missing_ok=True)


def release(folder: Path, gone: set[str]) -> list[Path]:
    """Take the conversations `gone` off every list in `folder`; delete each saved file whose last
    owner they were (and any list left without its file). Returns the files deleted."""
    deleted: list[Path] = []
    if not gone or not folder.is_dir():
        return deleted
    for listing in sorted(folder.glob(f"*{SUFFIX}")):
        path = listing.with_suffix(CACHE_SUFFIX)
        listed = owners(path)
        try:
            if not path.exists():
                listing.unlink(missing_ok=True)
            elif listed is not None and listed & gone:
                if listed - gone:
                    write_atomically(listing, json.dumps(sorted(listed - gone)))
                else:
                    path.unlink(missing_ok=True)
                    listing.unlink(missing_ok=True)
                    deleted.append(path)
        except OSError:  # not ours to delete, or gone meanwhile: the disk budget still bounds it
            continue
    return deleted
