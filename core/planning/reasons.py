"""One line per placement choice, with the figures behind it (the speculation's reasons are
written where it is chosen, in speculation.py and dsi.py)."""

from __future__ import annotations

from ..files import human_size
from .memory import DRAFT_SINKS, Layout, activation_bytes, slowest, weight_parts


def weights_reason(layout: Layout, tried: list[Layout]) -> str:
    sizes = f"target {human_size(sum(layout.weights()))}"
    if layout.quantization == "none":
        where = "in RAM" if not layout.profile.gpus else "with room for the caches"
        return f"{layout.weights_label()}: unquantized weights ({sizes}) fit {where}"
    head = (f", the output head quantized too (lossless against this quantized target; "
            f"{human_size(layout.weights()[1])} instead of "
            f"{human_size(weight_parts(layout.pair.target, 'none', layout.dtype_bytes)[1])})"
            if layout.head_quantized else "")
    tier = (layout.quantization, layout.head_quantized)
    finer = [candidate for candidate in tried if (candidate.quantization, candidate.head_quantized) != tier]
    if not finer:
        return f"{layout.weights_label()}{head}: as requested ({sizes})"
    # The last candidate of each tier is its smallest: KV offloaded, no draft, embedding on the CPU.
    smallest = {(candidate.quantization, candidate.head_quantized): candidate for candidate in finer}
    shortfalls = dict.fromkeys(candidate.shortfall() for candidate in smallest.values())  # in order, once each
    return f"{layout.weights_label()}{head} ({sizes}): " + "; ".join(shortfalls)


def auto_weights_reason(layout: Layout) -> str:
    """Why these weights, under the automatic precision: the fastest placement carries them."""
    sizes = f"target {human_size(sum(layout.weights()))}"
    if layout.overrides.quantization:
        return f"{layout.weights_label()}: as requested ({sizes})"
    head = ", the output head quantized too" if layout.head_quantized else ""
    kind = "unquantized" if layout.quantization == "none" else "4-bit"
    return f"{layout.weights_label()}: {kind} weights{head} ({sizes}), in the fastest placement that fits (precision)"


def placement_reason(layout: Layout) -> str:
    if not layout.profile.gpus:
        return "no CUDA GPU: everything runs on the CPU (decode is bound by reading the weights: slow for large models)"
    spread = ", ".join(f"{count} layers on {name}" for name, count in zip(layout.target_devices, layout.target_layers))
    text = f"target: {spread}"
    if layout.embedding_on_cpu:
        text += (f"; its embedding table ({human_size(layout.weights()[0])}) on the CPU: each token's row is read "
                 f"there and {layout.pair.target.hidden_size * layout.dtype_bytes:,} bytes go to the GPU")
    if len(layout.target_devices) > 1:
        held = "weights and KV" if layout.kv_on_chip else "weights"
        text += f" (split in layer order: each GPU holds its layers' {held}; one hop between them per forward)"
    if layout.draft is not None:
        last = layout.draft_device()
        alone = last not in layout.target_devices
        text += f"; draft on {last}" + (" (the target keeps the other GPU to itself)" if alone else "")
    elif layout.draft_left_out:
        drafter = "the retrieval cache drafts alone" if layout.retrieval else "prompt lookup drafts"
        text += (f"; no draft model: {layout.pair.draft.repo} does not fit next to the target and its caches, "
                 f"and on the CPU it would draft slower than the GPU verifies, so {drafter}")
    return text


def kv_reason(layout: Layout) -> str:
    size = human_size(layout.full_kv)
    if not layout.profile.gpus:
        return f"full KV ({size}) in RAM with the model"
    bits = (f"int8 codes and a scale per token and KV head, {layout.full_kv_per_token / layout.kv_per_token:.2f}x "
            f"the bytes of {layout.dtype}")
    if layout.kv_on_chip:
        return f"full KV ({size}) in 8 bits on {layout.kv_device()} with its layers: {bits}" if layout.kv_int8 else \
            f"full KV ({size}) on {layout.kv_device()} with its layers"
    h2d = slowest(layout, "host_to_device_bytes_per_s")
    cost = f", about {layout.streamed_kv / h2d:.2f} s per full verification at the measured {human_size(h2d)}/s" \
        if h2d else ""
    stored = f" in 8 bits ({bits})" if layout.kv_int8 else ""
    if layout.kv_resident_layers:
        layers = layout.pair.target.layers
        return (f"full KV ({size}){stored} split: {layout.kv_resident_layers} of {layers} layers' "
                f"({human_size(layout.resident_kv)}) on {layout.target_devices[0]} with their weights, what fits; "
                f"the other {layers - layout.kv_resident_layers} layers' ({human_size(layout.streamed_kv)}) offloaded "
                f"to pinned CPU memory and streamed layer by layer{cost}")
    return (f"full KV ({size}){stored} offloaded to pinned CPU memory and streamed layer by layer: it does not fit "
            f"next to the weights{cost}")


def kv_attention_reason(layout: Layout, reasons: dict) -> None:
    """An offloaded KV is always streamed to the GPU: the plan chooses only paths measured end to
    end, and attention on the CPU where the KV lies was not one of them (bench/2026-11-22-h100-offload.json).
    An 8-bit KV is dequantized before attention, priced as measured (efficiency.py)."""
    if layout.kv_int8:
        streamed = "" if layout.kv_on_chip else "streamed to the GPU as stored, "
        reasons["kv_attention"] = (f"8-bit KV {streamed}dequantized to a {layout.dtype} copy per layer, then "
                                   f"attended: priced as measured, about 9x the attention time of a {layout.dtype} "
                                   f"KV (H100, 32-128K); "
                                   f"a fused kernel would read about 1 byte per value")
    elif layout.profile.gpus and not layout.kv_on_chip:
        reasons["kv_attention"] = ("offloaded KV streamed to the GPU for attention: attending on the CPU where it lies "
                                   "measured 17.8x slower end to end (H100, 128K), against 1.01x the link's floor")


def draft_cache_reason(layout: Layout) -> str:
    return (f"StreamingLLM: {DRAFT_SINKS} attention sinks + the last {layout.draft_window:,} tokens, so a draft step "
            f"costs the same at any context length")


def prefill_reason(layout: Layout) -> str:
    chunk = layout.prefill_chunk
    act = human_size(activation_bytes(layout.pair.target, chunk, layout.dtype_bytes))
    if not layout.profile.gpus:
        return f"{chunk:,} tokens per forward, as the engine's prefill; activations about {act}"
    if layout.kv_on_chip:
        return f"{chunk:,} tokens per forward keep the GPU busy; activations about {act}"
    # Chunk i streams the KV of the i chunks before it: C^2 / (2 P) tokens' KV in all.
    moved = layout.context ** 2 / (2 * chunk) * layout.streamed_kv / layout.context
    h2d = slowest(layout, "host_to_device_bytes_per_s")
    time = f", about {moved / h2d:.1f} s at the measured bandwidth" if h2d else ""
    return (f"{chunk:,} tokens per forward, the largest that fits: every chunk re-streams the offloaded KV "
            f"written before it ({human_size(moved)} in all{time}); activations about {act}")
