"""The test tree keeps its shape: five folders by what a test exercises, shared code in tests/support, no test
module importing another.

A test module that imports another runs the other's module-level code (and, under another name, twice), and a
fixture imported that way hides where it comes from; what two modules share belongs in tests/support or in the
folder's conftest.py. Test modules are imported by their file name (pytest's default import mode), so a second
test_x.py in another folder would fail collection: names are unique across the folders.
"""

import ast
from collections import Counter
from pathlib import Path

from support.paths import TESTS

FOLDERS = ("unit", "gui", "engine", "workers", "packaging")


def all_test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "support" not in p.relative_to(TESTS).parts)


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (imports inside functions included), as written."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            if node.module == "tests":  # from tests import test_x
                found |= {f"tests.{a.name}" for a in node.names}
    return found


def test_every_test_module_sits_in_one_of_the_five_folders():
    misplaced = [p.relative_to(TESTS).as_posix() for p in all_test_modules() if p.parent.parent != TESTS
                 or p.parent.name not in FOLDERS]  # fmt: skip
    assert misplaced == [], f"test modules outside tests/{{{','.join(FOLDERS)}}}/: {misplaced}"
    loose = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py")
    assert loose == [], f"helpers belong in tests/support, not loose in tests/: {loose}"


def test_test_module_names_are_unique_across_the_folders():
    counts = Counter(p.name for p in all_test_modules())
    twice = {name: [p.relative_to(TESTS).as_posix() for p in all_test_modules() if p.name == name]
             for name, n in counts.items() if n > 1}  # fmt: skip
    assert twice == {}, f"one name, two test modules: {twice}"


def test_no_test_module_or_support_module_imports_a_test_module():
    found = {}
    for path in [*all_test_modules(), *sorted((TESTS / "support").glob("*.py")), *sorted(TESTS.rglob("conftest.py"))]:
        bad = sorted(m for m in imported_modules(path)
                     if m.split(".")[-1].startswith("test_") or m.startswith("tests.") or m == "conftest")  # fmt: skip
        if bad:
            found[path.relative_to(TESTS).as_posix()] = bad
    assert found == {}, f"imports of test modules (move what is shared to tests/support or a conftest.py): {found}"


def test_gui_tests_and_only_they_are_in_the_gui_folder():
    """tests/gui/conftest.py fails a GUI test on a Qt warning and isolates its settings: it must reach all of them."""
    wrong = [p.relative_to(TESTS).as_posix() for p in all_test_modules()
             if (p.parent.name == "gui") != p.name.startswith("test_gui_")]  # fmt: skip
    assert wrong == []


def test_paths_from_this_files_place_are_computed_once_in_support_paths():
    """A folder's depth is known in one place (support/paths.py), so a module can move without its paths breaking."""
    found = []
    for path in [*all_test_modules(), *sorted(TESTS.rglob("conftest.py")), *sorted((TESTS / "support").glob("*.py"))]:
        if path.name == "paths.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "parents" and "__file__" in ast.unparse(node.value)):  # fmt: skip
                found.append(f"{path.relative_to(TESTS).as_posix()}:{node.lineno}")
    assert found == [], f"use support.paths (REPO, TESTS) instead of Path(__file__).parents[...]: {found}"
