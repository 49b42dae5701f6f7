"""A killed or nested test run's private folder is removed by the next run, and nothing else is."""

import os
import subprocess
import sys
from pathlib import Path

from support.run_folders import remove_dead_runs_folders


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_only_this_users_folders_of_dead_runs_are_removed(tmp_path: Path) -> None:
    uid, dead = os.getuid(), _dead_pid()
    gone = tmp_path / f"rigpilot-tests-{uid}-{dead}"
    (gone / "torchinductor").mkdir(parents=True, mode=0o700)
    (gone / "torchinductor" / "kernel.py").write_text("")
    live = tmp_path / f"rigpilot-tests-{uid}-{os.getpid()}"  # a run still going
    live.mkdir(mode=0o700)
    other = tmp_path / f"rigpilot-tests-{uid + 1}-{dead}"  # another user's name
    other.mkdir()
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious").write_text("x")
    link = tmp_path / f"rigpilot-tests-{uid}-{dead + 1 if dead + 1 != os.getpid() else dead + 2}"
    link.symlink_to(keep)  # a planted link is never followed into
    (gone / "escape").symlink_to(keep)  # nor is one inside a removed folder
    odd = tmp_path / f"rigpilot-tests-{uid}-abc"
    odd.mkdir()
    removed = remove_dead_runs_folders(tmp_path, uid)
    assert removed == [gone] and not gone.exists()
    assert live.is_dir() and other.is_dir() and odd.is_dir() and link.is_symlink()
    assert (keep / "precious").read_text() == "x"
