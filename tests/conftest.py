"""What every test needs, whichever folder it sits in: the environment the engine is started with, and data that
lives outside the checkout. A folder's own fixtures are in its conftest.py; what tests share beyond fixtures is in
tests/support.
"""

import os
from pathlib import Path

import pytest

from support.paths import SMI_DATA

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Plans are verified by a traced step (seconds each): only the tests of that turn it on.
os.environ.setdefault("RIGPILOT_PLAN_VERIFY", "0")
# Traces are kept on disk between plans (engine.planner.trace_cache): tests of the cache give it a folder of their own.
os.environ.setdefault("RIGPILOT_TRACE_CACHE", "off")
# Every test engine would import torch in a warm worker while idle: only the warm-worker tests turn it on.
os.environ.setdefault("RIGPILOT_WARM_WORKER", "0")


@pytest.fixture
def smi_data() -> Path:
    if not SMI_DATA.is_dir():
        pytest.fail(f"test data missing: {SMI_DATA} (the shared/ folder must sit beside the checkout)")
    return SMI_DATA
