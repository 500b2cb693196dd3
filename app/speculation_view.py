"""What the page shows of an answer's speculation: the figures line, the per-stage table and
the answer's tokens colored by how they were produced. Pure: stats in, Markdown or HTML out.

Text that came from outside (the answer's tokens, and from a saved file, the origins, mode and
stage names) is escaped wherever it lands, so none of it renders as HTML.
"""

from __future__ import annotations

import html

# How an answer ended (`ending`), as the figures line says it.
ENDINGS = {"stop": "done", "length": "cut off at the answer limit", "context_full": "cut off: the context is full",
           "cancelled": "stopped", "repeating": "stopped: repeating itself", "error": "cut short by an error"}
# A speed over a shorter stretch of decoding says more about timer noise than about the decoder.
MEASURING_SECONDS = 0.5
ORIGINS = {  # origin -> (legend, color); the colors stay readable on light and dark themes
    "draft": ("accepted draft token", "#2e9d5b"),
    "recovered": ("recovered after a rejection", "#d9822b"),
    "bonus": ("bonus token after a fully accepted draft", "#3b7dd8"),
    "plain": ("plain step (nothing drafted)", "#8a8a8a"),
}


def ending(message: dict) -> str | None:
    """How a saved answer ended, a key of `ENDINGS`; None while it has not ended."""
    reason = message.get("finish_reason")
    if reason == "length" and message.get("context_full"):
        return "context_full"
    return reason if reason in ENDINGS else None


def stats_line(stats: dict, mode: str, new_tokens: int | None = None, end: str | None = None) -> str:
    """One Markdown line: speed, tokens per target forward, acceptance; the end (`ending`) when
    finished. While it streams, the speed shows once there is enough of it to measure."""
    drafted, accepted = stats.get("drafted_tokens", 0), stats.get("accepted_draft_tokens", 0)
    acceptance = f" · {accepted / drafted:.0%} of draft tokens accepted" if drafted else ""
    reused = stats.get("reused_prompt_tokens", 0)
    reused_text = f" ({reused:,} prompt tokens reused)" if reused else ""
    predicted = stats.get("predicted_tokens_per_second")
    predicted_text = f" (cost model: {predicted:.1f})" if predicted else ""
    if end is not None and new_tokens == 0:  # stopped during the read: no speed to speak of
        return f"No answer: {ENDINGS[end]} while the prompt was read" + (f" · mode {_code(mode)}" if mode else "")
    measured = end is not None or stats.get("decode_seconds", 0) >= MEASURING_SECONDS
    speed = f"**{stats.get('tokens_per_second', 0):.1f} tok/s**{predicted_text}" if measured else "measuring the speed…"
    line = (f"{speed} · "
            f"**{stats.get('mean_accepted_per_forward', 0):.2f}** tokens per target forward · "
            f"{stats.get('target_forwards', 0)} target forwards{acceptance} · "
            f"first token after {stats.get('prefill_seconds', 0):.2f} s{reused_text}"
            + (f" · mode {_code(mode)}" if mode else ""))
    if end is not None:
        line += f" · {new_tokens if new_tokens is not None else '?'} tokens, {ENDINGS[end]}"
    return line


def stage_table(stats: dict) -> str:
    """Markdown table of each verifying stage: the target's full verification and, for TriForce,
    the stages below it."""
    rows = [("target (full verification)", stats.get("target_forwards", 0), stats.get("drafted_tokens", 0),
             stats.get("accepted_draft_tokens", 0), "")]
    for name, counts in stats.get("stages", {}).items():
        rows.append((name, counts.get("forwards", 0), counts.get("drafted", 0), counts.get("accepted", 0),
                     str(counts["builds"]) if "builds" in counts else ""))
    lines = ["| stage | forwards | draft tokens verified | accepted | acceptance | cache builds |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, forwards, drafted, accepted, builds in rows:
        rate = f"{accepted / drafted:.0%}" if drafted else "–"
        lines.append(f"| {_cell(name)} | {forwards} | {drafted} | {accepted} | {rate} | {builds} |")
    return "\n".join(lines)


def _code(text: str) -> str:
    """`text` as a Markdown code span that it cannot close (its content shows as typed)."""
    return f"`{' '.join(str(text).replace('`', '').split())}`"


def _cell(text: str) -> str:
    """`text` as one Markdown table cell showing as typed: no HTML, no column break, one line."""
    return html.escape(" ".join(str(text).split())).replace("|", "\\|")


def colored_tokens(pieces: list) -> str:
    """HTML of an answer's text, each token's span colored by its origin, with a legend."""
    # An origin names a class: one that is not ours (from an edited file) is shown as plain.
    spans = "".join(
        f'<span class="tok-{origin if origin in ORIGINS else "plain"}" '
        f'style="color:{ORIGINS.get(origin, ORIGINS["plain"])[1]}" title="{ORIGINS.get(origin, ORIGINS["plain"])[0]}">'
        f'{html.escape(text).replace(chr(10), "<br>")}</span>'
        for text, origin in pieces if text)
    legend = " ".join(f'<span style="color:{color}">■ {label}</span>' for label, color in ORIGINS.values())
    return (f'<div class="token-legend" style="font-size:0.85em;margin-bottom:0.5em">{legend}</div>'
            f'<div class="token-text" style="white-space:normal;line-height:1.6">{spans or "<i>no answer yet</i>"}</div>')
