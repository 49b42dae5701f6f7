#!/usr/bin/env python3
"""Set up a development environment and run Rigpilot or its tests.

    python3 dev.py app      # set up .venv if needed, then launch Rigpilot
    python3 dev.py test     # set up .venv if needed, then lint and run the whole test suite
    python3 dev.py setup    # only set up .venv

Needs only python3 (>= 3.11) with its venv and ensurepip modules (Debian/Ubuntu: python3-venv).
The set-up is skipped when nothing it depends on changed since the last run. On a machine without
an NVIDIA driver it installs PyTorch's CPU build, and stops rather than fall back to the CUDA one;
RIGPILOT_ALLOW_CUDA_TORCH=1 accepts the CUDA build there.

Before it sets anything up, `app` checks in a second that the window can open here: that there is a
display, and that the system libraries Qt's display plugin links are installed (packaging/qt-runtime.toml,
the list the .deb depends on). When one is missing it prints the one command that installs them
(apt, dnf or pacman) and exits 2; RIGPILOT_SKIP_DISPLAY_CHECK=1 skips the check.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("RIGPILOT_VENV", ROOT / ".venv"))
STAMP = VENV / ".rigpilot-setup"
CPU_WHEEL_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_SECONDS = 3.0


def venv_bin(name: str) -> Path:
    return VENV / "bin" / name


def has_nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def reachable(url: str, seconds: float = PROBE_SECONDS) -> bool:
    """Whether url answers within `seconds`, name lookup included.

    urlopen's timeout does not cover getaddrinfo, which waits 10 s and more on a silent resolver,
    so the request runs in a daemon thread that is left behind when the time is up.
    """
    answers: list[bool] = []

    def probe() -> None:
        try:
            with urllib.request.urlopen(url, timeout=seconds):
                answers.append(True)
        except Exception:
            answers.append(False)

    thread = threading.Thread(target=probe, name="dev.py probe", daemon=True)
    thread.start()
    thread.join(seconds)
    return answers == [True]


def torch_pin() -> str:
    """The workers extra's exact torch requirement: the one torch version the suite is tested with."""
    import tomllib  # not at the top: an older python3 must get as far as main's version message

    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f).get("project", {}).get("optional-dependencies", {})
    for requirement in extras.get("workers", []):
        if re.fullmatch(r"torch\s*==\s*[\w.+!]+", requirement.strip()):
            return requirement.replace(" ", "")
    sys.exit("pyproject.toml: the workers extra has no exact torch pin (torch==X.Y.Z) for dev.py to install.")


def cuda_packages(report: dict) -> list[str]:
    """The CUDA builds in a pip installation report (pip install --dry-run --report): a torch whose
    local version is not +cpu, and NVIDIA's libraries. Empty when pip would install CPU torch, or
    none because the pinned one is already there."""
    found = []
    for item in report.get("install", []):
        name = re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
        version = item["metadata"]["version"]
        local = version.partition("+")[2]
        if name.startswith("nvidia-") or (name == "torch" and local.split(".")[0] != "cpu"):
            found.append(f"{name} {version}")
    return found


def require_cpu_torch(pip: list[str | Path], torch_args: list[str | Path], index_reachable: bool) -> None:
    """Stop unless pip would install a CPU build of torch: this machine has no NVIDIA driver, and
    PyPI's Linux torch brings gigabytes of CUDA libraries.

    pip is asked with --dry-run, which fetches metadata only where the index serves it apart
    (PEP 658, as PyPI does; else the torch wheel itself), and --no-deps: the CUDA libraries are
    torch's dependencies, a torch without +cpu is reason enough and theirs need not be fetched.
    """
    if os.environ.get("RIGPILOT_ALLOW_CUDA_TORCH") == "1":
        return
    with tempfile.TemporaryDirectory(prefix="rigpilot-dev-") as tmp:
        report = Path(tmp) / "report.json"
        dry_run = [*pip, "--dry-run", "--quiet", "--no-deps", "--report", report, *torch_args]
        step("ask pip which torch build it would install", dry_run)
        cuda = cuda_packages(json.loads(report.read_text()))
    if cuda:
        sys.exit(cuda_message(str(torch_args[0]), cuda, index_reachable))


