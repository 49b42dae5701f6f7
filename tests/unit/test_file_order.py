"""The suite's file order for xdist (tests/support/file_order.py): longest files first, tests within a file as
collected, and a list made from a run's --junitxml."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from support.file_order import durations_from_junit, file_durations, longest_first

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.unit.test_file_order" name="test_a" time="1.5" />
<testcase classname="tests.unit.test_file_order" name="test_b" time="2.0" />
<testcase classname="tests.unit.test_file_order.TestGroup" name="test_c" time="0.5" />
<testcase classname="tests.unit.test_gone" name="test_d" time="9.0" />
</testsuite></testsuites>"""


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_longer_files_come_first_whole_and_in_their_own_order() -> None:
    items = _items("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "b.py::t2", "d.py::t1")
    ordered = longest_first(items, {"b.py": 30.0, "a.py": 5.0, "c.py": 5.0})
    assert [i.nodeid for i in ordered] == ["b.py::t1", "b.py::t2", "a.py::t1", "a.py::t2", "c.py::t1", "d.py::t1"]


def test_without_a_list_the_collected_order_stands(tmp_path: Path) -> None:
    items = _items("b.py::t1", "b.py::t2", "a.py::t1")
    assert longest_first(items, file_durations(tmp_path / "missing.json")) == items
    (tmp_path / "damaged.json").write_text("[not a mapping")
    assert file_durations(tmp_path / "damaged.json") == {}


def test_the_list_sums_each_files_tests_and_keeps_only_files_that_exist() -> None:
    assert durations_from_junit(JUNIT) == {"tests/unit/test_file_order.py": 4.0}


def test_the_committed_list_names_files_of_the_suite() -> None:
    durations = file_durations()
    assert durations and all(name.startswith("tests/") and name.endswith(".py") for name in durations)
