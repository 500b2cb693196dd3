"""The drafter yardstick (benchmarks/yardstick.py): the replay's forward count, the peers' rules
(benchmarks/ngram_peers.py) on hand-made sequences, and the suite end to end on a tiny model."""

import json

import torch

from specchat.benchmarks.ngram_peers import LlamaNgramMod, hf_prompt_lookup, llama_ngram_simple
from specchat.benchmarks.yardstick import accepted_depth, chain_draft, replay, trim_depth_first

PROMPT = [50, 51, 52]
ANSWER = [1, 2, 3, 4, 5, 6, 7]


def oracle_chain(length):
    """Proposes the answer's next `length` tokens: every draft is accepted."""
    def propose(ids):
        done = len(ids) - len(PROMPT)
        return chain_draft(int(ids[-1]), ANSWER[done:done + length])
    return propose


def test_replay_commits_the_accepted_path_plus_one_per_forward():
    assert replay(oracle_chain(3), PROMPT, ANSWER)["forwards"] == 2  # 4 + 3 (the last forward is cut short)
    assert replay(oracle_chain(1), PROMPT, ANSWER)["forwards"] == 4  # 2 + 2 + 2 + 1
    wrong = replay(lambda ids: chain_draft(int(ids[-1]), [99, 98, 97]), PROMPT, ANSWER)
    assert wrong == {"forwards": 7, "tokens_per_forward": 1.0, "mean_nodes": 4.0}
    assert replay(lambda ids: None, PROMPT, ANSWER) == {"forwards": 7, "tokens_per_forward": 1.0, "mean_nodes": 1.0}


def test_the_deepest_matching_branch_is_accepted():
    # root -> 1 -> 9;  root -> 1 -> 2 -> 3;  root -> 8
    parents, tokens = [-1, 0, 0, 1, 1, 4], [0, 1, 8, 9, 2, 3]
    assert accepted_depth(parents, tokens, [1, 2, 3, 4]) == 3
    assert accepted_depth(parents, tokens, [1, 2]) == 2  # no deeper than the answer left
    assert accepted_depth(parents, tokens, [8, 1]) == 1
    assert accepted_depth(parents, tokens, [7]) == 0


def test_trimming_keeps_the_first_branch_whole_before_the_next():
    parents, tokens = [-1, 0, 0, 1, 2, 3], [0, 10, 20, 11, 21, 12]  # branches 10-11-12 and 20-21
    assert trim_depth_first(parents, tokens, 4) == ([-1, 0, 1, 2], [0, 10, 11, 12])
    assert trim_depth_first(parents, tokens, 5) == ([-1, 0, 0, 1, 3], [0, 10, 20, 11, 12])


def test_hf_takes_the_first_match_of_the_longest_ngram():
    ids = torch.tensor([1, 2, 3, 9, 1, 2, 4, 7, 1, 2])
    assert hf_prompt_lookup(ids, 3) == [3, 9, 1]  # (1, 2) first at 0, not the later one at 4
    assert hf_prompt_lookup(ids, 3, max_ngram=1) == [3, 9, 1]  # 2's first occurrence
    unigram = torch.tensor([5, 1, 8, 3, 6, 1])  # (6, 1) never occurred: falls back to 1 first at 1
    assert hf_prompt_lookup(unigram, 2) == [8, 3]
    assert hf_prompt_lookup(unigram, 2, eos_ids=frozenset({3})) == [8]  # cut before end of sequence
    assert hf_prompt_lookup(torch.tensor([4, 5, 6]), 3) == []


def test_llama_ngram_simple_copies_after_the_latest_earlier_match():
    ids = torch.tensor([0, 1, 2, 10, 11, 12, 1, 2, 20, 21, 22, 30, 31, 1, 2])
    assert llama_ngram_simple(ids, size_n=2, size_m=3) == [20, 21, 22]
    only_at_start = torch.tensor([1, 2, 5, 6, 7, 8, 9, 3, 1, 2])
    assert llama_ngram_simple(only_at_start, size_n=2, size_m=3) == []  # position 0 means no match
    near_end = torch.tensor([0, 4, 5, 6, 7, 8, 9, 3, 1, 2, 1, 2])
    assert llama_ngram_simple(near_end, size_n=2, size_m=3) == []  # one token after it, fewer than n
    assert llama_ngram_simple(torch.tensor([0, 1, 2, 3, 1, 2]), size_n=2, size_m=3) == []  # too short


def test_llama_ngram_mod_walks_its_table_and_drops_short_walks():
    prompt = [1, 2, 3, 4, 1, 2, 5, 6, 7, 8]
    mod = LlamaNgramMod(n_match=2, n_min=2, n_max=4)
    assert mod.draft(torch.tensor(prompt + [1, 2])) == [5, 6, 7, 8]  # (1, 2) -> 5: the latest wins
    assert LlamaNgramMod(n_match=2, n_min=2, n_max=3).draft(torch.tensor(prompt + [4, 1])) == [2, 5, 6]
    assert LlamaNgramMod(n_match=2, n_min=3, n_max=4).draft(torch.tensor(prompt + [6, 7])) == []  # 8, 6: short of 3
    # The answer's n-grams join the table only once more than 32 new tokens have come.
    answer = [40, 41, 42]
    assert mod.draft(torch.tensor(prompt + [1, 2] + answer + [40, 41])) == []
    filler = list(range(100, 140))
    assert mod.draft(torch.tensor(prompt + [1, 2] + answer + filler + [40, 41])) == [42, 100, 101, 102]


def test_the_suite_runs_end_to_end_on_a_tiny_model(tiny_model_dir, tmp_path):
    from specchat.app.cli import main

    document = tmp_path / "doc.txt"
    document.write_text("The cat sat on the mat. The cat sat on the hat. " * 3)
    assert main(["bench", "--suite", "yardstick", "--model", str(tiny_model_dir), "--documents", str(document),
                 "--max-new-tokens", "12", "--out", str(tmp_path / "out")]) == 0
    [written] = (tmp_path / "out").glob("*-yardstick.json")
    report = json.loads(written.read_text())
    rows = report["documents"]["doc.txt"]["drafters"]
    assert set(rows) == set(report["drafters"]) and "HF prompt lookup (10)" in rows
    for label, budgets in rows.items():
        assert list(budgets) == ["4", "8", "16", "64"]
        for nodes, row in budgets.items():
            assert row["tokens_per_forward"] >= 1.0 and 1.0 <= row["mean_nodes"] <= int(nodes), (label, nodes)
