#!/usr/bin/env python3
"""Set up a development environment and run Rigpilot or its tests.

    python3 dev.py app      # set up .venv if needed, then launch Rigpilot
    python3 dev.py test     # set up .venv if needed, then lint and run the whole test suite
                            # (one test process per core, up to 4; -n 1 for one)
    python3 dev.py setup    # only set up .venv
    python3 dev.py lint     # ruff, import-linter and mypy (against mypy-baseline.txt), as test runs them first
    python3 dev.py lint --update-mypy-baseline  # write mypy's findings as the new baseline (it may only shrink)
    python3 dev.py test --help                  # test's own option, then pytest's (arguments go to pytest)
    python3 dev.py test --install-system-deps   # also install what the SLURM tests need (root, apt-get)
    python3 dev.py test --fast                  # the inner loop: all but the tests marked slow
    python3 dev.py test --fast tests/unit       # one folder of tests: unit, gui, engine, workers or packaging

Needs only python3 (>= 3.11) with its venv and ensurepip modules (Debian/Ubuntu: python3-venv).

What each command installs, where, and what needs root:
  setup, app, test   Python packages only, into .venv in this folder ($RIGPILOT_VENV names another):
                     PyTorch, Rigpilot (editable, pointing here) with its dependencies and dev tools,
                     from PyPI and PyTorch's CPU index; pip caches downloads in ~/.cache/pip. No root;
                     nothing else on the system changes. The app and its engine keep your settings,
                     jobs and caches in your own ~/.config, ~/.local and ~/.cache (rigpilot folders).
  test --install-system-deps, or test with CI=true
                     also the system packages only the SLURM tests need, with apt-get, system-wide,
                     so as root: slurm-wlm, munge and openssh-server. Their services are not started,
                     and what they enable at boot is disabled again: the tests run their own private
                     slurmctld, slurmd, munged and sshd. Without it those tests skip and say why;
                     dev.py never installs system packages unasked. As root with CI=true (or
                     RIGPILOT_TEST_INSTALL=1) the packaging tests also install Rigpilot's .deb here
                     and purge it again, and build Debian roots in ~/.cache/rigpilot-tests
                     (installing mmdebstrap where it is missing).

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
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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


def project_table(name: str) -> dict:
    """A [tool.NAME] table of pyproject.toml."""
    import tomllib  # not at the top: an older python3 must get as far as main's version message

    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f).get("tool", {}).get(name, {})


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


# The system packages only some tests need, and the commands that tell whether each is there. dev.py test
# installs them with apt-get only when asked (--install-system-deps, or CI=true); without them those tests skip.
SLURM_PACKAGES = ("slurm-wlm", "munge")  # Debian's slurmctld + slurmd + client commands, and its authentication
SLURM_COMMANDS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "sacct", "scancel")
SSH_PACKAGES = ("openssh-server",)  # for the test that submits through a login node over ssh
SSH_COMMANDS = ("sshd", "ssh", "ssh-keygen")
TEST_SYSTEM_PACKAGES = ((SLURM_PACKAGES, SLURM_COMMANDS), (SSH_PACKAGES, SSH_COMMANDS))
INSTALL_FLAG = "--install-system-deps"
SLURM_INSTALL_SECONDS = 300
POLICY_RC = Path("/usr/sbin/policy-rc.d")
# Where a package's maintainer scripts enable a service at boot: systemd's wants/requires links and
# aliases (system-wide and for every user), and SysV start links.
ENABLEMENT_GLOBS = (
    "etc/systemd/system/*.wants/*", "etc/systemd/system/*.requires/*", "etc/systemd/system/*.upholds/*",
    "etc/systemd/system/*", "etc/systemd/user/*.wants/*", "etc/systemd/user/*.requires/*", "etc/systemd/user/*",
    "etc/rc?.d/S*",
)  # fmt: skip
FAST_FLAG = "--fast"
TEST_HELP = f"""\
python3 dev.py test [{INSTALL_FLAG}] [{FAST_FLAG}] [PYTEST ARGUMENTS]

