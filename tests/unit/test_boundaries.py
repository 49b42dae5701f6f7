"""The architecture's two rules, checked on the code as written and as imported."""

import ast
import subprocess
import sys
from pathlib import Path

from support.paths import REPO


def imported_top_level(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for f in (REPO / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(f.relative_to(REPO))] = names
    return found


def test_engine_never_imports_qt_or_the_gui():
    bad = {f: n & {"PySide6", "PyQt5", "PyQt6", "pyqtgraph", "app"} for f, n in imported_top_level("engine").items()}
    assert not {f: n for f, n in bad.items() if n}


def test_gui_never_imports_torch_or_model_libraries():
    bad = {f: n & {"torch", "transformers", "peft", "accelerate"} for f, n in imported_top_level("app").items()}
    assert not {f: n for f, n in bad.items() if n}


def test_import_linter_contracts_hold():
    exe = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(exe)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " kept, 0 broken." in r.stdout


def test_cli_and_hardware_layer_do_not_load_torch():
    code = (
        "import sys, rigpilot.engine.cli.entry, rigpilot.engine.hardware.discovery, rigpilot.engine.hardware.simulated, rigpilot.engine.terminal;"
        "rigpilot.engine.cli.entry.build_parser();"
        "print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def module_imports(package: str) -> dict[str, set[str]]:
    """rigpilot.PACKAGE's modules and the modules of it each one imports (anywhere in the file)."""
    modules: dict[str, set[str]] = {}
    for f in (REPO / package).rglob("*.py"):
        parts = f.relative_to(REPO).with_suffix("").parts
        name = ".".join(("rigpilot", *parts[: -1 if parts[-1] == "__init__" else None]))
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        modules[name] = deps
    return {m: {d for d in deps if d in modules and d != m} for m, deps in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan): each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_the_gui_and_engine_modules_import_each_other_as_a_tree():
    """No import cycles in app/ (the wizard and its pages share app/wizard/host.py instead of importing each
    other) nor in engine/ (the supervisor and its SLURM half share engine/jobs/runs.py), counting imports
    inside functions and under TYPE_CHECKING too."""
    assert import_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the check can fail
    assert import_cycles(module_imports("app")) == []
    assert import_cycles(module_imports("engine")) == []
