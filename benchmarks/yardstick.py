"""The drafter yardstick (`specchat bench --suite yardstick`): tokens committed per target forward
at fixed verification sizes, for several model-free drafters side by side. Hardware-independent
and exact for greedy decoding: the target's greedy answer to each document is computed once, then
replayed; at each step the drafter proposes a tree within the node budget, the target would accept
the deepest path that matches the answer, and commits that many tokens plus its own next one.

Convention, the same for every drafter: a budget of N nodes is the verified tokens, root included
(the last committed token), so a chain holds N - 1 draft tokens. The forward that yields the first
answer token (the prefill's last position) counts like the others, so plain decoding scores 1.00.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable

import torch

from ..core.engine import Engine, Finished
from ..core.request import Request
from ..core.sampling import SamplingParams
from ..core.speculative.drafters import PromptLookupDrafter
from ..core.speculative.suffix_drafter import SuffixDrafter
from .ngram_peers import LlamaNgramMod, hf_prompt_lookup, llama_ngram_simple
from .report import device_label, write_report

NODE_BUDGETS = (4, 8, 16, 64)
Draft = tuple[list[int], list[int]]  # (parents, tokens): node 0 is the root, parents[0] = -1
Propose = Callable[[torch.Tensor], "Draft | None"]  # committed ids -> a tree within the budget, or None
DrafterFactory = Callable[[int], Propose]  # make(nodes): a fresh proposer for one answer at that budget


@dataclass
class StandInState:
    """The part of a DecodeState the model-free drafters read: the committed text and the sampling."""
    ids: torch.Tensor
    params: SamplingParams = field(default_factory=SamplingParams)


def chain_draft(root: int, tokens: list[int]) -> Draft:
    return [-1] + list(range(len(tokens))), [root] + tokens


def chain_drafter(propose_chain: Callable[[torch.Tensor, int], list[int]]) -> DrafterFactory:
    """A chain source as a proposer: `propose_chain(ids, most)` gives at most `most` draft tokens."""
    def make(nodes: int) -> Propose:
        def propose(ids: torch.Tensor) -> Draft | None:
            drafted = propose_chain(ids, nodes - 1)[:nodes - 1]
            return chain_draft(int(ids[-1]), drafted) if drafted else None
        return propose
    return make


def trim_depth_first(parents: list[int], tokens: list[int], nodes: int) -> Draft:
    """The tree's first `nodes` nodes in depth-first order, first child first (a tree drafter lists
    its likeliest branch first): what a drafter with a larger tree would verify at this budget."""
    children: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        children[parents[node]].append(node)
    kept, stack = [], [0]
    while stack and len(kept) < nodes:
        node = stack.pop()
        kept.append(node)
        stack.extend(reversed(children[node]))
    kept.sort()  # breadth-first numbering kept: parents before children
    index = {node: i for i, node in enumerate(kept)}
    return [-1] + [index[parents[node]] for node in kept[1:]], [tokens[node] for node in kept]


def tree_drafter(make_tree_drafter: Callable[[int], object]) -> DrafterFactory:
    """A specchat TreeDrafter (`prepare`, `propose_tree`) as a proposer, trimmed to the budget."""
    def make(nodes: int) -> Propose:
        drafter = make_tree_drafter(nodes)

        def propose(ids: torch.Tensor) -> Draft | None:
            state = StandInState(ids)
            drafter.prepare(state)
            proposal = drafter.propose_tree(state, nodes)
            if proposal is None or proposal.tree.size == 1:
                return None
            return trim_depth_first(list(proposal.tree.parents), proposal.tokens.tolist(), nodes)
        return propose
    return make


def drafters(eos_ids: frozenset[int]) -> dict[str, tuple[str, DrafterFactory]]:
    """Every drafter compared, with the settings it runs with."""
    lookup = PromptLookupDrafter(min_ngram=1)
    entries = {
        "specchat lookup (chain)": ("PromptLookupDrafter(min_ngram=1), chain mode's drafter; fixed length "
                                    "instead of the cost model's choice",
                                    chain_drafter(lambda ids, most: _tokens(lookup.propose(ids, most)))),
    }
    for num in (3, 10):
        entries[f"HF prompt lookup ({num})"] = (
            f"transformers PromptLookupCandidateGenerator rules, num_output_tokens={num}, max_matching_ngram_size=2",
            chain_drafter(lambda ids, most, num=num: hf_prompt_lookup(ids, min(num, most), eos_ids=eos_ids)))
    entries["llama.cpp ngram-simple"] = ("ngram-simple rules, size_n=12, size_m=48 (defaults), cut to the budget",
                                         chain_drafter(lambda ids, most: llama_ngram_simple(ids)))
    entries["llama.cpp ngram-simple (n=3)"] = ("ngram-simple rules, size_n=3, size_m=48, cut to the budget",
                                               chain_drafter(lambda ids, most: llama_ngram_simple(ids, size_n=3)))
    entries["llama.cpp ngram-mod"] = ("ngram-mod rules, n_match=24, n_min=48, n_max=64 (defaults), exact table, "
                                      "cut to the budget", _ngram_mod)
    entries["suffix (tree)"] = ("SuffixDrafter(max_nodes=budget), tree mode's drafter; no answer history",
                                tree_drafter(lambda nodes: SuffixDrafter(max_nodes=nodes)))
    entries["suffix (chain)"] = ("SuffixDrafter.draft, no answer history",
                                 _suffix_chain(lambda: SuffixDrafter()))
    return entries


def _tokens(proposal) -> list[int]:
    return proposal.tokens.tolist() if proposal is not None else []


def _ngram_mod(nodes: int) -> Propose:
    """A fresh table per answer: llama.cpp's is filled from each request's prompt."""
    mod = LlamaNgramMod()
    return chain_drafter(lambda ids, most: mod.draft(ids))(nodes)


def _suffix_chain(make_drafter) -> DrafterFactory:
    def make(nodes: int) -> Propose:
        drafter = make_drafter()
        return chain_drafter(lambda ids, most: _tokens(drafter.draft(StandInState(ids), ids, most)))(nodes)
    return make


def accepted_depth(parents: list[int], tokens: list[int], expected: list[int]) -> int:
    """The deepest path from the root whose tokens are `expected`'s first ones."""
    depth = [0] * len(parents)
    matches = [True] + [False] * (len(parents) - 1)
    best = 0
    for node in range(1, len(parents)):  # parents come before their children
        parent = parents[node]
        depth[node] = depth[parent] + 1
        matches[node] = (matches[parent] and depth[node] <= len(expected)
                         and tokens[node] == expected[depth[node] - 1])
        if matches[node]:
            best = max(best, depth[node])
    return best


