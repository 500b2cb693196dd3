"""Settings read from environment variables, all one way: unset means the default, and a value
that is set must be a number in range (or one of a few words), or the error names the variable
and what it wants (a typo must not silently fall back to a default the user meant to change)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import InputError


# No setting needs more (a million terabytes in MB, 30,000 years in seconds); past it a value is a
# typo, and a setting scaled to bytes could overflow.
MOST = 1e12


def env_number(variable: str, default, kind: type = float, above: float = 0.0, wanted: str = ""):
    """`variable` as a `kind` (int or float) greater than `above` and at most `MOST`, or `default`
    when unset or blank."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not above < value <= MOST:
        wanted = wanted or f"a positive {'whole ' if kind is int else ''}number"
        too_large = value is not None and value > MOST
        raise InputError(f"{variable} must be {wanted}{f' up to {MOST:g}' if too_large else ''}, got {raw!r}")
    return value


def env_choice(variable: str, choices: tuple[str, ...], default: str) -> str:
    """`variable` as one of `choices` (case-insensitive), or `default` when unset or blank."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    if raw.lower() not in choices:
        raise InputError(f"{variable} must be one of {', '.join(choices)}, got {raw!r}")
    return raw.lower()


SWITCH_ON, SWITCH_OFF = ("1", "on", "yes", "true"), ("0", "off", "no", "false")


def env_switch(variable: str, default: bool) -> bool:
    """`variable` as on (1, on, yes, true) or off (0, off, no, false), or `default` when unset or
    blank; a typo is an error, never silently the default."""
    return env_choice(variable, SWITCH_ON + SWITCH_OFF, SWITCH_ON[0] if default else SWITCH_OFF[0]) in SWITCH_ON


def folder_setting(variable: str, value: str) -> Path:
    """A folder named by `variable`: an error names it when it is a file (every write under it
    would fail later with a bare NotADirectoryError)."""
    folder = Path(value)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{variable} is {value}, which is a file, not a folder: name a folder (it is made if missing)")
    return folder
