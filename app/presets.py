"""The chat's presets: a system prompt, sampling settings and, for document work, a question to
start from.

The document presets sample (temperature 0.7, top-p 0.9) rather than decode greedily: on the
embedded 135M model greedy summaries repeat themselves (0.83-0.87 of their 6-word runs are
repeats on two licences, against 0.04-0.78 sampled; bench/2026-11-23-cpu-summary-loops.json).
Sampled decoding stays exactly the model's distribution under speculation; it is slower only
because fewer drafts are accepted.

Sampled summaries still looped (4 of 6 repeated a run of 12 tokens 3 times), so the document
presets add a repetition penalty of 1.1, the mildest measured that left none looping (1.2 did
too, with shorter answers; a presence penalty of 0.5 left 4 of 6; Apache-2.0 and MPL-2.0, seeds
0-2: bench/2026-11-27-cpu-repetition.json). Every preset also ends an answer that repeats itself
anyway (`stop_repeats`, core/repeats.py): a stop, not a change of distribution, so it costs
nothing where the model does not loop, and the small models loop in free chat too."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    label: str
    system: str
    question: str  # put in an empty message box when the preset is chosen
    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop_repeats: bool = True

    def sampling(self, seed: int | None = None, top_k: int = 0):
        """The preset's sampling settings, a `SamplingParams` (torch is imported only then)."""
        from ..core.sampling import SamplingParams

        return SamplingParams(self.temperature, top_k, self.top_p, seed, self.repetition_penalty,
                              self.frequency_penalty, self.presence_penalty, self.stop_repeats)


DOCUMENT_SAMPLING = dict(temperature=0.7, top_p=0.9, repetition_penalty=1.1)

PRESETS = {
    "free": Preset("Free chat", "", ""),
    "summarize": Preset(
        "Summarize the document",
        "You summarize documents faithfully. Cover the main points in order, keep names, numbers "
        "and dates exact, and add nothing that the document does not say.",
        "Summarize this document.", **DOCUMENT_SAMPLING),
    "answer": Preset(
        "Answer from the document",
        "Answer only from the document the user gave. Quote the passage you rely on. If the "
        "document does not say, answer that it does not say.",
        "", **DOCUMENT_SAMPLING),
}
