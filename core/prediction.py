"""What the cost model predicted for an answer as it went: the decode time of the steps it
took, so the answer's stats can show the predicted tok/s beside the measured one (predictions
checked against measurements, on every answer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .decoding import TriforceSettings
from .speculative.step_times import StepTimes

if TYPE_CHECKING:
    from .model import CausalLM
    from .speculative.types import Step


class AnswerPrediction:
    """The cost model's decode time for the steps an answer took: each target forward at t(n)
    for its n tokens at its context, plus the forwards of the stages below it (TriForce): the
    retrieval stage's over its budget, a layer-skip draft's over its window at its share of the
    layers. The first token is the prefill's and costs no decode time. None without measured
    step times, or with a stage it cannot price (a separate draft model: not calibrated)."""

    def __init__(self, times: StepTimes | None, model: CausalLM, triforce: TriforceSettings):
        self.times, self.model, self.triforce = times, model, triforce
        self.seconds = 0.0
        self.stage_forwards: dict[str, int] = {}
        self.steps = 0

    def add(self, step: Step, context: int, stages: dict[str, dict[str, int]], new_tokens: int) -> float | None:
        self.steps += 1
        if self.times is None:
            return None
        if self.steps > 1:
            self.seconds += self.times.seconds(step.verified, context)
        for name, counts in stages.items():
            forwards = counts.get("forwards", 0)
            ran, self.stage_forwards[name] = forwards - self.stage_forwards.get(name, 0), forwards
            cost = self._stage_forward_seconds(name, counts)
            if cost is None:
                self.times = None
                return None
            self.seconds += ran * cost
        return new_tokens / self.seconds if self.seconds > 0 else None

    def _stage_forward_seconds(self, name: str, counts: dict[str, int]) -> float | None:
        if name == "retrieval":
            # Its cache holds about the budget; a forward verifies the first stage's tokens.
            forwards = max(counts.get("forwards", 0), 1)
            tokens = 1 + counts.get("drafted", 0) / forwards
            return self.times.seconds(round(tokens), self.triforce.budget)
        if name.startswith("skip"):
            window = self.triforce.sinks + self.triforce.window
            return self.times.seconds(1, window) * int(name[len("skip"):]) / self.model.num_layers
        return None
