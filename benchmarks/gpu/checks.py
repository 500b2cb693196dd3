"""The `tests` and `selftest` sections: the CUDA-marked tests and `specchat selftest`, each in a
subprocess of this interpreter (a crash there is a failed section, not a lost campaign)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from .rig import Rig

TESTS_LIMIT_S = 300
SELFTEST_LIMIT_S = 240


def tests(rig: Rig, report: dict) -> dict:
    if not (rig.repo_root / "tests").is_dir():
        return {"status": "skipped: no tests/ beside this installation (run the campaign from a checkout)"}
    files = sorted(str(path) for path in (rig.repo_root / "tests").glob("test_*.py")
                   if "needs_cuda" in path.read_text(encoding="utf-8"))  # conftest.py's CUDA marks
    if not files:
        return {"status": "fail: no test carries the cuda mark"}
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *files]
    if rig.dry_run:  # collected, not run: without a GPU every one of them skips
        completed = _run([*command, "--collect-only"], rig, TESTS_LIMIT_S)
        collected = sum("::" in line for line in completed.stdout.splitlines())
        result = {"files": [Path(name).name for name in files], "collected": collected}
        if completed.returncode != 0 or collected == 0:
            result.update(status=f"fail: collecting the cuda tests exited {completed.returncode}",
                          output_tail=completed.stdout[-3000:])
        return result
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder) / "junit.xml"
        completed = _run([*command, f"--junitxml={junit}"], rig, TESTS_LIMIT_S)
        if not junit.is_file():
            return {"status": f"fail: pytest wrote no report (exit {completed.returncode})",
                    "output_tail": completed.stdout[-3000:]}
        suite = ElementTree.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        problems = [{"test": f"{case.get('classname')}::{case.get('name')}",
                     "message": (problem.get("message") or problem.text or "")[:500]}
                    for case in suite.iter("testcase") for problem in case if problem.tag in ("failure", "error")]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    result = {"files": [Path(name).name for name in files], **counts, "problems": problems,
              "output_tail": completed.stdout[-1500:]}
    if counts["failures"] or counts["errors"] or completed.returncode != 0:
        result["status"] = f"fail: {counts['failures']} failed, {counts['errors']} errors (exit {completed.returncode})"
    return result


def selftest(rig: Rig, report: dict) -> dict:
    command = [sys.executable, "-c", "from specchat.app.cli import entry_point; entry_point()", "selftest", "--json"]
    if rig.dry_run:
        command.append("--quick")
    completed = _run(command, rig, SELFTEST_LIMIT_S)
    try:
        answer = json.loads(completed.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (completed.stderr or completed.stdout)[-1500:]
        if "embedded model" in tail and "not installed" in tail:
            return {"status": "skipped: the embedded model is not installed here", "output_tail": tail}
        return {"status": f"fail: selftest exited {completed.returncode} without JSON", "output_tail": tail}
    result = {"exit_code": completed.returncode, "selftest": answer}
    if completed.returncode != 0:
        result["status"] = "fail: a selftest check failed"
    return result


def _run(command: list[str], rig: Rig, limit_s: float) -> subprocess.CompletedProcess:
    timeout = max(30.0, min(limit_s, rig.seconds_left()))
    try:
        return subprocess.run(command, cwd=rig.repo_root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        return subprocess.CompletedProcess(command, -1, output + f"\n(stopped after {timeout:.0f} s)", "")
