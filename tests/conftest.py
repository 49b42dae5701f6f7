"""What every test needs, whichever folder it sits in: the environment the engine is started with, and data that
lives outside the checkout. A folder's own fixtures are in its conftest.py; what tests share beyond fixtures is in
tests/support.
"""

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from support.file_order import file_durations, longest_first
from support.paths import SMI_DATA
from support.run_folders import remove_dead_runs_folders

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Plans are verified by a traced step (seconds each): only the tests of that turn it on.
os.environ.setdefault("RIGPILOT_PLAN_VERIFY", "0")
# Traces are kept on disk between plans (engine.planner.trace_cache): tests of the cache give it a folder of their own.
os.environ.setdefault("RIGPILOT_TRACE_CACHE", "off")
# Every test engine would import torch in a warm worker while idle: only the warm-worker tests turn it on. The
# suite keeps one warm worker per test process instead, which every test job's ranks fork from
# (support.worker_jobs.warm_socket).
os.environ.setdefault("RIGPILOT_WARM_WORKER", "0")
# The hub is never reached from a test (tests of hub code serve their own, or patch huggingface_hub's constants);
# and a job's import-time variables must equal the warm worker's for its ranks to fork from it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _run_folder() -> Path:
    """A private folder of this test run, shared by its xdist workers (their parent is the run's controller)."""
    owner = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    return Path(tempfile.gettempdir()) / f"rigpilot-tests-{os.getuid()}-{owner}"


def _private(path: Path) -> Path:
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SystemExit(f"{path} exists and is not this user's private folder: remove it and run the tests again")
    return path


# Compiled kernels (torch.compile, torchao's optimizer steps, and every job the tests start) go to this run's own
# folder instead of ~/.cache/rigpilot/torchinductor or /tmp/torchinductor_<user>: the suite leaves the user's home
# as it found it, and its times do not depend on what an earlier run compiled.
# Its xdist workers, and a run a test starts inside one (a nested `dev.py test`), inherit the variable and make
# no folder of their own; only the process that made the folder removes it.
_MADE_RUN_FOLDER = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
if _MADE_RUN_FOLDER:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_private(_run_folder()) / "torchinductor")


def pytest_configure(config: pytest.Config) -> None:
    # xdist would sort the files by their number of tests, which puts this suite's longest files last: the order
    # pytest_collection_modifyitems gives (support/file_order.py) is the one it hands them out in.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = longest_first(items, file_durations())


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # a run's controller (or a run without workers), not a worker
        remove_dead_runs_folders(Path(tempfile.gettempdir()), os.getuid())


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _MADE_RUN_FOLDER and not hasattr(session.config, "workerinput"):  # the controller, its workers done
        shutil.rmtree(_run_folder(), ignore_errors=True)


@pytest.fixture
def smi_data() -> Path:
    if not SMI_DATA.is_dir():
        pytest.fail(f"test data missing: {SMI_DATA} (the shared/ folder must sit beside the checkout)")
    return SMI_DATA
