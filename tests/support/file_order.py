"""The suite's files, longest first, so that pytest-xdist's --dist loadfile ends with short files on both workers.

xdist hands out whole files in collection order, which it first sorts by how many tests each holds. In this suite
the longest files hold few tests (a handful of torchrun jobs, a package install), so they came last and one worker
ran the final few minutes alone. Ordered by their last measured time instead (tests/file_durations.json, written
by `cd tests && python -m support.file_order JUNIT_XML` from a run's --junitxml), a long file starts while the other
worker still has work. A file missing from the list (a new one) counts as quick: it goes last. The order within a
file is kept, and which tests run never depends on the list.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

from support.paths import REPO, TESTS

DURATIONS = TESTS / "file_durations.json"


def file_durations(path: Path = DURATIONS) -> dict[str, float]:
    """Seconds per test file (its path from the checkout's root) as last measured; empty where never measured."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # a missing or damaged list only costs the balance, never a test


def longest_first(items: Sequence[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """`items` with whole files ordered by `seconds` (longest first); files of equal weight and the tests within a
    file stay in their collected order."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_file_of(item), len(first_seen))
    return sorted(items, key=lambda item: (-seconds.get(_file_of(item), 0.0), first_seen[_file_of(item)]))


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def durations_from_junit(xml_text: str) -> dict[str, float]:
    """Seconds per test file from pytest's --junitxml (classname "tests.workers.test_x" or "...test_x.Class")."""
    per_file: Counter[str] = Counter()
    for case in ET.fromstring(xml_text).iter("testcase"):
        parts = case.get("classname", "").split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()  # a test class's name
        if parts:
            per_file["/".join(parts) + ".py"] += float(case.get("time") or 0.0)
    return {name: round(s, 1) for name, s in sorted(per_file.items()) if (REPO / name).is_file()}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(
            "usage (in tests/): python -m support.file_order JUNIT_XML  (writes file_durations.json)", file=sys.stderr
        )
        return 2
    try:
        durations = durations_from_junit(Path(argv[0]).read_text())
    except (OSError, ET.ParseError) as e:
        print(f"file_order: cannot read {argv[0]}: {e}", file=sys.stderr)
        return 1
    DURATIONS.write_text(json.dumps(durations, indent=1) + "\n")
    print(f"file_order: {len(durations)} files, {sum(durations.values()):.0f} s in all, written to {DURATIONS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
