"""Settings read from environment variables, all one way: unset means the default, and a value
that is set must be a number in range (or one of a few words), or the error names the variable
and what it wants (a typo must not silently fall back to a default the user meant to change)."""

from __future__ import annotations

import math
import os

from .errors import InputError


def env_number(variable: str, default, kind: type = float, above: float = 0.0, wanted: str = ""):
    """`variable` as a `kind` (int or float) greater than `above`, or `default` when unset or blank."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value > above or (kind is float and math.isinf(value)):
        wanted = wanted or f"a positive {'whole ' if kind is int else ''}number"
        raise InputError(f"{variable} must be {wanted}, got {raw!r}")
    return value


def env_choice(variable: str, choices: tuple[str, ...], default: str) -> str:
    """`variable` as one of `choices` (case-insensitive), or `default` when unset or blank."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    if raw.lower() not in choices:
        raise InputError(f"{variable} must be one of {', '.join(choices)}, got {raw!r}")
    return raw.lower()
