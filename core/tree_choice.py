"""The Sequoia tree TriForce's final verification checks (`--triforce-verify tree`).

The retrieval stage is the target itself over a retrieval cache, so it agrees with the full
verification most of the time (TriForce measured above 0.9); its sibling ranks add little. With
measured step times the hardware-aware optimizer (speculative/optimizer.py) picks the size and depth
from t(n) at the context and the retrieval forward's cost; without them, the plan's.
"""

from __future__ import annotations

from .planning import RETRIEVAL_SIBLING_ACCEPTANCE
from .runtime import EngineSettings
from .speculative.optimizer import choose_tree
from .speculative.tree import Tree
from .speculative.tree_dp import cached_best_tree



def triforce_tree(settings: EngineSettings, context: int | None = None) -> Tree:
    p = RETRIEVAL_SIBLING_ACCEPTANCE
    size, depth = settings.tree_size, settings.tree_depth
    times = settings.step_times
    if times is not None and context is not None:
        budget = settings.triforce.budget
        forward_times = min(times.curves, key=lambda measured: abs(measured.context - context))
        cost = times.seconds(1, budget) / times.seconds(1, context)
        choice = choose_tree(list(p), forward_times, cost, max(2, forward_times.sizes[-1]), depth)
        if choice.size > 1:
            size, depth = choice.size, choice.depth
    return cached_best_tree(p, size, depth)
