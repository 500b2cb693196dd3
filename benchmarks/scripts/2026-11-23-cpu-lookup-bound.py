"""How far prompt-lookup speculation can go on this CPU (issue 15's 2.0x median question), from
the measured t(n) and the measured acceptance of every draft.

For each auto-suite document: the greedy answer (128 tokens, embedded model, the suite's prompt),
and t(n) at the document's context from this machine's calibration (the curves the cost model
and its predictions use, measured at 256-8K positions for n <= 17 and extended beyond; each n
priced at the cheapest n' >= n, so a dip in the curve only raises the bounds). Measuring t(n)
afresh here proved fragile: a busy spell of the VM shrinks the ratios (t(2) once came out 0.87,
another time 1.12 where calibration and earlier runs give 1.2-1.4) and the bounds swing with it.
Then, in plain steps' time (forwards only), against plain decoding's one forward a token:
- replayed: the product's chain decoder (the one auto runs on these documents: its drafter, its
  cost-model lookahead) stepping over the recorded answer, each step priced at t(rows verified):
  the cost model's own figure for auto, next to the measured ratio in the newest
  `bench/*-cpu-auto.json` (the difference: what a step costs beyond its forward).
- measured_rates: the cost model with the answer's measured acceptance (issue 15's "cost model's
  bound from measured acceptance and t(n)"): the same drafter's proposal at every position, cut to
  the g maximizing E(g) / t(g + 1), with E from the acceptance rates of the whole answer per
  proposal kind (match length) and draft position, known from the first step (no prior, no
  fading): the product's policy with exact rates instead of running estimates. A policy that
  chooses from acceptance rates does no better on average; only foresight of each draft does.
- drafter_hindsight: the same drafter's proposal at every position, each cut to the length that
  the target will accept, chosen knowing it: the best any draft-length policy could do with
  these drafts.
- tree_hindsight: trees of the 2, 3 or 4 continuations that most of the latest earlier
  occurrences of that drafter's match go on with (lookup tree branches, unigram matches
  included), each cut to the depth that pays best knowing how much of its best branch the
  target will accept; verifying costs t(nodes + 1). The best of the three widths per document.
- all_occurrences: an oracle that also picks, among all earlier occurrences of the context's last
  token, the one whose continuation agrees longest with the answer to come: a bound for every
  prompt-lookup chain or tree, since a tree of lookup drafts holds at most that continuation's
  agreeing part and verifying it costs at least t(agreeing + 1).
The answer's first token comes from the prefill, so every figure counts the other tokens.
Writes bench/<today>-cpu-lookup-bound.json.
Run: .venv/bin/python benchmarks/scripts/2026-11-23-cpu-lookup-bound.py
"""

import json
import statistics
import sys
from collections import Counter
from datetime import date
from pathlib import Path

import torch

from specchat.app.documents import user_turn
from specchat.benchmarks.decode import timed_answer
from specchat.benchmarks.report import device_label
from specchat.core.decoding import DecodeState, make_decoder
from specchat.core.loading import load_engine
from specchat.core.sampling import SamplingParams
from specchat.core.speculative.drafters import VOTERS
from specchat.core.speculative.lookahead import MAX_DRAFT

NEW_TOKENS = 128
DATA = Path(__file__).parent.parent / "tests" / "data"
MOST_ROWS = 4 * MAX_DRAFT + 1  # the widest tree below, with its root
DOCUMENTS = ["apache-2.0.txt", "documents/numpy-ma-readme.rst", "documents/mpl-2.0.txt",
             "documents/http-proxy-readme.md", "documents/lgpl-2.1.txt", "gpl-3.0.txt"]


class AnswerReplay:
    """A stand-in target whose every row predicts the recorded answer's next token: the chain
    decoder's own step code runs over it, without the model."""

    def __init__(self, prompt_tokens: int, answer: list[int], vocab_size: int):
        self.prompt_tokens, self.answer, self.vocab_size = prompt_tokens, answer, vocab_size

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache, **_) -> torch.Tensor:
        logits = torch.zeros(ids.shape[0], self.vocab_size)
        for row, position in enumerate(positions.tolist()):
            logits[row, self.answer[position + 1 - self.prompt_tokens]] = 1.0
        return logits


