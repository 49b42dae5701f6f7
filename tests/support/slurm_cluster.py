"""A real one-machine SLURM cluster for the tests: munged, slurmctld and slurmd from Debian's slurm-wlm.

Everything lives in a temporary folder (config, munge key and socket, state, spool, logs) and talks on
its own ports, so it touches no system SLURM or munge. SLURM's accounting without a database:
JobCompType=jobcomp/filetxt, which `sacct --completion` reads (slurmdbd and MariaDB would add a
database server to every test run for the same answer).

`cluster()` yields a started cluster or skips with the one reason it cannot be had.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.dev_script import load_dev
from support.processes import alive
from support.waiting import poll_until

PARTITION = "rigtest"


def _dev():
    return load_dev("rigpilot_dev_for_slurm")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.jobcomp = root / "jobcomp.txt"
        self.host = socket.gethostname()
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pids: list[Path] = []

    def write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(mode=0o755, exist_ok=True)
        os.chmod(r, 0o755)  # munged and slurmd reach their files through it
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        cpus = len(os.sched_getaffinity(0))
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        ctld_port, d_port = _free_ports(2)
        self.conf.write_text(f"""\
ClusterName=rigpilot-test
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.sock
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
# SLURM's record of ended jobs without slurmdbd: what `sacct --completion` reads.
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# scancel: SIGTERM, then SIGKILL this many seconds later (SLURM's default is 30).
KillWait=5
MinJobAge=300
DefMemPerCPU=1024
NodeName={self.host} CPUs={cpus} RealMemory={memory_mb * 3 // 4} State=UNKNOWN
PartitionName={PARTITION} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self) -> None:
        self.write_config()
        r = self.root
        munge = [_sbin("munged"), f"--key-file={r}/munge/munge.key", f"--socket={r}/munge/munge.sock",
                 f"--pid-file={r}/munge/munged.pid", f"--log-file={r}/munge/munged.log",
                 f"--seed-file={r}/munge/seed", "--force"]  # fmt: skip
        self._daemon(munge, r / "munge" / "munged.pid")
        self._daemon([_sbin("slurmctld"), "-f", str(self.conf), "-i"], r / "slurmctld.pid")
        self._daemon([_sbin("slurmd"), "-f", str(self.conf)], r / "slurmd.pid")
        self.wait_idle()

    def _daemon(self, cmd: list[str], pid_file: Path) -> None:
        self._pids.append(pid_file)
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"{Path(cmd[0]).name} did not start: {r.stderr.strip() or r.stdout.strip()}")

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            r = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False)
            out = r.stdout.strip()
            if out == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node did not become idle in {timeout:.0f} s (sinfo: {out!r}); "
                           f"logs in {self.root / 'log'}")  # fmt: skip

    def run(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=30, check=check)

    def accounting(self, job_id: str) -> str:
        """SLURM's own accounting of an ended job: its state in the completion records (`sacct --completion`)."""
        r = self.run(["sacct", "--completion", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State"])
        states = [line.split("|")[1] for line in r.stdout.splitlines() if line.split("|")[0] == job_id]
        return states[-1] if states else ""

    def stop(self) -> None:
        """Cancel what is left, stop the daemons (slurmd, slurmctld, munged) and wait until they are gone."""
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=30)
        for pid_file in reversed(self._pids):
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            if not poll_until(lambda pid=pid: not alive(pid), 15):
                os.kill(pid, signal.SIGKILL)


def cluster(tmp_root: Path) -> Iterator[SlurmCluster]:
    why_not = _dev().slurm_skip_reason()  # only dev.py test installs SLURM, and only when asked
    if why_not:
        pytest.skip(why_not)
    if os.geteuid() != 0:
        pytest.skip("the test SLURM cluster runs slurmd, which starts jobs as their users: only root can run it")
    c = SlurmCluster(tmp_root)
    try:
        c.start()
        yield c
    finally:
        c.stop()
