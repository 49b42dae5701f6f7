"""The Debian 13 root the packaging test installs into: Debian's Python 3.13, a CPython 3.11 for the
engine environment, and torch's gloo ranks working inside it.

Builds a root from Debian's mirror once (cached, about 170 MB), so it runs only as root and where
CI=true or RIGPILOT_TEST_INSTALL=1 says this machine may be used for it, like the packaging test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from support import debian_root
from support.paths import REPO

PACKAGES = ("python3", "python3-venv")
WHEEL_DIRS = [Path(p) for p in os.environ.get("RIGPILOT_TEST_WHEELS", "/opt/wheels").split(os.pathsep) if p]


def _may_build() -> str | None:
    if os.environ.get("CI") != "true" and os.environ.get("RIGPILOT_TEST_INSTALL") != "1":
        return "builds a Debian root as root: runs where CI=true or RIGPILOT_TEST_INSTALL=1"
    return debian_root.unavailable("trixie", PACKAGES)


def _torch_pin() -> str:
    workers = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["workers"]
    return next(req.split("==")[1] for req in workers if req.startswith("torch=="))


def _torch_wheelhouse(cache: Path) -> Path:
    """The pinned CPU torch wheel for cp311 and its dependencies, in a folder (made once)."""
    version = _torch_pin()
    wheels = [w for d in WHEEL_DIRS for w in d.glob(f"torch-{version}+cpu-cp311-cp311-*x86_64.whl")]
    if not wheels:
        pytest.skip(f"no torch {version}+cpu cp311 wheel in {os.pathsep.join(map(str, WHEEL_DIRS))} "
                    "(set RIGPILOT_TEST_WHEELS)")
    house = cache / "wheels" / f"torch-{version}+cpu-cp311"
    if not house.is_dir():
        partial = house.with_name(house.name + f".partial-{os.getpid()}")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--dest", str(partial),
                            "--only-binary=:all:", "--python-version", "3.11", str(wheels[0])],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        partial.rename(house)
    return house


GLOO = """
import multiprocessing.shared_memory, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(rank, shared, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    shared[rank] = t.item()
    dist.destroy_process_group()

if __name__ == "__main__":
    assert dist.is_gloo_available()
    block = multiprocessing.shared_memory.SharedMemory(create=True, size=1 << 20)  # in /dev/shm
    block.close(); block.unlink()
    shared = torch.zeros(2).share_memory_()
    mp.spawn(rank, args=(shared, sys.argv[1]), nprocs=2)
    print(torch.__version__, shared.tolist())
"""


@pytest.mark.slow
@pytest.mark.skipif(_may_build() is not None, reason=str(_may_build()))
def test_debian13_root_runs_python313_python311_and_gloo(tmp_path):
    base = debian_root.root("trixie", PACKAGES)
    wheels = _torch_wheelhouse(debian_root.default_cache_dir().parent)
    with debian_root.writable_copy(base, tmp_path / "copy") as root:
        version = debian_root.run(root, ["python3", "--version"])
        assert version.returncode == 0 and version.stdout.startswith("Python 3.13."), version

        py311 = debian_root.python311(root)
        assert debian_root.run(root, [py311, "-c", "import sys; print(sys.version_info[:2])"]).stdout == "(3, 11)\n"
        # Debian's python3 is still the root's python3: the 3.11 went in beside it.
        assert debian_root.run(root, ["python3", "--version"]).stdout.startswith("Python 3.13.")

        make = debian_root.run(root, [py311, "-m", "venv", "/opt/torchenv"], timeout=300)
        assert make.returncode == 0, make.stderr
        install = debian_root.run(root, ["/opt/torchenv/bin/pip", "install", "-q", "--no-index", "--find-links",
                                         "/wheels", f"torch=={_torch_pin()}+cpu"],
                                  binds={wheels: "/wheels"}, timeout=900)
        assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]

        (root / "tmp/gloo.py").write_text(GLOO)
        # As a user other than root, as the engine runs its ranks: /dev/shm and /tmp must be theirs too.
        job = debian_root.run(root, ["/opt/torchenv/bin/python", "/tmp/gloo.py", "/tmp/gloo-store"],
                              user="nobody", env={"OMP_NUM_THREADS": "1"}, timeout=300)
        assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
        assert job.stdout.split(" ", 1) == [f"{_torch_pin()}+cpu", "[3.0, 3.0]\n"], job.stdout

    # Nothing the test did reached the cached root.
    assert not (base / "opt/torchenv").exists() and not (base / "usr/local/bin/python3.11").exists()
    assert debian_root.root("trixie", PACKAGES) == base
