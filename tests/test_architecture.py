"""The layout's rules, checked on the source: imports point down (no circles), speculation is a
lower layer, core never imports the app or the benchmarks, the plan needs no torch, and no
module grows past what a reader takes in at once (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "core", "benchmarks")
MAX_MODULE_LINES = 500
# What core/speculative may build on besides itself: the caches, the model adapter, sampling and
# the small shared helpers. Never the decoders, the engine, the plan or the runtime above it.
SPECULATIVE_MAY_IMPORT = ("core.kv", "core.model", "core.sampling", "core.errors", "core.files", "core.interrupt",
                          "core.embedded")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, modules: dict[str, Path], type_checking: bool) -> set[str]:
    """The package modules `module` imports, lazy imports inside functions included; imports under
    `if TYPE_CHECKING:` only when `type_checking` (they never run)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    targets = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        package = base[:len(base) - (node.level - 1)] + ([node.module] if node.module else [])
        prefix = ".".join(package)
        # `from . import x` names a module; `from .x import y` names x (y may be a module too)
        for candidate in [f"{prefix}.{alias.name}" for alias in node.names] + [prefix]:
            if candidate in modules and candidate != module:
                targets.add(candidate)
                break
    return targets


def _graph(type_checking: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules, type_checking) for module, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_a_circle_and_a_lazy_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from .n import g\n")
    assert _imports("core.m", source, {"core.m": source, "core.n": source}, False) == {"core.n"}


def test_no_import_circles():
    assert _circles(_graph()) == []


def test_speculation_is_a_lower_layer():
    upward = {module: sorted(target for target in targets
                             if not target.startswith("core.speculative")
                             and not any(target == allowed or target.startswith(allowed + ".")
                                         for allowed in SPECULATIVE_MAY_IMPORT))
              for module, targets in _graph(type_checking=True).items() if module.startswith("core.speculative")}
    assert {module: targets for module, targets in upward.items() if targets} == {}


def test_core_imports_neither_the_app_nor_the_benchmarks():
    outward = {module: sorted(target for target in targets if not target.startswith("core"))
               for module, targets in _graph(type_checking=True).items() if module.startswith("core")}
    assert {module: targets for module, targets in outward.items() if targets} == {}


def test_no_module_is_over_the_limit():
    long = {str(path.relative_to(ROOT)): lines for path in [*(ROOT / "core").rglob("*.py"), *(ROOT / "app").rglob("*.py")]
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_the_plan_runs_with_torch_blocked():
    """core.planning imports, and plans every pair on every synthetic machine, with torch,
    transformers and bitsandbytes made unimportable (profiles without curves: with measured
    curves the tree optimizer, which computes in torch, is imported when first needed)."""
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        from pathlib import Path

        class Blocked(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("torch", "transformers", "bitsandbytes"):
                    raise ImportError("blocked: " + name)

        sys.meta_path.insert(0, Blocked())
        from specchat.core.hardware import HardwareProfile
        from specchat.core.planning import PlanRefused, make_plan
        from specchat.core.registry import load_registry

        registry = load_registry()
        planned = refused = 0
        for path in sorted(Path({str(ROOT / "tests" / "data" / "profiles")!r}).glob("*.json")):
            profile = HardwareProfile.load(path)
            for pair in registry.pairs.values():
                for context in (4096, 32768, 131072):
                    try:
                        make_plan(profile, pair, min(context, pair.context_length), registry=registry)
                        planned += 1
                    except PlanRefused:
                        refused += 1
        assert "torch" not in sys.modules
        print(planned, refused)
    """)
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    planned, refused = map(int, completed.stdout.split())
    assert planned > 0 and planned + refused >= 7 * 3


def test_only_the_model_adapter_reaches_into_transformers_models():
    """`.hf` (the transformers module behind core.model.TransformersLM) stays inside core/model.py
    and the replayed forward it runs (core/step_graphs.py): the rest of core and the app go through
    the CausalLM interface."""
    adapter = {ROOT / "core" / "model.py", ROOT / "core" / "step_graphs.py"}
    reaching = {str(path.relative_to(ROOT)): number
                for path in [*(ROOT / "core").rglob("*.py"), *(ROOT / "app").rglob("*.py")]
                if path not in adapter
                for number, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\.hf\b", line)}
    assert reaching == {}
