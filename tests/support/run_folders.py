"""The test runs' private /tmp folders (tests/conftest.py): removing those whose run is gone."""

import os
import shutil
import stat
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the pid now: not ours to judge
        return True
    return True


def remove_dead_runs_folders(tmp: Path, uid: int) -> list[Path]:
    """Remove the run folders of this user's earlier runs whose controller is gone: a killed run never reaches
    pytest_sessionfinish, and a run started inside a test's worker (a nested `dev.py test`) takes the worker's
    pid as its owner and leaves its folder to it. Only real directories this user owns, named as _run_folder
    names them; a symlink or another user's folder is left alone. Returns what was removed."""
    removed = []
    for path in tmp.glob(f"rigpilot-tests-{uid}-*"):
        pid = path.name.rsplit("-", 1)[1]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            st = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
