"""The auto suite's per-document verdicts (core/bench_auto.py), on made-up timings."""

from specchat.benchmarks.auto import _summary


def row(mode, runs, forwards, tree_size=0):
    return {"mode": mode, "tokens_per_second": sorted(runs)[len(runs) // 2], "tokens_per_second_runs": runs,
            "target_forwards": forwards, "tree_size": tree_size, "identical_to_plain": True,
            "predicted_tokens_per_second": 20.0}


def verdict(auto):
    rows = {"plain": row("plain", [18.0, 18.2, 18.1], 128), "chain (prompt lookup)": row("chain", [23.6, 24.0, 23.6], 104, 4),
            "auto": auto}
    return _summary(rows, 3000, 3)["auto_within_noise_of_best"]


def test_auto_is_within_noise_when_its_runs_reach_the_best_modes_or_it_did_the_same_work():
    assert verdict(row("chain", [23.0, 23.7, 23.2], 110, 4))  # its fastest run reaches chain's slowest
    assert verdict(row("chain", [23.4, 23.5, 23.5], 104, 4))  # slower runs, but chain's very forwards
    assert not verdict(row("chain", [23.4, 23.5, 23.5], 110, 4))  # slower, and other work
    assert not verdict(row("plain", [18.0, 18.1, 18.2], 128))
