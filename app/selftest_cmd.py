"""`specchat selftest`: is decoding lossless on this machine with this model? One line per check
(PASS/FAIL/SKIP, what it checked, seconds), or one JSON object; exit 0 only if every check holds,
1 when one fails (2, as everywhere, for bad input)."""

from __future__ import annotations

import json
from dataclasses import asdict

EXIT_FAILED = 1


def add_parser(commands, add_model_option) -> None:
    """Add `selftest` to the CLI's subparsers; `add_model_option` is the CLI's `--model` option."""
    selftest = commands.add_parser(
        "selftest", help="check that decoding is lossless here: the verification rules, every mode "
                         "against plain decoding, the GPU paths (under a minute)")
    add_model_option(selftest)
    selftest.add_argument("--quick", action="store_true", help="answers half as long in the mode checks")
    selftest.add_argument("--json", action="store_true", help="print one JSON object")


def run(args, load=None) -> int:
    """Load the model (`load(args)`, default the CLI's loader), run every check, report."""
    from ..core.selftest import all_passed, run_selftest

    if load is None:
        from .session import load
    engine = load(args)
    if not args.json:
        print(f"Self-test of {engine.name}:")
    results = run_selftest(engine, quick=args.quick,
                           on_result=None if args.json else lambda result: print(result_line(result), flush=True))
    passed = all_passed(results)
    if args.json:
        print(json.dumps(report_json(engine.name, results)))
    else:
        print(summary_line(results))
    return 0 if passed else EXIT_FAILED


def result_line(result) -> str:
    return f"{result.status.upper():4}  {result.what} ({result.seconds:.1f} s): {result.detail}"


def summary_line(results) -> str:
    counts = {status: sum(result.status == status for result in results) for status in ("pass", "fail", "skip")}
    seconds = sum(result.seconds for result in results)
    verdict = "all checks hold" if counts["fail"] == 0 else f"{counts['fail']} FAILED"
    return (f"{verdict}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped "
            f"in {seconds:.0f} s")


def report_json(model: str, results) -> dict:
    from ..core.selftest import all_passed

    return {"model": model, "passed": all_passed(results), "seconds": sum(result.seconds for result in results),
            "checks": [asdict(result) for result in results]}


def report_markdown(model: str, results) -> str:
    """The report for the app: a table of the checks, then the verdict."""
    icons = {"pass": "✅ PASS", "fail": "❌ FAIL", "skip": "➖ SKIP"}
    lines = [f"**Self-test of `{model}`**", "", "| Result | Check | Seconds | Details |", "|---|---|--:|---|"]
    lines += [f"| {icons[result.status]} | {_cell(result.what)} | {result.seconds:.1f} | {_cell(result.detail)} |"
              for result in results]
    return "\n".join(lines + ["", f"**{summary_line(results)}**"])


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
