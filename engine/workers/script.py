"""A user's own script (kind "script"), run inside the rank as `python script.py args...` would run it.

torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) is already set, so
the script can call torch.distributed.init_process_group() itself, and
`from rigpilot import report` sends its metrics to the job's charts. An
exception or a non-zero sys.exit() fails the rank.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.report import report


def run_script(spec: JobSpec, job_dir: Path) -> int:
    if not spec.script:
        raise UserError('script job without a script: set script to ["path/to/script.py", args...]')
    path = Path(spec.script[0]).expanduser()
    if not path.is_file():
        raise UserError(f"script {path} not found")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *spec.script[1:]]
    sys.path.insert(0, str(path.resolve().parent))  # as `python script.py` does, for the script's own imports
    report(kind="status", phase="running", script=str(path))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            raise ScriptExit(code) from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    report(kind="status", phase="done", exit_code=0)
    return 0


class ScriptExit(Exception):
    """The script called sys.exit(code) with a non-zero code: the rank exits with the same code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"script exited with status {code}")
        self.code = code
