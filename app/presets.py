"""The chat's presets: a system prompt and, for document work, a question to start from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    label: str
    system: str
    question: str  # put in an empty message box when the preset is chosen


PRESETS = {
    "free": Preset("Free chat", "", ""),
    "summarize": Preset(
        "Summarize the document",
        "You summarize documents faithfully. Cover the main points in order, keep names, numbers "
        "and dates exact, and add nothing that the document does not say.",
        "Summarize this document."),
    "answer": Preset(
        "Answer from the document",
        "Answer only from the document the user gave. Quote the passage you rely on. If the "
        "document does not say, answer that it does not say.",
        ""),
}
