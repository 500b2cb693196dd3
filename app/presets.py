"""The chat's presets: a system prompt, sampling settings and, for document work, a question to
start from.

The document presets sample (temperature 0.7, top-p 0.9) rather than decode greedily: on the
embedded 135M model greedy summaries repeat themselves (0.83-0.87 of their 6-word runs are
repeats on two licences, against 0.04-0.78 sampled; bench/2026-11-23-cpu-summary-loops.json).
Sampled decoding stays exactly the model's distribution under speculation; it is slower only
because fewer drafts are accepted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    label: str
    system: str
    question: str  # put in an empty message box when the preset is chosen
    temperature: float = 0.0
    top_p: float = 1.0


PRESETS = {
    "free": Preset("Free chat", "", ""),
    "summarize": Preset(
        "Summarize the document",
        "You summarize documents faithfully. Cover the main points in order, keep names, numbers "
        "and dates exact, and add nothing that the document does not say.",
        "Summarize this document.", temperature=0.7, top_p=0.9),
    "answer": Preset(
        "Answer from the document",
        "Answer only from the document the user gave. Quote the passage you rely on. If the "
        "document does not say, answer that it does not say.",
        "", temperature=0.7, top_p=0.9),
}
