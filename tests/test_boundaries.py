"""The architecture's two rules, checked on the code as written and as imported."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    assert "2 kept, 0 broken" in r.stdout


def test_cli_and_hardware_layer_do_not_load_torch():
    code = (
        "import sys, rigpilot.engine.cli, rigpilot.engine.hardware.discovery, rigpilot.engine.hardware.simulated, rigpilot.engine.terminal;"
        "rigpilot.engine.cli.build_parser();"
        "print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
