"""DSI (algorithms.md section 6): a whole target on each GPU that holds one, chosen where its cost
model (speculative/dsi/cost.py) predicts it beats the single-card plan by DSI_MARGIN, with the
plan's own step times: a verification reads the weights and the KV at the card's memory rate, or
streams an offloaded KV over the card's own link, so W instances verify side by side without
sharing bandwidth."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..files import human_size
from ..speculative.dsi.cost import dsi_lookahead, dsi_seconds_per_token
from ..speculative.lookahead import MAX_DRAFT
from .cost import predictions, verification_seconds
from .memory import DRAFT_SINKS, Layout, budgets, prefill_chunks, uses_draft
from .reasons import draft_cache_reason, prefill_reason
from .speculation import chain_seconds, drafter_cost
from .types import DeviceMemory, MemoryItem, Plan


# DSI must be predicted this much faster: the model leaves out what its instances add (a process
# hop per task, prefill on every instance, cancelled work competing for the drafter's card).
DSI_MARGIN = 1.10


@dataclass(frozen=True)
class _Dsi:
    cards: tuple[Layout, ...]  # one instance each, a whole target; the last also holds the draft, if any
    items: tuple[MemoryItem, ...]
    devices: tuple[DeviceMemory, ...]
    lookahead: int | None  # None: not measured, the engine's first guess
    seconds: float | None = None  # predicted per token (None: not measured)


def choose_dsi(layout: Layout, mode: str, seconds: float | None, reasons: dict) -> _Dsi | None:
    """DSI over the GPUs that each hold a whole target, where its cost model predicts it beats
    the faster of `mode` on `layout` (`seconds` per token) and a chain there by DSI_MARGIN, or
    where asked for; reasons["dsi"] says why not (chosen: reasons["mode"] says why). Never with
    another mode asked for, and not considered with one GPU."""
    asked = layout.overrides.mode == "dsi"
    if layout.overrides.mode and not asked:
        return None
    if len(layout.profile.gpus) < 2:
        if asked:
            reasons["dsi"] = "fewer than two GPUs: the engine's CPU worker processes stand in for the instances"
        return None
    found = _dsi_cards(layout)
    if isinstance(found, str):
        reasons["dsi"] = f"{found}: the engine's CPU worker processes stand in" if asked else f"not chosen: {found}"
        return None
    cards, items, devices = found
    names = ", ".join(card.target_devices[0] for card in cards)
    over = f"over {len(cards)} GPUs ({names}) that each hold a whole target"
    verifications = [verification_seconds(card) for card in cards]
    if None in verifications or (seconds is None and not asked):
        reasons["dsi"] = (f"{over}: the lookahead follows the measured latencies" if asked else
                          "not chosen: its cost model needs the GPUs' bandwidths measured "
                          "(`specchat profile --refresh`)")
        return _Dsi(cards, items, devices, None) if asked else None
    target = max(verifications)  # the slowest instance's
    draft, acceptance = drafter_cost(layout, cards[-1].draft)
    lookahead = dsi_lookahead(target, draft, len(cards), MAX_DRAFT)
    predicted = dsi_seconds_per_token(target, draft, acceptance, lookahead, len(cards))
    assumed = "" if cards[-1].draft and layout.overrides.acceptance else " assumed"
    drafter = (f"a draft step {draft / target:.1%} of a verification, draft acceptance {acceptance:.2f}{assumed}"
               if cards[-1].draft else f"prompt lookup drafts, acceptance {acceptance:.2f}{assumed}")
    link = "" if cards[0].kv_on_chip else ", each instance streaming its KV over its own link"
    how = f"lookahead {lookahead}, {drafter}; a verification {target * 1e3:.1f} ms{link}"
    if asked:
        reasons["dsi"] = f"{over}: predicted {predicted * 1e3:.1f} ms per token ({how})"
        return _Dsi(cards, items, devices, lookahead, predicted)
    # DSI's gain is its parallelism only against the best this layout does, a chain included:
    # by its own figures the chosen mode can be the slower one (TriForce at a moderate context).
    chain = chain_seconds(layout)
    if chain < seconds:
        mode, seconds = "chain", chain
    gain = seconds / predicted
    versus = (f"{gain:.2f}x a {mode} on {'+'.join(layout.target_devices)}",
              f"({predicted * 1e3:.1f} against {seconds * 1e3:.1f} ms per token; {how})")
    if gain >= DSI_MARGIN:
        reasons["mode"] = f"dsi {over}: predicted {versus[0]} {versus[1]}"
        return _Dsi(cards, items, devices, lookahead, predicted)
    reasons["dsi"] = (f"not chosen: DSI {over} is predicted {versus[0]}, under the {DSI_MARGIN:.2f}x it needs "
                      f"{versus[1]}")
    return None


def _dsi_cards(layout: Layout) -> tuple[tuple[Layout, ...], tuple[MemoryItem, ...], tuple[DeviceMemory, ...]] | str:
    """A whole target at the plan's weights on each GPU that holds one (two at least), or why
    not. The instances load alike (the plan's load options), so the KV stays with the layers on
    every card or is offloaded for all; as in `try_plan`, the KV on-chip comes before the draft,
    which goes beside the last card's copy (without it prompt lookup drafts)."""
    profile, pair = layout.profile, layout.pair
    for kv_on_chip in (True, False):
        for with_draft in (True, False) if uses_draft(pair, "dsi") else (False,):
            for chunk in prefill_chunks(profile, kv_on_chip):
                cards = [card for card in (_card(layout, gpu, kv_on_chip, False, chunk) for gpu in profile.gpus)
                         if card.fits]
                if len(cards) < 2:
                    continue
                if with_draft:
                    cards[-1] = _card(layout, cards[-1].profile.gpus[0], kv_on_chip, True, chunk)
                # Each instance offloads a KV of its own: name whose each pinned copy is.
                items = tuple(replace(item, what=f"{item.what}, for the instance on {card.target_devices[0]}")
                              if item.where == "cpu" else item for card in cards for item in card.items)
                devices = budgets(profile, list(items))
                if all(device.headroom_bytes >= 0 for device in devices):
                    return tuple(cards), items, devices
    # The last candidate tried is the smallest: KV offloaded, smallest chunk, no draft.
    holders = [card.target_devices[0] for card in cards]
    if len(holders) >= 2:  # each card fits alone: only the RAM is shared
        return f"one offloaded KV per instance ({len(holders)} x {human_size(layout.full_kv)}) does not fit in RAM"
    size = human_size(sum(layout.weights()))
    return (f"no two GPUs each hold a whole target ({layout.weights_label()} weights, {size}) even with its KV "
            f"offloaded" + (f"; only {holders[0]} does" if holders else "")
            + (", so its layers are split across them" if len(layout.target_devices) > 1 else ""))


def _card(layout: Layout, gpu, kv_on_chip: bool, with_draft: bool, prefill_chunk: int) -> Layout:
    """`layout`'s target alone on `gpu`: one DSI instance (its KV in 8 bits where `layout`'s is)."""
    return Layout(replace(layout.profile, gpus=(gpu,)), layout.pair, layout.context, "dsi", None, layout.overrides,
                   layout.quantization, kv_on_chip, with_draft, prefill_chunk, layout.head_quantized,
                   layout.embedding_on_cpu, layout.kv_int8)


def dsi_plan(layout: Layout, dsi: _Dsi, tree: tuple[int, int], reasons: dict) -> Plan:
    """The plan with one instance per card: the engine's own target is the first card's copy,
    the draft beside the last's. The reasons of the layout it replaces are rewritten, or dropped
    where they belong to its speculation (gammas, TriForce's verification)."""
    first, last = dsi.cards[0], dsi.cards[-1]
    names = tuple(card.target_devices[0] for card in dsi.cards)
    for stale in ("gammas", "triforce_verify"):
        reasons.pop(stale, None)
    size = human_size(sum(layout.weights()))
    drafter = (f"draft on {last.draft_device()}" if last.draft else
               "no draft model fits beside a copy: prompt lookup drafts")
    reasons["placement"] = (f"a whole target ({size}) on each of {', '.join(names)}: one DSI instance per GPU, the "
                            f"engine's own on {names[0]}; {drafter}")
    kv = human_size(first.full_kv) + (", 8-bit" if first.kv_int8 else "")
    reasons["kv"] = (f"each instance's full KV ({kv}) on its GPU with its layers" if first.kv_on_chip else
                     f"each instance's full KV ({kv}) offloaded to pinned CPU memory ({len(names)} copies) and "
                     f"streamed to its GPU over its own link: it does not fit next to the weights")
    if last.draft is not None:
        reasons["draft_cache"] = draft_cache_reason(last)
    reasons["prefill_chunk"] = prefill_reason(first)
    if not first.kv_on_chip:
        reasons["kv_attention"] = ("offloaded KV streamed to the GPUs: each instance over its own link, side by side "
                                   "(on the CPU the instances would share its memory bandwidth)")
    return Plan(
        pair_id=layout.pair.id, context=layout.context, mode="dsi", weights=layout.weights_label(),
        target_devices=first.target_devices, target_layers=first.target_layers,
        draft_device=last.draft_device(), draft_weights=last.draft_dtype(), kv_device=first.kv_device(),
        retrieval_budget=None, retrieval_chunk=None,
        draft_sinks=DRAFT_SINKS if last.draft is not None else None,
        draft_window=last.draft_window if last.draft is not None else None,
        gamma1=None, gamma2=None, tree_size=tree[0], tree_depth=tree[1], prefill_chunk=first.prefill_chunk,
        memory=dsi.items, devices=dsi.devices, reasons=reasons, dsi_devices=names,
        dsi_lookahead=dsi.lookahead, head_weights=first.head_label(), embedding_device=first.embedding_device(),
        kv_dtype=first.kv_dtype, precision=layout.overrides.precision, **predictions(first, dsi.seconds))
