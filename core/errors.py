"""Errors the engine reports to people: each carries one actionable sentence.

The CLI turns `InputError` into exit code 2, the UI into a message in the chat; neither shows a
traceback.
"""


class SpecchatError(Exception):
    """Base class: `str(error)` is the one line shown to the user."""


class InputError(SpecchatError):
    """The request itself is unusable (empty prompt, too long for the context, unreadable file)."""


class ModelUnavailable(SpecchatError):
    """The model cannot be found or loaded."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message ("" when it has none), for one-line reports."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