class NoCache:
    def trim(self, length: int) -> None:
        pass


def replayed_units(decoder, prompt: list[int], answer: list[int], vocab_size: int, cost: dict[int, float]) -> float:
    """One-token forwards' worth of time the decoder takes for answer[1:]."""
    state = DecodeState(AnswerReplay(len(prompt), answer, vocab_size), NoCache(),
                        torch.tensor(prompt + answer[:1]), SamplingParams(), torch.Generator())
    units = 0.0
    while state.ids.shape[0] < len(prompt) + len(answer):
        step = decoder.step(state, len(prompt) + len(answer) - state.ids.shape[0])
        units += cost[step.verified]
    assert state.ids[len(prompt):].tolist() == answer, "the replay must commit the recorded answer"
    return units


def agreeing(draft: list[int], coming: list[int]) -> int:
    run = 0
    while run < min(len(draft), len(coming)) and draft[run] == coming[run]:
        run += 1
    return run


def drafter_proposals(drafter, prompt: list[int], answer: list[int]) -> list[tuple[int, int, int]]:
    """For answer positions 1..: (the proposal's kind, its length, how many of it the answer goes
    on with); (0, 0, 0) where the drafter has nothing."""
    found = []
    for i in range(1, len(answer)):
        proposal = drafter.draft(None, torch.tensor(prompt + answer[:i]), MAX_DRAFT)
        if proposal is None:
            found.append((0, 0, 0))
            continue
        tokens = proposal.tokens.tolist()
        found.append((proposal.kind, len(tokens), agreeing(tokens, answer[i:i + MAX_DRAFT])))
    return found


def measured_rates(proposals: list[tuple[int, int, int]]) -> dict[int, list[float]]:
    """Per kind, a_j for draft positions j = 0..: of the proposals long enough whose first j
    drafts were accepted, the share whose draft j was too."""
    rates = {}
    for kind in {kind for kind, length, _ in proposals if length}:
        mine = [(length, agree) for k, length, agree in proposals if k == kind and length]
        reached = [sum(1 for length, agree in mine if length > j and agree >= j) for j in range(MAX_DRAFT)]
        taken = [sum(1 for length, agree in mine if length > j and agree > j) for j in range(MAX_DRAFT)]
        rates[kind] = [t / r if r else 0.0 for t, r in zip(taken, reached)]
    return rates


def measured_rates_units(proposals: list[tuple[int, int, int]], cost: dict[int, float]) -> float:
    """One-token forwards' worth of time for the tokens after the first, each step verifying the
    g drafts that maximize E(g) / t(g + 1) under `measured_rates` (g = 0: a plain step)."""
    rates = measured_rates(proposals)
    units, i, count = 0.0, 0, len(proposals)
    while i < count:
        kind, length, agree = proposals[i]
        best, best_rate, expected, reach = 0, 1.0, 1.0, 1.0
        for g in range(1, min(length, count - i - 1) + 1):
            reach *= rates[kind][g - 1]
            expected += reach
            if expected / cost[g + 1] > best_rate:
                best, best_rate = g, expected / cost[g + 1]
        units += cost[best + 1]
        i += min(best, agree) + 1
    return units


def tree_options(drafter, prompt: list[int], answer: list[int], width: int) -> list[list[tuple[int, int]]]:
    """For answer positions 1.., per depth 0..MAX_DRAFT: (nodes of the tree of the `width` most
    frequent continuations cut at that depth, tokens its best branch gets accepted)."""
    options = []
    for i in range(1, len(answer)):
        continuations = drafter.continuations(torch.tensor(prompt + answer[:i]), MAX_DRAFT, VOTERS)
        frequent = Counter(tuple(c.tolist()) for c in continuations).most_common(width)
        branches = [list(branch) for branch, _ in frequent]
        coming = answer[i:i + MAX_DRAFT]
        options.append([(len({tuple(b[:k]) for b in branches for k in range(1, min(depth, len(b)) + 1)}),
                         max([min(agreeing(b, coming), depth) for b in branches], default=0))
                        for depth in range(MAX_DRAFT + 1)])
    return options


