"""The prefill benchmark: what a user waits for before the first token of an answer about a
document. In one process, one after the other: a single transformers forward over the whole
prompt (the throughput to match), the first question (chunked prefill, document saved), a
follow-up (KV reused from memory), the follow-up from scratch (its reference output), and the
follow-up in a restarted engine (document loaded from disk). Outputs must be identical."""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path

import torch

from ..core.engine import Engine, Finished
from ..core.request import Request
from ..core.kv.document_store import DocumentStore
from ..core.kv.prefix_store import PrefixStore, common_prefix_length
from ..core.sampling import SamplingParams
from .report import device_label, write_report

UNLIMITED = 10**12


def single_forward_seconds(engine: Engine, prompt_ids: list[int]) -> float:
    """One transformers forward over the whole prompt, building its KV: the yardstick."""
    hf = engine.model.hf
    with torch.inference_mode():
        started = time.perf_counter()
        hf(input_ids=torch.tensor([prompt_ids], device=hf.device), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - started


def run_prefill_bench(engine: Engine, messages_for, max_new_tokens: int, out_dir: Path) -> list[Path]:
    """`messages_for(question, history)` builds a conversation about the document; the same
    model serves every run, each run gets the caches its scenario allows."""
    work = Path(tempfile.mkdtemp(prefix="specchat-bench-"))

    def fresh(documents: bool) -> Engine:
        store = DocumentStore(work, "bench", UNLIMITED) if documents else None
        return Engine(engine.model, engine.tokenizer, engine.name, prefixes=PrefixStore(UNLIMITED), documents=store,
                      settings=engine.settings)

    def answer(target: Engine, messages: list[dict], document_tokens: int = 0):
        ids = target.chat_ids(messages)
        return ids, next(e.result for e in target.generate(ids, Request(max_new_tokens, SamplingParams(), "plain",
                                                                          document_tokens=document_tokens))
                         if isinstance(e, Finished))

    first_messages = messages_for("Summarize this document in two sentences.", [])
    first_ids = engine.chat_ids(first_messages)
    probe_a = engine.chat_ids(messages_for("A?", []))
    document_tokens = common_prefix_length(first_ids, probe_a)
    single = single_forward_seconds(engine, first_ids)

    live = fresh(documents=True)
    _, first = answer(live, first_messages, document_tokens)
    follow_messages = messages_for("Who publishes it, and what may users do with it?",
                                   first_messages + [{"role": "assistant", "content": first.text}])
    follow_ids, follow_up = answer(live, follow_messages)
    _, from_scratch = answer(fresh(documents=False), follow_messages)
    _, reloaded = answer(fresh(documents=True), follow_messages)

    def row(result) -> dict:
        return {"time_to_first_token_seconds": result.stats.prefill_seconds,
                "prompt_tokens": result.prompt_tokens, "reused_prompt_tokens": result.stats.reused_prompt_tokens,
                "reused_from": result.stats.reused_from,
                "identical_to_from_scratch": result.token_ids == from_scratch.token_ids}

    report = {
        "date": date.today().isoformat(), "device": device_label(), "model": engine.name,
        "document_tokens": document_tokens, "max_new_tokens": max_new_tokens,
        "prefill": {"single_forward_seconds": single, "chunked_seconds": first.stats.prefill_seconds,
                    "chunk_tokens": engine.settings.prefill_chunk, "prompt_tokens": first.prompt_tokens,
                    "chunked_over_single": first.stats.prefill_seconds / single},
        "first_question": {**row(first), "identical_to_from_scratch": None},
        "follow_up": row(follow_up),
        "follow_up_from_scratch": row(from_scratch),
        "reloaded_document_after_restart": row(reloaded),
        "follow_up_ttft_over_first": follow_up.stats.prefill_seconds / first.stats.prefill_seconds,
        "reloaded_ttft_over_from_scratch": reloaded.stats.prefill_seconds / from_scratch.stats.prefill_seconds,
        "saved_document_bytes": sum(path.stat().st_size for path in work.glob("*.safetensors")),
        "first_stats": asdict(first.stats),
    }
    for path in work.glob("*"):
        path.unlink()
    work.rmdir()
    stem = "cpu-prefill" if not torch.cuda.is_available() else "gpu-prefill"
    return write_report(report, out_dir, stem, _draw)


def _draw(report: dict, plt):
    figure, axis = plt.subplots(figsize=(8, 4.5))
    rows = {"first question": report["first_question"], "follow-up (KV reused)": report["follow_up"],
            "follow-up from scratch": report["follow_up_from_scratch"],
            "document reloaded\nafter a restart": report["reloaded_document_after_restart"]}
    seconds = [row["time_to_first_token_seconds"] for row in rows.values()]
    bars = axis.bar(list(rows), seconds, color=["#888", "#2a7", "#888", "#27a"])
    for bar, value in zip(bars, seconds):
        axis.annotate(f"{value:.2f} s", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    axis.set_ylabel("time to first token (s)")
    same = all(row["identical_to_from_scratch"] is not False for row in rows.values())
    axis.set_title(f"{report['model']}, {report['document_tokens']:,}-token document, {report['device']}\n"
                   f"chunked prefill {report['prefill']['chunked_over_single']:.2f}x a single forward; "
                   + ("outputs identical to from-scratch" if same else "OUTPUTS DIFFER"), fontsize=9)
    return figure
