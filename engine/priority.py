"""How much a job's processes give way to the desktop when the CPUs are short: a niceness of 5.

A job's ranks, data loaders and compile workers can keep every core busy for hours; at the same priority
as the desktop, fifteen busy ranks on two cores left the app's window one sixteenth of a core, and opening
a job page stalled it for 100–190 ms (benchmarks/gui_job_open.py). At niceness 5 they left it enough to
answer within 35–65 ms. Niceness only counts while something else wants the CPUs: a job alone on the
machine runs as fast as before, and jobs among themselves share as before (all are started the same way).
The engine itself and the planner's work stay at the user's priority: a person waits on those.
`"job_niceness": N` in the user's settings.json (engine.settings) changes it, 0 to run jobs as the user's
own programs (a user cannot lower a niceness once raised, without root: so it is a setting, not only renice).

Where the desktop already puts the job in a scheduling group of its own (autogroup for a session of its
own, a systemd unit's cgroup), the niceness counts only within the job.
"""

from __future__ import annotations

import shutil

NICENESS = 5
MAX_NICENESS = 19  # the kernel's lowest priority


def yielding(command: list[str], niceness: int = NICENESS) -> list[str]:
    """`command` run at `niceness` more than ours, by coreutils' `nice` (which execs it: the pid is the same);
    as it is for 0 or where there is no `nice`."""
    tool = shutil.which("nice") if niceness > 0 else None
    return [tool, "-n", str(niceness), *command] if tool else list(command)
