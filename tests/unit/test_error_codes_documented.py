"""Every refusal reason the engine raises is in docs/cli-json.md's table, where clients learn its fields."""

from __future__ import annotations

import re

from support.paths import REPO


def test_every_reason_the_engine_raises_is_documented() -> None:
    raised = set()
    for path in (REPO / "engine").rglob("*.py"):
        raised |= set(re.findall(r'reason="([a-z_]+)"', path.read_text()))
    table = (REPO / "docs" / "cli-json.md").read_text().split("### Refusal reasons and their fields", 1)[1]
    documented = set(re.findall(r"`([a-z_]+)`", table.split("\n## ", 1)[0]))
    assert raised, "no reason found: the pattern no longer matches how refusals are raised"
    assert sorted(raised - documented) == []
