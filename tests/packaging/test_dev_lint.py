"""dev.py's lint step: one list of paths for ruff (pyproject.toml), and mypy held to a baseline that may only
shrink: a new error fails, a fixed one asks for the baseline to be rewritten, and line numbers do not matter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib

from support.dev_script import DEV_PY, load_dev

ROOT = DEV_PY.parent

OUTPUT = textwrap.dedent(
    """\
    rigpilot/app/a.py:10: error: Item "None" of "X | None" has no attribute "y"  [union-attr]
    rigpilot/app/a.py:10: note: see the docs
    rigpilot/app/a.py:30:5: error: Item "None" of "X | None" has no attribute "y"  [union-attr]
    rigpilot/engine/b.py:2: error: Missing return statement  [return]
    Found 3 errors in 2 files (checked 2 source files)
    """
)


def test_findings_leave_out_line_numbers_and_notes_and_keep_repeats():
    dev = load_dev()
    assert dev.mypy_findings(OUTPUT) == [
        'rigpilot/app/a.py: Item "None" of "X | None" has no attribute "y"  [union-attr]',
        'rigpilot/app/a.py: Item "None" of "X | None" has no attribute "y"  [union-attr]',
        "rigpilot/engine/b.py: Missing return statement  [return]",
    ]


def test_a_new_error_fails_and_a_fixed_one_is_gone_from_the_baseline():
    dev = load_dev()
    found = dev.mypy_findings(OUTPUT)
    assert dev.baseline_verdict(found, found) == ([], [])
    moved = dev.mypy_findings(OUTPUT.replace(":10:", ":11:").replace(":2:", ":40:"))
    assert dev.baseline_verdict(moved, found) == ([], [])  # an edit above an error does not make it new
    new, gone = dev.baseline_verdict(found, found[1:])
    assert new == [found[0]] and gone == []  # a second error of the same words in the file is new
    new, gone = dev.baseline_verdict(found[:2], found)
    assert new == [] and gone == [found[2]]


def test_the_baseline_file_is_mypys_own_findings_in_order():
    lines = (ROOT / "mypy-baseline.txt").read_text().splitlines()
    assert lines == sorted(lines) and all(": " in line and line.endswith("]") for line in lines)


def test_one_list_of_lint_paths_for_dev_py_ci_and_make():
    with open(ROOT / "pyproject.toml", "rb") as f:
        paths = tomllib.load(f)["tool"]["rigpilot"]["lint-paths"]
    assert all((ROOT / p).exists() for p in paths)
    assert load_dev().project_table("rigpilot")["lint-paths"] == paths
    make = (ROOT / "Makefile").read_text()
    assert "\tpython3 dev.py lint\n" in make and "ruff" not in make  # make lint is dev.py's lint, not a copy
    assert "ruff" not in (ROOT / ".ci" / "run").read_text()


def test_lint_takes_only_its_own_option():
    done = subprocess.run([sys.executable, str(DEV_PY), "lint", "--bogus"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "unknown option --bogus" in done.stderr


def test_fast_leaves_out_the_slow_tests_and_only_before_a_double_dash():
    dev = load_dev()
    assert dev.split_fast(["--fast", "-x", "tests/a.py"]) == (True, ["-x", "tests/a.py"])
    assert dev.split_fast(["-x", "--", "--fast"]) == (False, ["-x", "--", "--fast"])
    assert dev.split_fast([]) == (False, [])


def test_updating_the_baseline_only_drops_fixed_errors(tmp_path, monkeypatch):
    dev = load_dev()
    baseline = tmp_path / "mypy-baseline.txt"
    monkeypatch.setattr(dev, "MYPY_BASELINE", baseline)
    monkeypatch.setattr(dev, "venv_bin", lambda name: name)
    found = dev.mypy_findings(OUTPUT)
    monkeypatch.setattr(dev.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, OUTPUT, ""))
    baseline.write_text("".join(f"{line}\n" for line in found[1:]))
    assert dev.mypy_check(update=True) == 1  # a new error is never written into the baseline
    assert baseline.read_text().splitlines() == found[1:]
    baseline.write_text("".join(f"{line}\n" for line in [*found, "rigpilot/x.py: fixed  [misc]"]))
    assert dev.mypy_check(update=True) == 0
    assert baseline.read_text().splitlines() == found
