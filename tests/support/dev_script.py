"""dev.py, loaded as a module for tests: it is a script beside the package, not importable by name."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from support.paths import REPO

DEV_PY = REPO / "dev.py"


def load_dev(name: str = "rigpilot_dev_script") -> ModuleType:
    """A fresh copy of dev.py's module each call, so one test's monkeypatching never reaches another's."""
    spec = importlib.util.spec_from_file_location(name, DEV_PY)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
