"""The speculation cost model: which mode, gammas and tree pay on a layout, and the predicted
seconds per token, from the measured bandwidths and t(n) curves (algorithms.md sections 1, 4, 5).

The tree optimizer (speculative/optimizer.py) does its arithmetic in torch; it is imported only
when measured curves exist, so planning without them never loads torch.
"""

from __future__ import annotations

from ..files import human_size
from ..hardware import curve_key
from ..registry import DTYPE_BYTES, ModelSpec
from ..speculative.dsi.cost import si_seconds_per_token
from ..speculative.lookahead import MAX_DRAFT
from .cost import retrieval_forward_seconds, step_seconds, verification_seconds
from .memory import DRAFT_SINKS, Layout, compute_dtype, slowest


GAMMA1 = 2  # TriForce's optimum for the draft -> retrieval stage (Llama2-7B-128K on an A100)
DEFAULT_GAMMA2 = 6  # TriForce's optimum, when the bandwidths are not measured
MAX_GAMMA2 = 64
RETRIEVAL_ACCEPTANCE = 0.9  # TriForce measured above 0.9 for the retrieval stage, also at T = 1
# Unconditional chance that the k-th child (by rank) is the one the full verification accepts, for
# the retrieval stage (the target itself over a retrieval cache): mostly its first choice. A stated
# default until measured per pair.
RETRIEVAL_SIBLING_ACCEPTANCE = (0.9, 0.04, 0.02, 0.01)
DRAFT_ACCEPTANCE = 0.8  # the small draft against the retrieval stage, until calibrated (assumed)
LOOKUP_ACCEPTANCE = 0.5  # prompt lookup's per-token acceptance, assumed (the lookahead's prior)
DEFAULT_TREE = (16, 4)
MAX_TREE_DEPTH = 12


def choose_speculation(layout: Layout, reasons: dict) -> tuple[str, int | None, int | None, tuple[int, int], str,
                                                          float | None]:
    """(mode, gamma1, gamma2, (tree n, d), TriForce's final verification, predicted seconds per
    token) with their reasons."""
    tree, tree_pays, chain = _tree(layout, reasons)
    seconds = step_seconds(layout)  # plain decoding's token
    mode = layout.mode
    if mode == "speculate":
        if tree_pays and (chain is None or tree_pays.speedup > chain.speedup):
            mode = "tree"
            reasons["mode"] = f"tree: the optimizer's tree beats the best chain ({tree_pays.reason})"
        else:
            mode = "chain"
            reasons["mode"] = "chain: " + (chain.reason if chain else
                                           "prompt lookup drafts from the document and the conversation, for free")
    if mode in ("chain", "tree") and seconds is not None:
        choice = tree_pays if mode == "tree" else chain  # the optimizer's, from measured t(n)
        seconds = seconds / choice.speedup if choice else chain_seconds(layout)
    gamma1 = gamma2 = None
    verify = "chain"
    if mode == "chain":
        gamma1 = MAX_DRAFT
        reasons["gammas"] = (f"up to {gamma1} draft tokens per verification, each length chosen as the answer goes "
                             f"by the cost model, from the answer's acceptance so far and " + _step_times_source(layout))
    elif mode == "triforce":
        gamma1 = GAMMA1 if layout.draft is not None else None
        gamma2, why, costs = _gamma2(layout)
        first = f"gamma1 = {GAMMA1} (TriForce's optimum) draft tokens per retrieval verification; " \
            if gamma1 else "no draft model: the retrieval stage drafts alone; "
        reasons["gammas"] = first + why
        verify, tree, rate = _triforce_verify(layout, costs, gamma2, tree, reasons)
        if costs is not None:  # tokens per full verification's time: measured t(n), else t(n) = 1
            t_mid, t_full = costs
            rate = rate or _expected_tokens(gamma2, _retrieval_acceptance(layout)) / (gamma2 * t_mid / t_full + 1)
            seconds = t_full / rate
    elif mode == "dsi":  # asked for: no single-card figure to compare with
        seconds = None
    return mode, gamma1, gamma2, tree, verify, seconds