def replay(propose: Propose, prompt_ids: list[int], answer: list[int]) -> dict:
    """Target forwards to commit `answer` after `prompt_ids` with this proposer, and the nodes they verified."""
    if not answer:
        raise ValueError("the target answered nothing: there is no answer to replay")
    committed, forwards, nodes = 0, 0, 0
    text = torch.tensor(prompt_ids + answer)
    while committed < len(answer):
        draft = propose(text[:len(prompt_ids) + committed])
        accepted = 0
        if draft is not None:
            accepted = accepted_depth(*draft, answer[committed:])
            nodes += len(draft[0])
        else:
            nodes += 1
        committed += min(accepted + 1, len(answer) - committed)
        forwards += 1
    return {"forwards": forwards, "tokens_per_forward": len(answer) / forwards, "mean_nodes": nodes / forwards}


def plain_answer(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's greedy answer (its end-of-turn token excluded): the continuation every drafter is scored on."""
    events = engine.generate(prompt_ids, Request(max_new_tokens, SamplingParams(), "plain"))
    return next(event.result for event in events if isinstance(event, Finished)).token_ids


def measure(prompts: dict[str, list[int]], answers: dict[str, list[int]],
            eos_ids: frozenset[int], budgets=NODE_BUDGETS) -> dict:
    """Per document, per drafter and budget: tokens per forward and mean nodes verified; and the
    mean over documents of tokens per forward."""
    compared = drafters(eos_ids)
    documents = {}
    for name, prompt_ids in prompts.items():
        rows = {label: {str(nodes): replay(make(nodes), prompt_ids, answers[name]) for nodes in budgets}
                for label, (_, make) in compared.items()}
        documents[name] = {"prompt_tokens": len(prompt_ids), "answer_tokens": len(answers[name]),
                           "answer_ids": answers[name], "drafters": rows}
    mean = {label: {str(nodes): statistics.mean(doc["drafters"][label][str(nodes)]["tokens_per_forward"]
                                                for doc in documents.values()) for nodes in budgets}
            for label in compared}
    return {"node_budgets": list(budgets), "drafters": {label: about for label, (about, _) in compared.items()},
            "documents": documents, "mean_tokens_per_forward": mean}


def run_yardstick(engine: Engine, prompts: dict[str, list[int]], max_new_tokens: int, out_dir: Path) -> list[Path]:
    """`prompts`: document name -> prompt ids (the document and its question, chat-templated)."""
    answers = {name: plain_answer(engine, prompt_ids, max_new_tokens) for name, prompt_ids in prompts.items()}
    report = {"date": date.today().isoformat(), "device": device_label(), "model": engine.name,
              "max_new_tokens": max_new_tokens,
              "method": "greedy answer replayed; nodes = verified tokens including the root; "
                        "tokens per forward = answer tokens / target forwards (plain = 1.00)",
              **measure(prompts, answers, frozenset(engine.stop_ids))}
    return write_report(report, out_dir, ("gpu" if torch.cuda.is_available() else "cpu") + "-yardstick",
                        _draw_yardstick)


def _draw_yardstick(report: dict, plt):
    figure, (means, per_document) = plt.subplots(1, 2, figsize=(14, 5.5))
    budgets = report["node_budgets"]
    for label, values in report["mean_tokens_per_forward"].items():
        means.plot(budgets, [values[str(nodes)] for nodes in budgets], marker="o", label=label)
    means.set(xscale="log", xlabel="verified nodes per forward (root included)",
              ylabel="tokens committed per target forward (mean over documents)")
    means.minorticks_off()
    means.set_xticks(budgets, [str(nodes) for nodes in budgets])
    means.set_title(f"{report['model']}, greedy, {report['max_new_tokens']} tokens per answer", fontsize=9)
    means.legend(fontsize=7)
    names, labels, nodes = list(report["documents"]), list(report["drafters"]), str(budgets[min(2, len(budgets) - 1)])
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        per_document.bar([x + i * width for x in range(len(names))],
                         [report["documents"][name]["drafters"][label][nodes]["tokens_per_forward"] for name in names],
                         width, label=label)
    per_document.axhline(1.0, color="gray", linewidth=0.8)
    per_document.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, fontsize=7)
    per_document.set_ylabel(f"tokens per forward at {nodes} nodes")
    per_document.set_title("per document (colours as on the left)", fontsize=9)
    return figure
