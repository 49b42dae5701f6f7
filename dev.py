#!/usr/bin/env python3
"""Set up a development environment and run Rigpilot or its tests.

    python3 dev.py app      # set up .venv if needed, then launch Rigpilot
    python3 dev.py test     # set up .venv if needed, then lint and run the whole test suite

Needs only python3 (>= 3.11) with the venv module. The set-up is skipped when
nothing it depends on changed since the last run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("RIGPILOT_VENV", ROOT / ".venv"))
STAMP = VENV / ".rigpilot-setup"
# The test set-up pins torch: pip then takes the CPU build on machines without a GPU here,
# and the CUDA build where one exists. An unpinned torch would pull the newest CUDA wheels.
TORCH_PIN = "torch==2.13.0"
CPU_WHEEL_INDEX = "https://download.pytorch.org/whl/cpu"


def venv_bin(name: str) -> Path:
    return VENV / "bin" / name


def has_nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3):
            return True
    except Exception:
        return False


def setup_fingerprint() -> str:
    h = hashlib.sha256()
    for f in ("pyproject.toml", "dev.py"):
        h.update((ROOT / f).read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()


def run(cmd: list[str | Path], **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def ensure_env() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 -- dev.py may be started by an older system python3
        sys.exit(f"Rigpilot needs Python 3.11 or newer; this is {sys.version.split()[0]}.")
    fingerprint = setup_fingerprint()
    if venv_bin("python").exists() and STAMP.exists() and STAMP.read_text() == fingerprint:
        return
    if not venv_bin("python").exists():
        try:
            import venv  # noqa: F401
        except ImportError:
            sys.exit("python3's venv module is missing: install it (Debian/Ubuntu: apt install python3-venv).")
        run([sys.executable, "-m", "venv", VENV])
    pip = [venv_bin("python"), "-m", "pip", "install", "--disable-pip-version-check"]
    torch_args: list[str | Path] = [TORCH_PIN]
    # Without an NVIDIA driver, PyPI's Linux torch wheel would still bring gigabytes of CUDA
    # libraries. Prefer PyTorch's CPU wheel index when it can be reached.
    if not has_nvidia_driver() and reachable(CPU_WHEEL_INDEX + "/torch/"):
        torch_args += ["--extra-index-url", CPU_WHEEL_INDEX]
    run([*pip, *torch_args])
    run([*pip, "-e", f"{ROOT}[workers,dev]"])
    STAMP.write_text(fingerprint)


def cmd_test(args: list[str]) -> int:
    ensure_env()
    env = {**os.environ, "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "offscreen")}
    steps: list[list[str | Path]] = [
        [venv_bin("ruff"), "check", "app", "engine", "tests", "benchmarks", "packaging", "examples", "rigpilot/__init__.py", "dev.py"],
        [venv_bin("lint-imports")],
        [venv_bin("python"), "-m", "pytest", *args],
    ]
    for step in steps:
        print("+", " ".join(str(c) for c in step), flush=True)
        rc = subprocess.run([str(c) for c in step], cwd=ROOT, env=env).returncode
        if rc != 0:
            return rc
    return 0


def cmd_app(args: list[str]) -> int:
    ensure_env()
    os.execv(venv_bin("rigpilot"), [str(venv_bin("rigpilot")), *args])
    return 0  # not reached


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("app", "test", "setup"):
        print(__doc__.strip())
        return 2
    verb, rest = sys.argv[1], sys.argv[2:]
    if verb == "setup":
        ensure_env()
        return 0
    return cmd_test(rest) if verb == "test" else cmd_app(rest)


if __name__ == "__main__":
    sys.exit(main())