def cuda_message(pin: str, cuda: list[str], index_reachable: bool) -> str:
    version = pin.partition("==")[2]
    why = (
        f"PyTorch's CPU index ({CPU_WHEEL_INDEX}) has no {pin} wheel for this Python"
        if index_reachable
        else f"PyTorch's CPU index ({CPU_WHEEL_INDEX}) cannot be reached"
    )
    wheel = f"torch-{version}+cpu-cp{sys.version_info.major}{sys.version_info.minor}-*.whl"
    return (
        f"{why}, and this machine has no NVIDIA driver: pip would install the CUDA build ({', '.join(cuda)}), "
        f"gigabytes of libraries it cannot use. Make download.pytorch.org reachable, or put {wheel} in a folder "
        "and set PIP_FIND_LINKS=that-folder, or set RIGPILOT_ALLOW_CUDA_TORCH=1 to install the CUDA build anyway; "
        "then run dev.py again."
    )


def venv_tools_missing() -> str | None:
    """What to install when this python3 cannot make a virtual environment with pip in it, else None.

    Debian and Ubuntu ship venv without ensurepip (it is in python3.X-venv): `python3 -m venv` then
    fails half-way, leaving an environment without pip.
    """
    ensurepip = importlib.util.find_spec("ensurepip")
    if importlib.util.find_spec("venv") is not None and ensurepip is not None and ensurepip.origin:
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (
        f"python3 {version} ({sys.executable}) cannot create a virtual environment with pip: its venv/ensurepip "
        f"modules are missing. On Debian/Ubuntu: sudo apt install python{version}-venv"
    )


def venv_has_pip() -> bool:
    python = venv_bin("python")
    return python.exists() and subprocess.run([python, "-c", "import pip"], capture_output=True).returncode == 0


def ensure_venv() -> None:
    if venv_has_pip():
        return
    missing = venv_tools_missing()
    if missing:
        sys.exit(missing)
    create: list[str | Path] = [sys.executable, "-m", "venv"]
    if (VENV / "pyvenv.cfg").exists():
        # Left without pip by a run that failed half-way (no ensurepip), or its Python is gone.
        print(f"{VENV} has no working pip: creating it again.", flush=True)
        create.append("--clear")
    step("create the virtual environment", [*create, VENV])


def setup_fingerprint() -> str:
    h = hashlib.sha256()
    for f in ("pyproject.toml", "dev.py"):
        h.update((ROOT / f).read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()


def step(what: str, cmd: list[str | Path]) -> None:
    """One set-up step; when it fails, dev.py ends with one line (the tool said why above it)."""
    print("+", " ".join(str(c) for c in cmd), flush=True)
    try:
        failed = subprocess.run([str(c) for c in cmd]).returncode != 0
    except OSError as e:
        print(e, file=sys.stderr)
        failed = True
    if failed:
        sys.exit(f"Set-up failed at: {what}. Fix what is said above and run dev.py again: it picks up from there.")


def ensure_env() -> None:
    fingerprint = setup_fingerprint()
    if venv_bin("python").exists() and STAMP.exists() and STAMP.read_text() == fingerprint:
        return
    ensure_venv()
    pip: list[str | Path] = [venv_bin("python"), "-m", "pip", "install", "--disable-pip-version-check"]
    torch_args: list[str | Path] = [torch_pin()]
    if not has_nvidia_driver():
        index_reachable = reachable(CPU_WHEEL_INDEX + "/torch/")
        if index_reachable:
            torch_args += ["--extra-index-url", CPU_WHEEL_INDEX]
        require_cpu_torch(pip, torch_args, index_reachable)
    step("install PyTorch", [*pip, *torch_args])
    step("install Rigpilot and its dependencies", [*pip, "-e", f"{ROOT}[workers,dev]"])
    STAMP.write_text(fingerprint)


SLURM_PACKAGES = ("slurm-wlm", "munge")  # Debian's slurmctld + slurmd + client commands, and its authentication
SSH_PACKAGE = "openssh-server"  # for the test that submits through a login node over ssh; it skips without
SLURM_COMMANDS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "sacct", "scancel")
SLURM_INSTALL_SECONDS = 300
POLICY_RC = Path("/usr/sbin/policy-rc.d")


