"""`specchat selftest`: its checks pass on the real code, fail when a verification rule or a
decoder is deliberately broken, and the command reports one line per check with the right exit
code; the whole self-test on the embedded model takes under a minute."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from specchat.app import selftest_cmd
from specchat.core import decoding, selftest
from specchat.core.sampling import sample
from specchat.core.speculative.forward_times import ForwardTimes
from specchat.core.speculative.step_times import StepTimes
from specchat.core.speculative import verify

RULE_CHECKS = {"chain-rule": selftest.chain_rule_enumeration, "tree-rule": selftest.tree_rule_enumeration,
               "sampled": selftest.sampled_chi_square}
STUB_ENGINE = SimpleNamespace(name="stub")
REAL_CHILD_PROPOSAL = verify.child_proposal


def parse(*argv: str) -> argparse.Namespace:
    """The command's own parser under a bare CLI (the real one adds it the same way)."""
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command")
    selftest_cmd.add_parser(commands, lambda command: command.add_argument("--model", default="embedded"))
    return parser.parse_args(["selftest", *argv])


@pytest.fixture
def rules_only(monkeypatch):
    """The self-test without its decoding-mode checks, which need a model: the rules (and the GPU
    paths, skipped on a CPU) on a stub engine, in a few seconds."""
    monkeypatch.setattr(selftest, "engine_modes", lambda engine: [])


def triforce_bug(p, q):
    """TriForce's reference code: after a rejection it samples P instead of the residual."""
    return p


def stale_draft(q, state, token):
    """A tree rule that forgets to remove a rejected sibling from the draft distribution D."""
    return REAL_CHILD_PROPOSAL(q, verify.node_start(state.residual), token)


def forget_rejections(state, d, token):
    """A tree rule that updates the residual but never records the rejected sibling."""
    return verify.NodeState(verify.residual(state.residual, d), state.rejected)


@pytest.mark.parametrize("rule, broken, failing", [
    ("residual", triforce_bug, {"chain-rule", "tree-rule", "sampled"}),
    ("child_proposal", stale_draft, {"tree-rule", "sampled"}),
    ("reject_child", forget_rejections, {"tree-rule", "sampled"}),
])
def test_a_broken_verification_rule_fails_its_checks(monkeypatch, rule, broken, failing):
    monkeypatch.setattr(verify, rule, broken)
    statuses = {name: check().status for name, check in RULE_CHECKS.items()}
    assert {name for name, status in statuses.items() if status == "fail"} == failing
    assert all(statuses[name] == "pass" for name in statuses.keys() - failing)


def test_the_command_reports_one_line_per_check_and_exits_0(rules_only, capsys):
    assert selftest_cmd.run(parse(), load=lambda args: STUB_ENGINE) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Self-test of stub:"
    checks, summary = lines[1:-1], lines[-1]
    assert [line.split()[0] for line in checks[:3]] == ["PASS"] * 3
    assert " s): max |emitted - P| " in checks[0]
    if not torch.cuda.is_available():
        assert all(line.startswith("SKIP") and "no CUDA GPU" in line for line in checks[3:]) and len(checks) == 5
    assert summary.startswith("all checks hold: ")


def test_a_broken_rule_makes_the_command_fail_with_exit_1(rules_only, monkeypatch, capsys):
    monkeypatch.setattr(verify, "residual", triforce_bug)
    assert selftest_cmd.run(parse("--json"), load=lambda args: STUB_ENGINE) == 1
    report = json.loads(capsys.readouterr().out)  # one JSON object, nothing else
    assert report["model"] == "stub" and report["passed"] is False
    statuses = {check["name"]: check["status"] for check in report["checks"]}
    assert statuses["chain-rule"] == "fail" and statuses["sampled"] == "fail"
    assert {"name", "status", "what", "detail", "seconds"} <= report["checks"][0].keys()