def oracle_accepts(prompt: list[int], answer: list[int]) -> list[int]:
    """For answer positions 1.., the longest run of the coming answer tokens that a continuation
    after an earlier occurrence of the context's last token reproduces."""
    accepts = []
    for i in range(1, len(answer)):
        context = prompt + answer[:i]
        coming = answer[i:i + MAX_DRAFT]
        best = 0
        for j in range(1, len(context)):
            if context[j - 1] == context[-1]:
                best = max(best, agreeing(context[j:], coming))
                if best == len(coming):
                    break
        accepts.append(best)
    return accepts


def fewest_units(options: list[list[tuple[int, int]]], cost: dict[int, float]) -> float:
    """The least total cost (in one-token forwards) of the tokens after the first, each step
    picking one of its (draft nodes, accepted) options (never gaining past the answer's end) and
    gaining the accepted tokens plus the target's own."""
    count = len(options)
    best = [0.0] * (count + 1)
    for i in range(count - 1, -1, -1):
        best[i] = min(cost[nodes + 1] + best[i + min(accepted, count - 1 - i) + 1]
                      for nodes, accepted in options[i])
    return best[0]


def chain_options(accepts: list[int]) -> list[list[tuple[int, int]]]:
    """A chain's options: draft any 0..accepts[i] tokens, all accepted."""
    return [[(a, a) for a in range(most + 1)] for most in accepts]


def main() -> None:
    engine = load_engine("embedded")
    vocab = engine.model.vocab_size
    relative = engine.settings.step_times.relative
    auto_report = sorted(Path(__file__).parent.glob("*-cpu-auto.json"))[-1]
    measured = json.loads(auto_report.read_text())["documents"]
    rows = {}
    for name in DOCUMENTS:
        text = (DATA / name).read_text()
        prompt = engine.chat_ids([{"role": "user", "content": user_turn("Summarize this document.", text)}])
        answer = timed_answer(engine, prompt, NEW_TOKENS, ("plain", None)).token_ids
        curve = [relative(n, len(prompt)) for n in range(1, MOST_ROWS + 1)]
        cost = {n: min(curve[n - 1:]) for n in range(1, MOST_ROWS + 1)}
        tokens = len(answer) - 1
        chain = make_decoder("chain", relative, engine.settings.chain_drafts)
        replayed = tokens / replayed_units(chain, prompt, answer, vocab, cost)
        proposals = drafter_proposals(chain.drafter, prompt, answer)
        rated = tokens / measured_rates_units(proposals, cost)
        hindsight = tokens / fewest_units(chain_options([agree for _, _, agree in proposals]), cost)
        tree = max(tokens / fewest_units(tree_options(chain.drafter, prompt, answer, width), cost)
                   for width in (2, 3, 4))
        oracle = tokens / fewest_units(chain_options(oracle_accepts(prompt, answer)), cost)
        short = Path(name).name
        rows[short] = {
            "prompt_tokens": len(prompt), "answer_tokens": len(answer),
            "t_ratios": {str(n): round(cost[n], 3) for n in (1, 2, 3, 4, 5, 6, 8, 12, 17, 32, MOST_ROWS)},
            "auto_over_plain_measured": round(measured.get(short, {}).get("speedup_over_plain", {}).get("auto", float("nan")), 3),
            "replayed_over_plain": round(replayed, 3),
            "measured_rates_bound": round(rated, 3),
            "drafter_hindsight_bound": round(hindsight, 3),
            "tree_hindsight_bound": round(tree, 3),
            "all_occurrences_bound": round(oracle, 3),
        }
        print(short, rows[short], flush=True)
    report = {
        "date": date.today().isoformat(), "device": device_label(), "model": engine.name,
        "max_draft": MAX_DRAFT, "new_tokens": NEW_TOKENS, "measured_in": auto_report.name,
        "what": __doc__.split("Writes")[0].strip(),
        "documents": rows,
        "medians": {key: statistics.median(row[key] for row in rows.values())
                    for key in ("auto_over_plain_measured", "replayed_over_plain", "measured_rates_bound",
                                "drafter_hindsight_bound", "tree_hindsight_bound", "all_occurrences_bound")},
    }
    out = Path(__file__).parent / f"{date.today().isoformat()}-cpu-lookup-bound.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(out, report["medians"], file=sys.stderr)


if __name__ == "__main__":
    main()
