"""A stand-in for the memory tracer: a real process that answers as engine.workers.memtrace does, at once, with
each plan's formula tensor bytes as its traced peak; optionally held until a cue file appears. Tests of the
flow around the trace (what is shown first, what is cached, what a cancel stops) use it where the real tracer
would spend seconds importing torch."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigpilot.engine.planner import verify

STAND_IN = r"""
import json, os, sys, time
serve = "--serve" in sys.argv[1:]
args = [a for a in sys.argv[1:] if a not in ("--serve", "-m", "rigpilot.engine.workers.memtrace")]
cue = args[0] if args else ""

def answer(request):
    while cue and not os.path.exists(cue):
        time.sleep(0.02)
    for i, plan in enumerate(request["plans"]):
        m = max(plan["memory"], key=lambda g: g["total"])
        print(json.dumps({"index": i, "ok": True, "peak": m["total"] - m["overhead"], "method": "stand-in",
                          "seconds": 0.0}), flush=True)

if serve:
    for line in sys.stdin:
        answer(json.loads(line))
else:
    answer(json.loads(sys.stdin.read()))
"""


def stand_in_tracer(monkeypatch, cue: Path | None = None) -> list[list[str]]:
    """Make the planner start the stand-in instead of the tracer; returns the list of tracer processes started
    (each its command line), which grows as the planner starts them."""
    started: list[list[str]] = []

    def command(python: str) -> list[str]:
        argv = [sys.executable, "-c", STAND_IN, *([str(cue)] if cue is not None else [])]
        started.append(argv)
        return argv

    monkeypatch.setattr(verify, "tracer_command", command)
    return started


def counting_tracer(monkeypatch) -> list[list[str]]:
    """Count the real tracer's processes as the planner starts them."""
    started: list[list[str]] = []
    real = verify.tracer_command

    def command(python: str) -> list[str]:
        argv = real(python)
        started.append(argv)
        return argv

    monkeypatch.setattr(verify, "tracer_command", command)
    return started


@pytest.fixture
def no_warm_tracer() -> Iterator[None]:
    """A warm tracer a test started (the engine's planner keeps one) does not outlive the test."""
    verify.stop_warm()
    yield
    verify.stop_warm()


def stand_in_python(folder: Path, cue: Path) -> Path:
    """An executable that stands in for the worker interpreter (RIGPILOT_WORKER_PYTHON) of an engine service:
    started as the tracer (`python -m rigpilot.engine.workers.memtrace [--serve]`), it runs the stand-in,
    held until `cue` exists."""
    script = folder / "stand-in-python"
    body = STAND_IN.replace("'", "'\\''")
    script.write_text(f"#!/bin/sh\nexec '{sys.executable}' -c '{body}' '{cue}' \"$@\"\n")
    script.chmod(0o700)
    return script
