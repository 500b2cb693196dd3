"""Prints the package sources of the user's pip configuration as uv environment variables.

The one-click launchers install with uv, which does not read pip's configuration; a person whose
pip is set up for a mirror, a proxy's certificate or a folder of wheels expects the installer to
use them too. Run with any Python that has pip: `python pip_sources.py` prints `NAME=value`
lines (UV_DEFAULT_INDEX, UV_INDEX, UV_FIND_LINKS, UV_INDEX_STRATEGY, SSL_CERT_FILE), nothing when
pip names no source. Standard library only: it runs before specchat's environment exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
from urllib.parse import unquote, urlparse


def pip_settings(python: str = sys.executable) -> dict[str, str]:
    """`pip config list` as {option: value}, the last definition winning as in pip (environment
    variables show up as `:env:.option`); empty when pip is missing or fails."""
    try:
        listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                                 text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    settings = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        if not sep or "." not in key:
            continue
        section, option = key.rsplit(".", 1)
        if section in (":env:", "global", "install", "download"):
            settings[option] = value.strip().strip("'\"")
    return settings


def local_path(location: str) -> str | None:
    """The filesystem path of a find-links entry that is a local folder or file URL, else None."""
    if location.startswith("file:"):
        return unquote(urlparse(location).path)
    return None if "://" in location else location


def uv_variables(settings: dict[str, str]) -> dict[str, str]:
    variables = {}
    if settings.get("index-url"):
        variables["UV_DEFAULT_INDEX"] = settings["index-url"].split()[0]
    if settings.get("extra-index-url"):
        variables["UV_INDEX"] = " ".join(settings["extra-index-url"].split())
    # pip skips a find-links folder that does not exist; uv stops on it, so leave it out.
    links = [entry for entry in settings.get("find-links", "").split()
             if local_path(entry) is None or os.path.exists(local_path(entry))]
    if links:
        variables["UV_FIND_LINKS"] = ",".join(links)
    if variables:
        # pip picks the best version across all its sources; uv's default takes a package from
        # the first index that has it, which would hide newer versions on PyPI.
        variables["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    if settings.get("cert") and not os.environ.get("SSL_CERT_FILE"):
        variables["SSL_CERT_FILE"] = settings["cert"]
    return variables


if __name__ == "__main__":
    for name, value in uv_variables(pip_settings()).items():
        print(f"{name}={value}")