def _triforce_verify(layout: Layout, costs: tuple[float, float] | None, gamma2: int, tree: tuple[int, int],
                     reasons: dict) -> tuple[str, tuple[int, int], float | None]:
    """A Sequoia tree as TriForce's final verification where the optimizer's tree beats the
    gamma2 chain: Speedup = G(n, d) / (t(n) + d c), c = one middle-stage token / one full
    verification, against E(gamma2) / (t(gamma2 + 1) + gamma2 c) for the chain (both in full
    verifications' time; the chosen one's is returned, None without measured t(n))."""
    curves = layout.profile.curves_for(layout.curve_key())
    if costs is None or curves is None:
        reasons["triforce_verify"] = ("chain: a tree needs t(n) and the bandwidths measured on this machine "
                                      "(the first use calibrates)")
        return "chain", tree, None
    from ..speculative.optimizer import choose_tree  # torch: only with measured curves

    t_mid, t_full = costs
    times, c = curves.at(layout.context), t_mid / t_full
    a2 = _retrieval_acceptance(layout)
    chain = _expected_tokens(gamma2, a2) / (times.relative(gamma2 + 1) + gamma2 * c)
    choice = choose_tree(list(RETRIEVAL_SIBLING_ACCEPTANCE), times, c, max(2, times.sizes[-1]), MAX_TREE_DEPTH)
    if choice.size > 1 and choice.speedup > chain:
        reasons["triforce_verify"] = f"tree n={choice.size}, d={choice.depth}: beats the chain's {chain:.2f}x ({choice.reason})"
        return "tree", (choice.size, choice.depth), choice.speedup
    reasons["triforce_verify"] = f"chain: {chain:.2f}x over plain, the best tree {choice.speedup:.2f}x ({choice.reason})"
    return "chain", tree, chain


def _step_times_source(layout: Layout) -> str:
    """Where the cost model's t(n) comes from: measured here, or the stated default."""
    curves = layout.profile.curves_for(layout.curve_key())
    if curves is None:
        return "a stated t(n) until the first use calibrates this machine (`specchat calibrate`)"
    times = curves.at(min(layout.context, 2048))
    shown = ", ".join(f"t({n}) = {times.relative(n):.2f}" for n in (2, 4, 8) if n <= times.sizes[-1])
    return f"t(n) measured on this machine ({shown} at {times.context:,} tokens of context)"


def _tree(layout: Layout, reasons: dict):
    """((n, d) for tree mode, the optimizer's tree choice or None, its chain choice or None)."""
    profile = layout.profile
    overrides_acceptance, draft_cost = _acceptance(layout)
    curves = profile.curves_for(layout.curve_key())
    if curves is None or overrides_acceptance is None or draft_cost is None:
        missing = [what for what, value in (("the target's t(n) on this machine", curves),
                                            ("the draft's acceptance vector", overrides_acceptance),
                                            ("the draft's cost", draft_cost)) if value is None]
        reasons["tree"] = (f"n={DEFAULT_TREE[0]}, d={DEFAULT_TREE[1]}: a stated default until the optimizer has "
                           f"what it needs (missing: {', '.join(missing)})")
        return DEFAULT_TREE, None, None
    from ..speculative.optimizer import chain_choice, choose_tree  # torch: only with measured curves

    times = curves.at(layout.context)
    max_size = max(2, times.sizes[-1])
    tree = choose_tree(list(overrides_acceptance), times, draft_cost, max_size, MAX_TREE_DEPTH)
    chain = chain_choice(list(overrides_acceptance), times, draft_cost, min(max_size - 1, MAX_TREE_DEPTH))
    reasons["tree"] = f"n={tree.size}, d={tree.depth}: {tree.reason}"
    return (tree.size, tree.depth), (tree if tree.size > 1 else None), chain


def _acceptance(layout: Layout) -> tuple[tuple[float, ...] | None, float | None]:
    """(acceptance vector, draft cost c): the cost from the draft's and target's measured
    1-token times when both curves exist, else the override."""
    overrides = layout.overrides
    draft = layout.draft
    cost = overrides.draft_cost
    if cost is None and draft is not None:
        target_curves = layout.profile.curves_for(layout.curve_key())
        draft_curves = layout.profile.curves_for(curve_key(draft.repo, draft.revision, layout.draft_dtype()))
        if target_curves and draft_curves:
            window = DRAFT_SINKS + layout.draft_window
            cost = (draft_curves.at(window).one_token_seconds
                    / target_curves.at(layout.context).one_token_seconds)
    return overrides.acceptance, cost


