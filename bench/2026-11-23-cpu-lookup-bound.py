"""The most any prompt-lookup drafter could gain on this CPU (issue 15's 2.0x median question).

For each auto-suite document: the greedy answer (128 tokens, embedded model, the suite's prompt),
then an oracle that, before every verification, knows which continuation in the context (prompt
and answer so far) after an occurrence of the last token agrees longest with the answer to come,
and drafts exactly that many tokens (at most MAX_DRAFT). Every chain or tree of lookup drafts
(any n-gram length >= 1, the chain drafter's family) holds at most that continuation's agreeing
part, and verifying it costs at least t(a + 1); so the fewest one-token-forward units the answer
can cost (a DP over the oracle's steps, drafting free) bounds the speedup of every lookup mode
from above. t(n) is measured here at each document's context (the cheapest of n..MAX_DRAFT + 1
rows, so noise only raises the bound), next to the newest `bench/*-cpu-auto.json`'s measured
ratios. Writes bench/<today>-cpu-lookup-bound.json.
Run: .venv/bin/python bench/2026-11-23-cpu-lookup-bound.py
"""

import json
import statistics
import sys
from datetime import date
from pathlib import Path

from specchat.app.documents import user_turn
from specchat.core.bench import _answer, device_label
from specchat.core.loading import load_engine
from specchat.core.spec.optimizer import measure_forward_times

MAX_DRAFT = 7
NEW_TOKENS = 128
DATA = Path(__file__).parent.parent / "tests" / "data"
DOCUMENTS = ["apache-2.0.txt", "documents/numpy-ma-readme.rst", "documents/mpl-2.0.txt",
             "documents/http-proxy-readme.md", "documents/lgpl-2.1.txt", "gpl-3.0.txt"]


def oracle_accepts(prompt: list[int], answer: list[int]) -> list[int]:
    """For each answer position, the longest run of the coming answer tokens that a continuation
    after an earlier occurrence of the context's last token reproduces (capped at MAX_DRAFT)."""
    accepts = []
    for i in range(len(answer)):
        context = prompt + answer[:i]
        coming = answer[i:i + MAX_DRAFT]
        best = 0
        for j in range(1, len(context)):
            if context[j - 1] != context[-1]:
                continue
            run = 0
            while run < len(coming) and j + run < len(context) and context[j + run] == coming[run]:
                run += 1
            best = max(best, run)
            if best == len(coming):
                break
        accepts.append(best)
    return accepts


def fewest_units(accepts: list[int], cost: dict[int, float]) -> float:
    """The least total cost (in one-token forwards) of verifying the answer, each step drafting
    0..accepts[i] tokens and gaining that many plus the target's own token."""
    count = len(accepts)
    best = [0.0] * (count + 1)
    for i in range(count - 1, -1, -1):
        best[i] = min(cost[a + 1] + best[min(count, i + a + 1)] for a in range(accepts[i] + 1))
    return best[0]


def main() -> None:
    engine = load_engine("embedded")
    auto_report = sorted(Path(__file__).parent.glob("*-cpu-auto.json"))[-1]
    measured = json.loads(auto_report.read_text())["documents"]
    rows = {}
    for name in DOCUMENTS:
        text = (DATA / name).read_text()
        prompt = engine.chat_ids([{"role": "user", "content": user_turn("Summarize this document.", text)}])
        answer = _answer(engine, prompt, NEW_TOKENS, ("plain", None)).token_ids
        times = measure_forward_times(engine.model, len(prompt), list(range(2, MAX_DRAFT + 2)), 7)
        ratio = dict(zip(sorted({1, *range(2, MAX_DRAFT + 2)}), times.ratios))
        cheapest = {n: min(ratio[m] for m in ratio if m >= n) for n in ratio}  # noise only raises the bound
        cheapest[1] = 1.0  # a plain step is the unit
        accepts = oracle_accepts(prompt, answer)
        bound = len(answer) / fewest_units(accepts, cheapest)
        short = Path(name).name
        chain = measured.get(short, {}).get("speedup_over_plain", {})
        rows[short] = {
            "prompt_tokens": len(prompt), "answer_tokens": len(answer),
            "t_ratios": {str(n): round(r, 3) for n, r in ratio.items()},
            "oracle_tokens_per_forward_if_all_drafts_verified": round(
                len(answer) / sum(1 for _ in _steps(accepts)), 3),
            "lookup_speedup_bound": round(bound, 3),
            "auto_over_plain_measured": round(chain.get("auto", float("nan")), 3),
            "chain_over_plain_measured": round(chain.get("chain (prompt lookup)", float("nan")), 3),
        }
        print(short, rows[short], flush=True)
    bounds = [row["lookup_speedup_bound"] for row in rows.values()]
    report = {
        "date": date.today().isoformat(), "device": device_label(), "model": engine.name, "max_draft": MAX_DRAFT,
        "measured_in": auto_report.name,
        "new_tokens": NEW_TOKENS, "documents": rows,
        "lookup_speedup_bound_median": statistics.median(bounds), "lookup_speedup_bound_min": min(bounds),
    }
    out = Path(__file__).parent / f"{date.today().isoformat()}-cpu-lookup-bound.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(out, report["lookup_speedup_bound_median"], file=sys.stderr)


def _steps(accepts: list[int]):
    """The oracle's verifications when each drafts all it can (for tokens per forward)."""
    i = 0
    while i < len(accepts):
        yield i
        i += accepts[i] + 1


if __name__ == "__main__":
    main()