Sets up .venv if needed (Python packages only, into {VENV}),
lints (ruff, import-linter, mypy: dev.py lint), then runs pytest with the arguments given: the whole suite when
there are none. The tests are in one folder per kind: tests/unit, tests/gui, tests/engine, tests/workers,
tests/packaging; name one or more to run only those.

  {FAST_FLAG}                  the inner loop: leave out the tests marked slow (real jobs, .deb builds);
                          CI and a last check before a commit run the whole suite
  {INSTALL_FLAG}   also install the system packages only the SLURM tests need
                          ({" ".join(p for packages, _ in TEST_SYSTEM_PACKAGES for p in packages)}) with apt-get, system-wide,
                          so as root. It says so first; their services are not started, and
                          what they enable at boot is disabled again: the tests run their own
                          private slurmctld, slurmd, munged and sshd. CI=true does the same.
                          Without it those tests skip and say why.

pytest's own options follow.
"""


def missing_commands(names: tuple[str, ...]) -> list[str]:
    return [c for c in names if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]


def split_test_args(args: list[str]) -> tuple[bool, list[str]]:
    """dev.py test's own flag, and the arguments that go to pytest (all the others, in order).

    After a "--" everything is pytest's, so a test path that looks like the flag still reaches it.
    """
    end = args.index("--") if "--" in args else len(args)
    own = [a for a in args[:end] if a == INSTALL_FLAG]
    return bool(own), [a for a in args[:end] if a != INSTALL_FLAG] + args[end:]


def split_fast(args: list[str]) -> tuple[bool, list[str]]:
    """dev.py test's --fast (before any "--"), and the rest: the inner loop leaves out the slow tests."""
    end = args.index("--") if "--" in args else len(args)
    fast = FAST_FLAG in args[:end]
    return fast, [a for a in args[:end] if a != FAST_FLAG] + args[end:]


def wants_help(pytest_args: list[str]) -> bool:
    end = pytest_args.index("--") if "--" in pytest_args else len(pytest_args)
    return any(a in ("-h", "--help") for a in pytest_args[:end])


def missing_system_packages() -> list[str]:
    """The test-only system packages that are not installed here (judged by their commands)."""
    return [p for packages, commands in TEST_SYSTEM_PACKAGES if missing_commands(commands) for p in packages]


def install_requested(flag: bool, environ: Mapping[str, str]) -> str | None:
    """Why dev.py test may install system packages ("--install-system-deps", "CI=true"); None: it may not."""
    if flag:
        return INSTALL_FLAG
    if environ.get("CI") == "true":
        return "CI=true"
    return None


def slurm_skip_reason() -> str | None:
    """Why the SLURM tests skip here, in one line; None when SLURM's commands are all there. Changes nothing."""
    missing = missing_commands(SLURM_COMMANDS)
    if not missing:
        return None
    return (f"SLURM is not installed ({', '.join(missing)} missing): as root, python3 dev.py test {INSTALL_FLAG} "
            f"installs {' '.join(SLURM_PACKAGES)} for the tests (or: apt install {' '.join(SLURM_PACKAGES)})")  # fmt: skip


def cannot_install() -> str | None:
    """Why this machine's system packages cannot be installed by dev.py; None when they can."""
    if os.geteuid() != 0:
        return "installing system packages needs root"
    if shutil.which("apt-get") is None:
        return "dev.py installs them only with apt-get (Debian, Ubuntu), and there is none here"
    return None


@contextmanager
def services_kept_from_starting(policy: Path = POLICY_RC) -> Iterator[bool]:
    """While installing: a policy-rc.d that forbids maintainer scripts to start services (invoke-rc.d and
    deb-systemd-invoke ask it). An existing one is the administrator's (or the container's) and is left
    alone; yields whether this one is dev.py's.
    """
    # 101: "action forbidden by policy". The comment says whose it is should dev.py be killed meanwhile.
    ours = "#!/bin/sh\n# Written by Rigpilot's dev.py while it installs test packages; remove if left behind.\nexit 101\n"
    try:
        fd = os.open(policy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755)
    except FileExistsError:
        try:
            left_behind = policy.read_text() == ours  # by a dev.py that was killed: it must not block services for good
        except (OSError, UnicodeDecodeError):
            left_behind = False
        if not left_behind:
            yield False
            return
    else:
        with os.fdopen(fd, "w") as f:
            f.write(ours)
    try:
        yield True
    finally:
        policy.unlink(missing_ok=True)


