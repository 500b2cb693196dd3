"""Issue 38: the retrieval stage's choice by chunk mean keys (over an offloaded KV: no key streamed
per rebuild) against today's exact attention share, on the embedded model. Along the target's own
greedy answer, at each position: does a 1K retrieval cache built by each scoring give the
target's next token? (What the retrieval stage's drafts are accepted by, without the chain.)
Run: SPECCHAT_CALIBRATE=0 .venv/bin/python benchmarks/scripts/2026-11-28-cpu-retrieval-scoring.py
"""

import json
import time
from pathlib import Path

import torch

from specchat.benchmarks.report import device_label
from specchat.core.engine import Finished
from specchat.core.kv.offload import OffloadedCache
from specchat.core.kv.retrieval import RetrievalCache
from specchat.core.loading import load_engine
from specchat.core.request import Request
from specchat.core.sampling import SamplingParams

BUDGET, RECENT, NEW_TOKENS = 1024, 64, 128
DATA = Path("tests/data")
PASSPHRASE = "violet kangaroo 7342"


def documents(engine) -> dict[str, list[int]]:
    licence = (DATA / "gpl-3.0.txt").read_text()
    middle = licence.find("\n\n", len(licence) // 2)
    needle = licence[:middle] + f'\n\nThe secret passphrase is "{PASSPHRASE}". Remember it.' + licence[middle:]
    question = "What is the secret passphrase mentioned in the document above? Then summarize the document."
    lgpl = (DATA / "documents" / "lgpl-2.1.txt").read_text()
    return {"gpl-3.0 with a needle": engine.chat_ids([{"role": "user", "content": f"{needle}\n\n{question}"}]),
            "lgpl-2.1": engine.chat_ids([{"role": "user", "content": f"{lgpl}\n\nSummarize this document."}])}


def agreement(model, ids, answer, scorings) -> dict[str, float]:
    """Per scoring, the share of answer positions where the retrieval cache's argmax is the target's."""
    full = model.new_cache()
    for start in range(0, len(ids) - 1, 1024):
        end = min(len(ids) - 1, start + 1024)
        model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), full, last_only=True)
    inputs = [ids[-1]] + answer[:-1]
    _, queries = model.forward_with_queries(torch.tensor(inputs), torch.arange(len(ids) - 1, len(ids) - 1 + len(inputs)),
                                            full)
    offloaded = OffloadedCache(model.config, full.length, "cpu", model.dtype)
    offloaded.fill(full.layers(), full.length)
    hits = {name: 0 for name in scorings}
    for i in reversed(range(len(inputs))):  # the offloaded copy only trims: longest first
        length = len(ids) - 1 + i
        offloaded.trim(length)
        last = {layer: q[0, :, max(i - 1, 0)] for layer, q in queries.items()}
        for name, build in scorings.items():
            cache = build(full, offloaded, length, last)
            logits = model.forward(torch.tensor([inputs[i]]), torch.tensor([length]), cache)
            hits[name] += int(logits[-1].argmax()) == answer[i]
    return {name: count / len(inputs) for name, count in hits.items()}


def main() -> None:
    engine = load_engine("embedded", progress=lambda line: None)
    model = engine.model
    scorings = {
        "exact share, 8-token chunks (today)": lambda full, off, length, q: RetrievalCache.build(
            model.config, full.layers(length), q, BUDGET, 8, RECENT),
        "mean keys, 8-token chunks": lambda full, off, length, q: RetrievalCache.from_offloaded(
            off, q, BUDGET, 8, RECENT, "cpu"),
        "mean keys, 16-token chunks (the offloaded plan's)": lambda full, off, length, q: RetrievalCache.from_offloaded(
            off, q, BUDGET, 16, RECENT, "cpu"),
    }
    report = {"date": time.strftime("%Y-%m-%d"), "device": device_label(),
              "model": engine.name, "budget": BUDGET, "recent": RECENT, "answer_tokens": NEW_TOKENS,
              "method": "teacher forcing along the target's greedy answer: the share of positions where a retrieval "
                        "cache of BUDGET positions, chosen with the previous position's queries, gives the target's "
                        "next token (its argmax)", "documents": {}}
    for name, ids in documents(engine).items():
        events = list(engine.generate(ids, Request(NEW_TOKENS, SamplingParams(), "plain")))
        answer = next(e.result for e in events if isinstance(e, Finished)).token_ids
        started = time.perf_counter()
        report["documents"][name] = {"prompt_tokens": len(ids), "agreement": agreement(model, ids, answer, scorings)}
        print(name, report["documents"][name], f"{time.perf_counter() - started:.0f} s", flush=True)
    out = Path("bench") / f"{report['date']}-cpu-retrieval-scoring.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
