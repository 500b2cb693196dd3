"""Text from a model, a file name or a request, made safe to print on the operator's terminal (or
to `cat` from an export).

A model can emit ESC (the embedded one does), and a file name or a request can carry any character:
printed raw, an escape sequence recolours, moves the cursor, retitles the window or worse, and a
bidirectional override shows a line other than the one written. Tabs and newlines stay.
"""

from __future__ import annotations

import re

# C0 controls but tab and newline (carriage return too: it rewrites the line), DEL, C1 controls
# (8-bit CSI among them), and the invisible direction marks, embeddings, overrides and isolates.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def for_terminal(text: str) -> str:
    return _UNSAFE.sub("", text)


def json_escaped(json_text: str) -> str:
    """JSON text with each of those characters written as its \\u escape: the same data for any
    JSON reader, nothing invisible or active for a person who prints the file. (A JSON writer
    escapes C0 controls, but not DEL, C1 controls or direction overrides.) Outside its strings
    JSON is ASCII, so every such character is inside a string, where an escape is valid."""
    return _UNSAFE.sub(lambda match: f"\\u{ord(match.group()):04x}", json_text)