def enablement(root: Path = Path("/")) -> frozenset[Path]:
    """Every link under `root` that starts a service at boot (or a user's login), masks left out."""
    found = set()
    for pattern in ENABLEMENT_GLOBS:
        for link in root.glob(pattern):
            if link.is_symlink() and os.readlink(link) != "/dev/null":
                found.add(link)
    return frozenset(found)


def _unit_of(link: Path, root: Path) -> tuple[str, str]:
    """(kind, name) of what a link enables: "system" or "user" and its unit, or "sysv" and its script."""
    parts = link.relative_to(root).parts
    if parts[1].startswith("rc"):
        return "sysv", re.sub(r"^S\d*", "", link.name)
    name = Path(os.readlink(link)).name if link.parent.name in ("system", "user") else link.name
    return parts[2], name


def _service(unit: str) -> str:
    """ssh for ssh.service and the SysV script ssh: systemctl and update-rc.d each act on both."""
    return unit.removesuffix(".service")


def disable_again(before: frozenset[Path], root: Path = Path("/")) -> list[str]:
    """Disable what was enabled since `before` (enablement(root) then): the units and scripts, in words.

    With the system's own tools, which work without a running init (systemctl, which also syncs a
    service's SysV links, and update-rc.d), where the service had nothing enabled before, so that no
    earlier choice of the administrator's is touched; then by hand whatever new link is left (systemd's
    removed, a SysV start link renamed to a stop link, as update-rc.d does). Either way the choice
    lasts: on upgrade, maintainer scripts enable a unit again only where all its links are there, and
    update-rc.d defaults adds none to a script that has stop links.
    """
    new = enablement(root) - before
    units = sorted({_unit_of(link, root) for link in new})
    if root == Path("/"):
        touched_before = {_service(_unit_of(link, root)[1]) for link in before}
        tools = {"system": ["systemctl", "--no-reload", "--quiet", "disable"],
                 "user": ["systemctl", "--global", "--quiet", "disable"], "sysv": ["update-rc.d"]}  # fmt: skip
        for kind, name in units:
            if _service(name) in touched_before or shutil.which(tools[kind][0]) is None:
                continue
            cmd = [*tools[kind], name, *(["disable"] if kind == "sysv" else [])]
            try:
                subprocess.run(cmd, capture_output=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass  # the links left are undone below
    for link in enablement(root) - before:
        if _unit_of(link, root)[0] == "sysv":
            link.rename(link.with_name("K" + link.name[1:]))
        else:
            link.unlink()
    return [f"{name} (SysV)" if kind == "sysv" else name for kind, name in units]


def policy_forbids_starts(policy: Path = POLICY_RC) -> bool:
    """Whether the policy-rc.d there answers "forbidden" (101) to starting a service, as invoke-rc.d asks it."""
    try:
        return subprocess.run([policy, "ssh", "start"], capture_output=True, timeout=30).returncode == 101
    except (OSError, subprocess.TimeoutExpired):
        return False


def install_system_packages(packages: list[str]) -> str | None:
    """apt-get install `packages`, keeping their services from starting and disabling at boot again what
    they enabled; None when done, else why not in one line."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", "DPkg::Lock::Timeout=300"]  # a freshly booted machine's unattended-upgrades holds the lock a while
    install = ["apt-get", *wait, "install", "-y", "-qq", "--no-install-recommends", *packages]
    before = enablement()
    r: subprocess.CompletedProcess | None = None
    try:
        with services_kept_from_starting() as ours:
            if not ours and not policy_forbids_starts():
                print(f"  note: {POLICY_RC} is not dev.py's and allows package scripts to start services: it is "
                      "left alone, so these packages' services may start now", flush=True)  # fmt: skip
            for cmd in (install, ["apt-get", *wait, "update", "-qq"], install):
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=SLURM_INSTALL_SECONDS)
                if cmd is install and r.returncode == 0:
                    break  # the package lists were fresh enough: no update needed
    except subprocess.TimeoutExpired:
        return f"installing {' '.join(packages)} took over {SLURM_INSTALL_SECONDS} s"
    finally:
        # Also after a failure: packages configured before it may have enabled theirs.
        disabled = disable_again(before)
        if disabled:
            print(f"  disabled at boot again what installing them enabled: {', '.join(disabled)}", flush=True)
    if r is None or r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no reason given"])[-1] if r else "it did not run"
        return f"apt-get could not install {' '.join(packages)}: {why}"
    return None


def prepare_test_system(flag: bool) -> str | None:
    """Install the test-only system packages where asked to; why the SLURM tests will skip, or None.

    Asked to means --install-system-deps or CI=true (which .ci/run's environment sets): a developer's
    own machine is never changed unasked. Says what it installs, and why, before it does.
    """
    missing = missing_system_packages()
    why = install_requested(flag, os.environ)
    if missing and why:
        if reason := cannot_install():
            if flag:
                sys.exit(f"dev.py: {INSTALL_FLAG}: {reason}. Install them yourself (sudo apt-get install "
                         f"--no-install-recommends {' '.join(missing)}) or leave the flag out: the tests that "
                         "need them skip.")  # fmt: skip
            slurm = slurm_skip_reason()
            return f"{slurm} ({why}, but {reason})" if slurm else None
        commands = [c for _, cmds in TEST_SYSTEM_PACKAGES for c in missing_commands(cmds)]
        print(f"dev.py test ({why}): installing {' '.join(missing)} system-wide with apt-get, for the SLURM tests "
              f"({', '.join(commands)} missing). Their services are not started, and what they enable at boot "
              "is disabled again.", flush=True)  # fmt: skip
        if failed := install_system_packages(missing):
            return failed
    return slurm_skip_reason()


MAX_TEST_WORKERS = 4


def pytest_workers(pytest_args: list[str]) -> list[str]:
    """pytest-xdist's options for the suite: one test process per core, up to MAX_TEST_WORKERS.

    Most of the suite's time is spent waiting on other processes (engines, torchrun ranks, Xvfb, apt),
    so on 2 cores two test processes take about two thirds of the time of one. A file's tests stay
    together on one process (--dist loadfile): many share a module fixture (a trained job, a built
    .deb). More processes than cores would make the multi-rank jobs wait on each other for the CPU.
    Nothing is added where the arguments choose for themselves (-n, -p no:xdist) or ask for one test
    process (--pdb, --trace, --lf, --sw).
    A test process that crashes ends the run (--max-worker-restart 0): its test fails either way, and a
    replacement process once left a run waiting until CI's limit with no summary printed.
    """
    own = ("-n", "--numprocesses", "--dist", "-d", "--pdb", "--trace", "--lf", "--last-failed", "--sw", "--stepwise")
    if any(a.split("=")[0] in own or (a.startswith("-n") and a[2:].isdigit()) for a in pytest_args):
        return []
    if "-pno:xdist" in pytest_args or any(pair == ("-p", "no:xdist") for pair in itertools.pairwise(pytest_args)):
        return []
    workers = min(len(os.sched_getaffinity(0)), MAX_TEST_WORKERS)
    return ["-n", str(workers), "--dist", "loadfile", "--max-worker-restart", "0"] if workers > 1 else []


def cmd_test(args: list[str]) -> int:
    install_flag, args = split_test_args(args)
    fast, args = split_fast(args)
    if fast:
        args = ["-m", "not slow", *args]
    if wants_help(args):  # dev.py's own option, then pytest's; nothing is installed for that
        print(TEST_HELP, flush=True)
        ensure_env()
        return subprocess.run([str(venv_bin("python")), "-m", "pytest", *args], cwd=ROOT).returncode
    why_not = prepare_test_system(install_flag)
    ensure_env()
    if why_not:
        print(f"note: the SLURM tests will skip: {why_not}", flush=True)
    if rc := lint():
        return rc
    env = {**os.environ, "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "offscreen")}
    return run_step([venv_bin("python"), "-m", "pytest", *pytest_workers(args), *args], env)


def run_step(command: list[str | Path], env: Mapping[str, str] | None = None) -> int:
    print("+", " ".join(str(c) for c in command), flush=True)
    return subprocess.run([str(c) for c in command], cwd=ROOT, env=env).returncode


MYPY_BASELINE = ROOT / "mypy-baseline.txt"
_MYPY_ERROR = re.compile(r"^(?P<path>[^:\n]+):\d+(?::\d+)?: error: (?P<text>.*)$")


def mypy_findings(output: str) -> list[str]:
    """mypy's errors without their line numbers ("path: message  [code]"): an edit above one must not
    make it new. Notes are left out; an error found twice in a file is listed twice."""
    return sorted(f"{m['path']}: {m['text'].rstrip()}" for line in output.splitlines() if (m := _MYPY_ERROR.match(line)))


def baseline_verdict(found: list[str], baseline: list[str]) -> tuple[list[str], list[str]]:
    """(errors not in the baseline, baseline entries mypy no longer finds), each as often as it is over."""
    from collections import Counter

    have, known = Counter(found), Counter(baseline)
    return sorted((have - known).elements()), sorted((known - have).elements())


def mypy_check(update: bool = False) -> int:
    """mypy over the installed `rigpilot` package against the committed baseline, which may only shrink:
    a new error fails the lint; a baseline entry that is gone asks for the baseline to be rewritten."""
    command = [venv_bin("mypy"), "-p", "rigpilot"]
    print("+", " ".join(str(c) for c in command), flush=True)
    done = subprocess.run([str(c) for c in command], cwd=ROOT, capture_output=True, text=True)
    found = mypy_findings(done.stdout)
    if done.returncode not in (0, 1) or (done.returncode == 1 and not found):
        print(done.stdout + done.stderr, file=sys.stderr)
        return done.returncode or 1
    baseline = MYPY_BASELINE.read_text().splitlines() if MYPY_BASELINE.exists() else []
    new, gone = baseline_verdict(found, baseline)
    for line in new:
        print(line, file=sys.stderr)
    if update and not new:
        MYPY_BASELINE.write_text("".join(f"{line}\n" for line in found))
        print(f"wrote {MYPY_BASELINE.name}: {len(found)} errors", flush=True)
        return 0
    if update:  # the update only drops fixed entries; a module that moved has its path rewritten in the file by hand
        print(f"mypy: {len(new)} error(s) not in {MYPY_BASELINE.name} (above): fix them first; the baseline only shrinks",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1
    if new:
        print(f"mypy: {len(new)} error(s) not in {MYPY_BASELINE.name} (above): fix them; the baseline may only shrink",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1
    if gone:
        print(f"mypy: {len(gone)} error(s) of {MYPY_BASELINE.name} are fixed: shrink it with "
              "'python3 dev.py lint --update-mypy-baseline'", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    print(f"mypy: {len(found)} known errors (the baseline), none new", flush=True)
    return 0


def lint(update_baseline: bool = False) -> int:
    """ruff over the lint paths (pyproject.toml's [tool.rigpilot] lint-paths), import-linter, then mypy."""
    paths = project_table("rigpilot").get("lint-paths") or sys.exit("pyproject.toml: [tool.rigpilot] has no lint-paths")
    for command in ([venv_bin("ruff"), "check", *paths], [venv_bin("lint-imports")]):
        if rc := run_step(command):
            return rc
    return mypy_check(update_baseline)


def cmd_lint(args: list[str]) -> int:
    unknown = [a for a in args if a != "--update-mypy-baseline"]
    if unknown:
        sys.exit(f"dev.py lint: unknown option {unknown[0]} (it takes only --update-mypy-baseline)")
    ensure_env()
    return lint(update_baseline=bool(args))


def window_problem() -> str | None:
    """Why the app's window cannot open on this machine, in one line; None when it can (or the check is skipped)."""
    spec = importlib.util.spec_from_file_location("rigpilot_qt_runtime", ROOT / "packaging" / "qt_runtime.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.check()


def cmd_app(args: list[str]) -> int:
    # Asked first: a missing system library must not cost the newcomer the whole set-up and then a Qt abort.
    # Only for the window: with arguments it is a command, --self-test or --screenshots (offscreen), or --help.
    problem = None if args else window_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    ensure_env()
    os.execv(venv_bin("rigpilot"), [str(venv_bin("rigpilot")), *args])
    return 0  # not reached


def main() -> int:
    if sys.version_info < (3, 11):  # noqa: UP036 -- dev.py may be started by an older system python3
        sys.exit(f"Rigpilot needs Python 3.11 or newer; this is {sys.version.split()[0]}.")
    if len(sys.argv) < 2 or sys.argv[1] not in ("app", "test", "setup", "lint"):
        print(__doc__.strip())
        return 0 if sys.argv[1:2] in (["-h"], ["--help"], ["help"]) else 2
    verb, rest = sys.argv[1], sys.argv[2:]
    try:
        if verb == "setup":
            ensure_env()
            return 0
        if verb == "lint":
            return cmd_lint(rest)
        return cmd_test(rest) if verb == "test" else cmd_app(rest)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