def _gamma2(layout: Layout) -> tuple[int, str, tuple[float, float] | None]:
    """Tokens per full verification g maximizing E(g, a2) / (g T_mid + T_full), E(g, a) =
    (1 - a^(g+1)) / (1 - a) (algorithms.md section 1).

    T_full reads the weights and the whole KV (on-chip), or streams the KV over PCIe while the
    weights are read (offloaded; double buffering overlaps the two). T_mid is the cost of one
    middle-stage token: a retrieval-cache target forward verifying gamma1 drafts plus the gamma1
    draft steps, shared by the E(gamma1, a1) tokens each such verification yields (without a
    draft, a one-token retrieval-cache step per token). Memory-bound forwards: bytes read / the
    measured on-device rate, each format at its efficiency (cost.py)."""
    memory_rate = slowest(layout, "memory_bytes_per_s")
    h2d = slowest(layout, "host_to_device_bytes_per_s")
    t_full = verification_seconds(layout)
    if t_full is None:
        return (DEFAULT_GAMMA2, f"gamma2 = {DEFAULT_GAMMA2}: TriForce's optimum (bandwidths not measured on this machine)",
                None)
    t_mid = retrieval_forward_seconds(layout, memory_rate, verify=layout.draft is not None)
    middle = f"{t_mid * 1e3:.1f} ms per retrieval-cache forward"
    if layout.draft is not None:
        a1 = layout.overrides.acceptance[0] if layout.overrides.acceptance else DRAFT_ACCEPTANCE
        draft_step = layout.draft.params_b * 1e9 * DTYPE_BYTES[layout.draft_dtype()] / memory_rate
        per_verification = _expected_tokens(GAMMA1, a1)
        t_mid = (t_mid + GAMMA1 * draft_step) / per_verification
        middle += (f" and {draft_step * 1e3:.1f} ms per draft step, over {per_verification:.2f} tokens each "
                   f"(draft acceptance {a1:.2f}): {t_mid * 1e3:.1f} ms per token")
    bits = " 8-bit" if layout.kv_int8 else ""
    if layout.kv_on_chip:
        full = f"reads weights and {human_size(layout.full_kv)} of{bits} KV at {human_size(memory_rate)}/s"
    else:
        resident = f", {layout.kv_resident_layers} layers' kept on the GPU" if layout.kv_resident_layers else ""
        full = f"streams {human_size(layout.streamed_kv)} of{bits} KV at {human_size(h2d)}/s{resident}"
    a2 = _retrieval_acceptance(layout)
    best = max(range(1, MAX_GAMMA2 + 1), key=lambda g: _expected_tokens(g, a2) / (g * t_mid + t_full))
    speedup = _expected_tokens(best, a2) * step_seconds(layout) / (best * t_mid + t_full)
    return best, (f"gamma2 = {best}: a full verification ({full}) costs {t_full * 1e3:.0f} ms against {middle}; "
                  f"at retrieval acceptance {a2:.2f}, {best} tokens per full verification give the most tokens "
                  f"per second, about {speedup:.2f}x plain decoding"), (t_mid, t_full)


def _retrieval_acceptance(layout: Layout) -> float:
    return layout.overrides.retrieval_acceptance or RETRIEVAL_ACCEPTANCE


def drafter_cost(layout: Layout, draft: ModelSpec | None) -> tuple[float, float]:
    """(seconds per draft token, per-token acceptance) of `draft` next to `layout`'s target: the
    stated or measured cost c times a verification, else its weights read once per step (its
    StreamingLLM cache is small); the calibrated acceptance, else DRAFT_ACCEPTANCE. No draft
    model: prompt lookup, free, at LOOKUP_ACCEPTANCE. Only called with the bandwidths measured."""
    if draft is None:
        return 0.0, LOOKUP_ACCEPTANCE
    acceptance = layout.overrides.acceptance[0] if layout.overrides.acceptance else DRAFT_ACCEPTANCE
    cost = _acceptance(layout)[1]
    if cost is not None:
        return cost * verification_seconds(layout), acceptance
    size = DTYPE_BYTES[compute_dtype(layout.profile, draft)]
    return draft.params_b * 1e9 * size / slowest(layout, "memory_bytes_per_s"), acceptance


def chain_seconds(layout: Layout) -> float:
    """A chain on this layout with its own drafter, at its best length (SI's formula; 0 drafts is
    a plain step, as the engine's cost model may choose). Only called with the bandwidths measured."""
    verification = verification_seconds(layout)
    draft, acceptance = drafter_cost(layout, layout.draft)
    return min(step_seconds(layout), *(si_seconds_per_token(verification, draft, acceptance, k)
                                       for k in range(1, MAX_DRAFT + 1)))


def _expected_tokens(gamma: int, acceptance: float) -> float:
    """Tokens per verification of a chain of `gamma` drafts, each accepted with `acceptance`."""
    return sum(acceptance ** i for i in range(gamma + 1))