def test_a_crash_in_the_code_under_test_is_a_failed_check(monkeypatch):
    def broken(*args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(verify, "verify_chain", broken)
    result = selftest.sampled_chi_square()
    assert result.status == "fail" and result.detail == "raised RuntimeError: boom"


def accept_every_draft(draft_tokens, q, p, generator):
    """A broken chain verifier: every draft token accepted, then a bonus token."""
    return verify.ChainVerdict(len(draft_tokens), sample(p[len(draft_tokens)], generator))


def accept_first_children(tree, tokens, p, q, generator):
    """A broken tree verifier: the first child at every level accepted, down to a leaf."""
    path, node = [], 0
    while tree.children[node]:
        node = tree.children[node][0]
        path.append(node)
    return verify.TreeVerdict(path, sample(p[node], generator))


@pytest.mark.slow
def test_greedy_identity_catches_a_verifier_that_accepts_every_draft(embedded_engine, monkeypatch):
    # Cheap verification, as a calibrated GPU measures it: the chain drafts on this short answer
    # whatever this machine's cache holds (with the stated default t(n) it drafts nothing, and a
    # broken verifier would pass unseen).
    flat = StepTimes((ForwardTimes(sizes=(1, 17), ratios=(1.0, 1.05), one_token_seconds=0.05, context=2048,
                                   device="synthetic"),))
    monkeypatch.setattr(embedded_engine, "settings", replace(embedded_engine.settings, step_times=flat))
    reference = selftest.PlainReference(embedded_engine, selftest.QUICK_NEW_TOKENS)
    for mode in ("chain", "tree"):
        result = selftest.greedy_identity(embedded_engine, mode, reference)
        assert result.status == "pass" and " 0 of 0 draft tokens" not in result.detail
    monkeypatch.setattr(decoding, "verify_chain", accept_every_draft)
    monkeypatch.setattr(decoding, "verify_tree", accept_first_children)
    for mode in ("chain", "tree"):
        result = selftest.greedy_identity(embedded_engine, mode, reference)
        assert result.status == "fail" and "differs from plain at token" in result.detail


@pytest.mark.slow
def test_the_whole_selftest_passes_on_the_embedded_model_in_under_a_minute(embedded_engine, capsys):
    started = time.perf_counter()
    assert selftest_cmd.run(parse(), load=lambda args: embedded_engine) == 0
    elapsed = time.perf_counter() - started
    lines = capsys.readouterr().out.splitlines()
    checks = lines[1:-1]
    names = ["chain", "tree", "triforce (first stage lookup)", "triforce with a 6-node tree", "auto (= chain)"]
    for name in names:
        line = next(line for line in checks if f"greedy {name}" in line)
        assert line.startswith("PASS") and "tokens identical" in line
    assert len(checks) == 3 + len(names) + 2
    assert elapsed < 60, elapsed


def test_a_divergence_at_a_rounding_tie_passes_and_any_other_fails(monkeypatch):
    """The verdict on a divergence, without a model: plain answers 1 2 3 4, the mode 1 2 9 4."""
    answers = {"plain": [1, 2, 3, 4], "chain": [1, 2, 9, 4]}
    stats = SimpleNamespace(accepted_draft_tokens=1, drafted_tokens=2)
    monkeypatch.setattr(selftest, "_greedy", lambda engine, prompt, mode, new_tokens, triforce=None:
                        SimpleNamespace(token_ids=answers[mode], stats=stats))
    engine = SimpleNamespace(chat_ids=lambda messages: [0], settings=SimpleNamespace(triforce=SimpleNamespace(draft="lookup")),
                             auto_mode="chain", answers=SimpleNamespace(clear=lambda: None),
                             model=SimpleNamespace(dtype=torch.bfloat16))
    gaps = []
    monkeypatch.setattr(selftest, "_logit_gap", lambda engine, ids, chosen, other: gaps.append(ids) or gap)

    gap = (0.01, 0.1)  # the target's logits of 3 and 9 differ by less than bf16 rounding
    result = selftest.greedy_identity(engine, "chain", selftest.PlainReference(engine, 4))
    assert result.status == "pass" and "near tie at token 2 of 4" in result.detail
    assert gaps == [[0, 1, 2]]  # asked after the prompt and the common prefix
    gap = (2.5, 0.1)
    result = selftest.greedy_identity(engine, "chain", selftest.PlainReference(engine, 4))
    assert result.status == "fail" and "differs from plain at token 2 of 4" in result.detail
    answers["chain"] = [1, 2]  # ended early (an end-of-turn token where plain went on)
    result = selftest.greedy_identity(engine, "chain", selftest.PlainReference(engine, 4))
    assert result.status == "fail" and "at token 2 of 4 (plain [3], chain []" in result.detail