def missing_commands(names: tuple[str, ...]) -> list[str]:
    return [c for c in names if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]


def ensure_slurm(quiet: bool = False) -> str | None:
    """Install SLURM and munge (and sshd) for the tests that submit real SLURM jobs; None when SLURM is
    there, else why the SLURM tests skip.

    Only as root with apt-get (a CI container, a throw-away VM): a developer's own machine is never
    changed behind their back. The tests start their own daemons on their own config; the packages'
    system services are kept from starting (policy-rc.d), so nothing listens because of this.
    """
    missing = missing_commands(SLURM_COMMANDS)
    if not missing:
        return None
    packages = [*SLURM_PACKAGES, *([SSH_PACKAGE] if missing_commands(("sshd",)) else [])]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return (f"SLURM is not installed ({', '.join(missing)} missing) and only root with apt-get installs it "
                f"for the tests: apt install {' '.join(SLURM_PACKAGES)}")  # fmt: skip
    if not quiet:
        print(f"+ apt-get install {' '.join(packages)} (for the SLURM tests; {', '.join(missing)} missing)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    own_policy = not POLICY_RC.exists()
    try:
        if own_policy:
            POLICY_RC.write_text("#!/bin/sh\nexit 101\n")  # 101: services are not started by package scripts
            POLICY_RC.chmod(0o755)
        for cmd in (install, ["apt-get", "update", "-qq"], install):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=SLURM_INSTALL_SECONDS)
            if cmd is install and r.returncode == 0:
                break  # the package lists were fresh enough: no update needed
    except subprocess.TimeoutExpired:
        return f"installing {' '.join(packages)} took over {SLURM_INSTALL_SECONDS} s"
    finally:
        if own_policy:
            POLICY_RC.unlink(missing_ok=True)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no reason given"])[-1]
        return f"apt-get could not install {' '.join(packages)}: {why}"
    missing = missing_commands(SLURM_COMMANDS)
    return f"SLURM is still incomplete after installing it: {', '.join(missing)} missing" if missing else None


def cmd_test(args: list[str]) -> int:
    ensure_env()
    why_not = ensure_slurm()
    if why_not:
        print(f"note: the SLURM tests will skip: {why_not}", flush=True)
    env = {**os.environ, "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "offscreen")}
    steps: list[list[str | Path]] = [
        [venv_bin("ruff"), "check", "app", "engine", "tests", "benchmarks", "packaging", "examples", "rigpilot/__init__.py", "dev.py"],
        [venv_bin("lint-imports")],
        [venv_bin("python"), "-m", "pytest", *args],
    ]
    for command in steps:
        print("+", " ".join(str(c) for c in command), flush=True)
        rc = subprocess.run([str(c) for c in command], cwd=ROOT, env=env).returncode
        if rc != 0:
            return rc
    return 0


def window_problem() -> str | None:
    """Why the app's window cannot open on this machine, in one line; None when it can (or the check is skipped)."""
    spec = importlib.util.spec_from_file_location("rigpilot_qt_runtime", ROOT / "packaging" / "qt_runtime.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.check()


def cmd_app(args: list[str]) -> int:
    # Asked first: a missing system library must not cost the newcomer the whole set-up and then a Qt abort.
    problem = window_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    ensure_env()
    os.execv(venv_bin("rigpilot"), [str(venv_bin("rigpilot")), *args])
    return 0  # not reached


def main() -> int:
    if sys.version_info < (3, 11):  # noqa: UP036 -- dev.py may be started by an older system python3
        sys.exit(f"Rigpilot needs Python 3.11 or newer; this is {sys.version.split()[0]}.")
    if len(sys.argv) < 2 or sys.argv[1] not in ("app", "test", "setup"):
        print(__doc__.strip())
        return 2
    verb, rest = sys.argv[1], sys.argv[2:]
    try:
        if verb == "setup":
            ensure_env()
            return 0
        return cmd_test(rest) if verb == "test" else cmd_app(rest)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
