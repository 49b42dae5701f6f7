"""Provisioning the engine environment, the per-user Python the job workers run in (engine/runtime.py), with uv.

The command line and the app's install dialog (app/engine_env) both end up here:

    rigpilot engine-env status
    rigpilot engine-env install [--torch-backend auto|cpu|cu126|...] [--python PATH] [--wheel FILE]
                                [--find-links DIR] [--index-url URL]
    rigpilot engine-env install --offline --find-links DIR [--find-links DIR2] [--python PATH]
    rigpilot engine-env wheels [--find-links DIR]     the pip download commands for an offline install
    rigpilot engine-env repair | remove

What goes in comes from Rigpilot's own `workers` extra (pyproject.toml in a
checkout, the installed distribution's metadata otherwise): the one torch
version the suite is tested with (`torch==X`, never an unpinned torch), the
worker libraries, the engine's light dependencies, and Rigpilot itself at
exactly the running version. Machines without an NVIDIA driver get the CPU
build. `--offline` never touches the network (uv --offline --no-index): the
wheels come from folders the user filled with the `pip download` commands that
`engine-env wheels` prints, and a missing wheel is named with those commands.

uv runs with its cache in Rigpilot's own cache folder (never the user's global
uv cache), its configuration files ignored and the UV_*/PIP_* variables that
choose what gets installed removed; `remove` and `repair` delete the cache with
the environment. Installation is resumable: what uv downloaded stays in that
cache, and a step already done (torch installed at the pin) is not redone.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import io
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from rigpilot.engine import __version__, runtime
from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import FOLDER, check_given_path
from rigpilot.engine.runtime import env_dir, env_python, uv_cache_dir

SHIPPED_WHEELS = Path("/opt/rigpilot/wheels")  # where the .deb puts its wheels


def shipped_wheels() -> Path | None:
    """The .deb's wheel folder, for the Rigpilot the .deb installed only (its code lies under /opt/rigpilot).

    A source checkout or a pip install on a machine that also has the package must not build its engine
    environment from another installation's wheels, which a purge may take away half-way through.
    """
    here = Path(__file__).resolve()
    if SHIPPED_WHEELS.parent.resolve() in here.parents and SHIPPED_WHEELS.is_dir():  # /opt may be a link
        return SHIPPED_WHEELS
    return None
PYTORCH_INDEX = "https://download.pytorch.org/whl"
# The app's own dependencies the workers never import (cryptography: the engine service's TLS certificate):
# the engine environment goes without them.
APP_ONLY = frozenset({"pyside6", "pyside6-essentials", "pyqtgraph", "uv", "cryptography"})
# Ambient uv settings that say how to reach the network, not what to install: those are honoured. Every other
# UV_* and PIP_* variable (an index, find-links, constraints, a Python, a cache, offline mode) is dropped, so the
# engine environment is the same whatever the user's shell holds; --index-url is the way to choose an index.
UV_HONOURED = frozenset({
    "UV_NATIVE_TLS", "UV_SYSTEM_CERTS", "UV_HTTP_TIMEOUT", "UV_REQUEST_TIMEOUT", "UV_HTTP_RETRIES",
    "UV_CONCURRENT_DOWNLOADS", "UV_CONCURRENT_BUILDS", "UV_CONCURRENT_INSTALLS", "UV_NO_PROGRESS",
})  # fmt: skip
MIN_PYTHON = (3, 11)  # Rigpilot's requires-python: the engine environment imports it

Progress = Callable[[str], None]


# -- what goes in --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRequirements:
    torch: str  # the tested torch version, "2.13.0"
    packages: tuple[str, ...]  # the other worker packages and the engine's light dependencies, as requirements
    build: tuple[str, ...] = ()  # what building Rigpilot from a source checkout needs (setuptools)
    source: str = ""  # where these were read, for messages


def checkout_root() -> Path | None:
    """The source checkout this code runs from (pyproject.toml beside the package folders), if it is one."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "rigpilot" / "__init__.py").is_file():
        return root
    return None


def worker_requirements() -> WorkerRequirements:
    """The workers extra of the running Rigpilot: from pyproject.toml in a checkout, else the installed metadata."""
    root = checkout_root()
    if root is not None:
        project = tomllib.loads((root / "pyproject.toml").read_text())
        build = project.get("build-system", {}).get("requires", [])
        p = project["project"]
        return _split(p.get("dependencies", []), p.get("optional-dependencies", {}).get("workers", []),
                      f"{root / 'pyproject.toml'}", build)  # fmt: skip
    try:
        requires = importlib.metadata.requires("rigpilot") or []
    except importlib.metadata.PackageNotFoundError:
        raise UserError("Rigpilot's package metadata is missing (neither a checkout nor installed): reinstall Rigpilot") from None
    base, workers = [], []
    for req in requires:
        spec, extras = _without_extra(req)
        if not extras:
            base.append(spec)
        elif "workers" in extras:
            workers.append(spec)
    return _split(base, workers, f"the installed rigpilot {importlib.metadata.version('rigpilot')}", [])


_EXTRA = re.compile(r"""\bextra\s*==\s*["']([\w.-]+)["']""")
_EXTRA_CLAUSE = re.compile(r"""(\s*\band\s+)?\bextra\s*==\s*["'][\w.-]+["'](\s+and\b)?""")
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _without_extra(req: str) -> tuple[str, list[str]]:
    """`torch==2.13.0; extra == "workers"` -> ("torch==2.13.0", ["workers"]); other markers are kept."""
    spec, _, marker = req.partition(";")
    extras = _EXTRA.findall(marker)
    rest = _EXTRA_CLAUSE.sub("", marker).strip()
    return (f"{spec.strip()}; {rest}" if rest else spec.strip()), extras


def normalized_name(req: str) -> str:
    m = _NAME.match(req)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else ""


def _split(base: list[str], workers: list[str], source: str, build: list[str]) -> WorkerRequirements:
    torch = [r for r in workers if normalized_name(r) == "torch"]
    pin = re.fullmatch(r"torch\s*==\s*([0-9][0-9A-Za-z.+!]*)", torch[0].split(";")[0].strip()) if torch else None
    if pin is None:
        found = repr(torch[0]) if torch else "no torch requirement"
        raise UserError(f"Rigpilot's workers extra must pin torch as torch==X (found {found} in {source})")
    others = [r for r in workers if normalized_name(r) != "torch"]
    light = [r for r in base if normalized_name(r) not in APP_ONLY]
    return WorkerRequirements(pin.group(1), tuple(others + light), tuple(build), source)


# -- which build ---------------------------------------------------------------------------------------------


def choose_backend(requested: str, driver: bool) -> str:
    """uv's --torch-backend: `auto` only where an NVIDIA driver is, else the CPU build; an explicit one stays."""
    if requested == "auto" and not driver:
        return "cpu"
    return requested


def driver_version(text: str | None = None) -> tuple[int, ...] | None:
    """The NVIDIA kernel module's version, (570, 86), from /proc/driver/nvidia/version (or `text`)."""
    if text is None:
        try:
            text = Path("/proc/driver/nvidia/version").read_text()
        except OSError:
            return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_tag(backend: str) -> str:
    """The PyTorch index suffix for `backend`: cpu, an explicit cuXXX, or the newest CUDA the driver runs."""
    if backend != "auto":
        return backend
    version = driver_version()
    if version is None:
        return "cu128"
    # The CUDA runtime a driver supports (NVIDIA's table): 580+ runs CUDA 13.0, 570+ 12.8, older 12.6.
    return "cu130" if version >= (580, 0) else "cu128" if version >= (570, 0) else "cu126"


def torch_requirement(pin: str, backend: str, *, offline: bool) -> str:
    """`torch==X`, with the build's local version where offline folders could hold several builds of X."""
    if offline and backend != "auto" and platform.machine() == "x86_64":
        return f"torch=={pin}+{backend}"
    return f"torch=={pin}"


_WHEEL_VERSION = re.compile(r"^[A-Za-z0-9_.]+-([^-]+)-")


def wheel_version(wheel: Path) -> str | None:
    m = _WHEEL_VERSION.match(wheel.name)
    return m.group(1) if m else None


# -- uv ------------------------------------------------------------------------------------------------------


def _uv() -> str:
    try:
        from uv import find_uv_bin  # the uv wheel ships its binary

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
    raise UserError("uv is missing: reinstall Rigpilot (the package ships it)")


def uv_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment uv runs in: Rigpilot's cache, no configuration files, no ambient install settings."""
    env = {
        k: v
        for k, v in runtime.standalone_environment(base).items()
        if not (k.startswith(("UV_", "PIP_")) and k not in UV_HONOURED)
    }
    env.update(UV_CACHE_DIR=str(uv_cache_dir()), UV_NO_CONFIG="1", UV_PYTHON_DOWNLOADS="never")
    return env


def install_commands(
    *,
    uv: str,
    target: Path,
    create_with: str | None,
    clear: bool,
    offline: bool,
    find_links: list[Path],
    index_url: str | None,
    backend: str | None,
    torch_req: str,
    torch_pin: str,
    packages: Iterable[str],
    self_req: str,
) -> list[list[str]]:
    """The uv commands, in order: the environment, torch alone, the other packages, Rigpilot itself."""
    python = str(target / "bin" / "python")
    network = ["--offline", "--no-index"] if offline else ([] if index_url is None else ["--index-url", index_url])
    links = [w for d in find_links for w in ("--find-links", str(d))]
    cmds = []
    if create_with is not None:
        cmds.append([uv, "venv", *(["--offline"] if offline else []), *(["--clear"] if clear else []),
                     "--python", create_with, str(target)])  # fmt: skip
    pip = [uv, "pip", "install", "--python", python, *network, *links]
    by_backend = [] if offline or backend is None else ["--torch-backend", backend]
    cmds.append([*pip, *by_backend, torch_req])
    # The pin again, so that nothing the other packages ask for can move torch off the tested version.
    cmds.append([*pip, *by_backend, f"torch=={torch_pin}", *packages])
    # Reinstalled every time: the environment must hold exactly the running version, also after an upgrade.
    cmds.append([*pip, "--no-deps", "--reinstall-package", "rigpilot", self_req])
    return cmds


class _Failed(Exception):
    def __init__(self, cmd: list[str], rc: int, output: list[str]):
        super().__init__(f"exit {rc}")
        self.cmd, self.rc, self.output = cmd, rc, output


def _run(cmd: list[str], progress: Progress, env: dict[str, str]) -> None:
    progress("$ " + " ".join(cmd))
    tail: deque[str] = deque(maxlen=200)  # enough to explain a failure; uv's errors are short
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            progress(line.rstrip())
            tail.append(line.rstrip())
        rc = proc.wait()
    if rc != 0:
        raise _Failed(cmd, rc, list(tail))


# -- why it failed -------------------------------------------------------------------------------------------

_NETWORK = re.compile(
    r"dns error|error resolving DNS|failed to lookup address|tcp connect error|Connection refused|"
    r"Network is unreachable|No route to host|operation timed out|connection timed out|client error \(Connect\)|"
    r"error sending request for url",
    re.IGNORECASE,
)
_MISSING = (
    re.compile(r"Because (?P<name>[\w.-]+) was not found in the (?:provided package locations|cache|package registry)"),
    re.compile(r"Because (?P<name>[\w.-]+)==\S+? has no wheels with a matching (?P<why>[\w ]+? tag)"),
    re.compile(r"there is no version of (?P<name>[\w.-]+)"),
)
_FETCH = re.compile(r"Failed to fetch: `?(\S+?)`?$")


def missing_package(output: Iterable[str]) -> tuple[str, str] | None:
    """The package uv could not find in the offline folders, and why (empty: not there at all)."""
    text = "\n".join(output)
    for pattern in _MISSING:
        m = pattern.search(text)
        if m:
            why = m.groupdict().get("why") or ""
            return m.group("name"), (f"no wheel with a matching {why}" if why else "")
    return None


def network_failure(output: Iterable[str]) -> str | None:
    """What uv could not reach ("https://… (dns error …)"), when the failure was the network's."""
    lines = list(output)
    if not any(_NETWORK.search(line) for line in lines):
        return None
    url = next((m.group(1) for line in lines if (m := _FETCH.search(line.strip()))), "the package index")
    causes = [line.strip().removeprefix("cause:").strip() for line in lines if line.strip().startswith("cause:")]
    return f"{url} ({causes[-1]})" if causes else url


def download_commands(
    folder: Path, reqs: WorkerRequirements, *, python_version: str, backend: str, from_source: bool = False
) -> list[str]:
    """The `pip download` commands that fill `folder` with every wheel an offline install needs.

    Run on any machine with internet access (another OS too: the target's platform is named): torch from
    PyTorch's index for the build, then the rest from PyPI, torch's own dependencies included.
    """
    tag = cuda_tag(backend)
    arch = platform.machine() or "x86_64"
    target = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
              "--platform", f"manylinux_2_28_{arch}", "--platform", f"manylinux2014_{arch}"]  # fmt: skip
    d = shlex.quote(str(folder))
    common = "pip download " + " ".join(target) + f" -d {d}"
    torch = f"torch=={reqs.torch}"
    rest = [torch, *reqs.packages, *(reqs.build if from_source else ())]
    return [
        f"{common} --no-deps {torch} --index-url {PYTORCH_INDEX}/{tag}",
        # --find-links: the torch just fetched satisfies the others' torch requirement, so PyPI's is never taken.
        f"{common} --find-links {d} " + " ".join(shlex.quote(r) for r in rest),
    ]


def _explain(failed: _Failed, *, offline: bool, folders: list[Path], hint: list[str]) -> UserError:
    last = next((line.strip() for line in reversed(failed.output) if line.strip()), "no output")
    step = " ".join(Path(failed.cmd[0]).name if i == 0 else w for i, w in enumerate(failed.cmd[:4]))
    if offline:
        missing = missing_package(failed.output)
        if missing is not None:
            name, why = missing
            where = ", ".join(str(d) for d in folders)
            uv_hint = [line.strip().removeprefix("hint: ") for line in failed.output if line.startswith("hint: ")]
            return UserError(
                f"the offline install found no {name} wheel{f' ({why})' if why else ''} in {where}.\n"
                + "".join(f"uv: {h}\n" for h in uv_hint[:1])
                + f"On a machine with internet access, fetch every wheel it needs into {folders[0]}, copy the folder "
                "back here and run the same command again:\n" + "\n".join(f"  {c}" for c in hint)
            )
        return UserError(f"installing the engine environment offline failed at: {step} … (exit {failed.rc}): {last}")
    unreachable = network_failure(failed.output)
    if unreachable is not None:
        return UserError(
            f"installing the engine environment failed: cannot reach {unreachable}.\n"
            "Without internet access, install from downloaded wheels: 'rigpilot engine-env wheels' prints the "
            "commands to fetch them elsewhere, then 'rigpilot engine-env install --offline --find-links DIR'."
        )
    return UserError(
        f"installing the engine environment failed at: {step} … (exit {failed.rc}): {last}; "
        "run 'rigpilot engine-env install' again to resume"
    )


# -- the interpreter ------------------------------------------------------------------------------------------


def default_base_python() -> str:
    """The interpreter the app runs on, outside any virtual environment: known to run this Rigpilot."""
    return getattr(sys, "_base_executable", None) or sys.executable


def python_version(python: str) -> str:
    """`X.Y` of an interpreter; a UserError when it does not run or is older than Rigpilot supports."""
    if os.sep in python:  # a path: checked as every path a user gives is, then it must be a program
        found: str | None = str(check_given_path(python, "Python interpreter"))
        if not os.access(str(found), os.X_OK):
            raise UserError(f"Python interpreter {python} is not executable")
    else:
        found = shutil.which(python)
    if not found:
        raise UserError(f"no such Python interpreter: {python} (not found on PATH)")
    try:
        out = subprocess.run([found, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=60, env=uv_environment())  # fmt: skip
        major, minor = (int(x) for x in out.stdout.split())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        raise UserError(f"{python} does not run as a Python interpreter") from None
    if (major, minor) < MIN_PYTHON:
        raise UserError(f"{python} is Python {major}.{minor}; the engine environment needs 3.11 or newer")
    return f"{major}.{minor}"


def _env_python_version() -> str | None:
    try:
        cfg = (env_dir() / "pyvenv.cfg").read_text()
    except OSError:
        return None
    m = re.search(r"^version(?:_info)?\s*=\s*(\d+)\.(\d+)", cfg, re.MULTILINE)
    return f"{m.group(1)}.{m.group(2)}" if m else None


# -- Rigpilot itself -----------------------------------------------------------------------------------------


def self_source() -> tuple[str, Path | None]:
    """Where Rigpilot itself comes from, at exactly the running version, with no network: (how, path).

    The .deb's shipped wheel; else this source checkout (uv builds it); else the installed distribution's own
    files (pip, pipx and `uv tool` installs), zipped back into a wheel.
    """
    folder = shipped_wheels()
    shipped = [w for w in sorted(folder.glob("rigpilot-*.whl")) if wheel_version(w) == __version__] if folder else []
    if shipped:
        return "shipped wheel", shipped[-1]
    root = checkout_root()
    if root is not None:
        return "source checkout", root
    return "installed distribution", None


def self_requirement(scratch: Path) -> tuple[str, str]:
    """What to install for Rigpilot itself (see self_source), made ready in `scratch`: (path, how)."""
    how, path = self_source()
    if how == "shipped wheel":
        return str(path), how
    if how == "source checkout" and path is not None:  # self_source names the checkout it found
        return str(copy_checkout(path, scratch / "src")), how
    return str(wheel_from_installed(scratch)), how


_NOT_SOURCE = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "dist", "*.egg-info")


def copy_checkout(root: Path, dest: Path) -> Path:
    """What a wheel of the checkout is built from, copied: uv builds a folder in place, and setuptools would
    write build/ and *.egg-info into the checkout (maybe not writable; build/ carries stale files along)."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "setup.py", "setup.cfg", "MANIFEST.in", "LICENSE"):
        if (root / name).is_file():
            shutil.copy2(root / name, dest / name)
    shutil.copytree(root / "rigpilot", dest / "rigpilot", symlinks=True, ignore=_NOT_SOURCE)
    # rigpilot/engine -> ../engine and its siblings: the folders they point to come along.
    for link in (root / "rigpilot").iterdir():
        target = link.resolve()
        if link.is_symlink() and target.is_dir() and target.parent == root:
            shutil.copytree(target, dest / target.name, symlinks=True, ignore=_NOT_SOURCE)
    return dest


# What an installer adds to a .dist-info folder: not part of the wheel it installed.
_INSTALLER_FILES = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json", "uv_cache.json", "RECORD.jws", "RECORD.p7s"})


def wheel_from_installed(out_dir: Path, dist_name: str = "rigpilot") -> Path:
    """Zip the installed distribution's files (its RECORD) back into a wheel, with a fresh RECORD."""
    dist = importlib.metadata.distribution(dist_name)
    package = Path(__file__).resolve().parents[1]  # site-packages/rigpilot
    located = Path(str(dist.locate_file(f"{dist_name}/__init__.py"))).resolve().parent
    if located != package or dist.version != __version__:
        raise UserError(
            f"the installed {dist_name} {dist.version} ({located}) is not the running one ({__version__}, {package}): "
            "reinstall Rigpilot"
        )
    files = list(dist.files or [])
    info = next((f.parts[0] for f in files if f.parts[0].endswith(".dist-info")), None)
    if info is None:
        raise UserError(f"the installed {dist_name} lists no .dist-info folder: reinstall Rigpilot")
    wheel_meta = dist.read_text("WHEEL") or ""
    tags = re.findall(r"^Tag:\s*(\S+)", wheel_meta, re.MULTILINE)
    tag = tags[0] if len(tags) == 1 else "py3-none-any"
    members = []
    for f in files:
        top = f.parts[0]
        if top not in (dist_name, info) or "__pycache__" in f.parts or f.suffix == ".pyc":
            continue
        if top == info and f.name in _INSTALLER_FILES:
            continue
        members.append(f)
    members.sort(key=lambda f: (f.parts[0] == info, str(f)))  # the .dist-info goes last, as in any wheel
    escaped = re.sub(r"[-_.]+", "_", dist_name)
    wheel = out_dir / f"{escaped}-{dist.version}-{tag}.whl"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in members:
            path = Path(str(f.locate()))
            try:
                data = path.read_bytes()
            except OSError as e:
                raise UserError(f"the installed {dist_name} is incomplete ({path}: {e.strerror}): reinstall Rigpilot") from None
            arcname = f.as_posix()
            _add_member(zf, arcname, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            writer.writerow([arcname, f"sha256={digest}", len(data)])
        writer.writerow([f"{info}/RECORD", "", ""])
        _add_member(zf, f"{info}/RECORD", record.getvalue().encode())
    return wheel


def _add_member(zf: zipfile.ZipFile, arcname: str, data: bytes) -> None:
    """A wheel member: a fixed time (the same files make the same wheel) and plain 0644 permissions."""
    zi = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
    zi.external_attr = 0o644 << 16
    zf.writestr(zi, data, compress_type=zipfile.ZIP_DEFLATED)


# -- install, remove, repair ---------------------------------------------------------------------------------

_VERSION = re.compile(r"^\d+(\.\d+)*([a-z]+\d+)?(\.post\d+|\.dev\d+)?$")


def install(
    *,
    torch_backend: str = "auto",
    torch_version: str | None = None,
    wheel: Path | None = None,
    find_links: list[Path] | None = None,
    index_url: str | None = None,
    base_python: str | None = None,
    offline: bool = False,
    progress: Progress = print,
) -> None:
    """Create (or complete) the per-user engine environment with uv; `runtime.status()` says what it holds."""
    reqs = worker_requirements()
    folders = [check_given_path(d, "--find-links folder", expect=FOLDER).absolute() for d in find_links or []]
    if offline and not folders:
        raise UserError("--offline needs --find-links DIR, the folder holding the downloaded wheels "
                        "('rigpilot engine-env wheels' prints the commands to fetch them)")  # fmt: skip
    if offline and index_url:
        raise UserError("--offline installs from --find-links folders only: leave out --index-url")
    if torch_version is not None and not _VERSION.match(torch_version):
        raise UserError(f"--torch-version takes a version such as {reqs.torch}, not {torch_version!r}")
    pin = torch_version or reqs.torch
    if pin != reqs.torch:
        progress(f"note: torch {pin} asked for; Rigpilot is tested with torch {reqs.torch}")
    if wheel is not None:
        wheel = check_given_path(wheel, "torch wheel").absolute()
        found = (wheel_version(wheel) or "").split("+")[0]
        if not wheel.name.startswith("torch-") or found != pin:
            raise UserError(f"{wheel.name} is not torch {pin}, the version Rigpilot is tested with "
                            f"(--torch-version {found or 'X'} accepts it)")  # fmt: skip
    backend = choose_backend(torch_backend, runtime.has_nvidia_driver())
    if backend != torch_backend and wheel is None:
        progress("no NVIDIA driver on this machine: installing the CPU build of torch")

    target = env_dir()
    have = _env_python_version() if env_python().exists() else None
    # An existing environment stays unless another Python version is asked for.
    base = base_python or (None if have else default_base_python())
    version = python_version(base) if base else have
    create_with = base if base and version != have else None
    shipped = [folder] if (folder := shipped_wheels()) else []  # Rigpilot and its light dependencies
    env = uv_environment()
    uv = _uv()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rigpilot-self-") as scratch:
        self_req, how = self_requirement(Path(scratch))
        progress(f"Rigpilot {__version__} from its {how}; torch {pin} and the worker packages from {reqs.source}")
        cmds = install_commands(
            uv=uv, target=target, create_with=create_with, clear=create_with is not None and target.exists(),
            offline=offline, find_links=[*folders, *shipped], index_url=index_url,
            backend=None if wheel is not None else backend,
            torch_req=str(wheel) if wheel is not None else torch_requirement(pin, backend, offline=offline),
            torch_pin=pin, packages=reqs.packages, self_req=self_req,
        )  # fmt: skip
        hint = download_commands(
            folders[0] if folders else Path("rigpilot-wheels"), WorkerRequirements(pin, reqs.packages, reqs.build),
            python_version=str(version), backend=backend, from_source=how == "source checkout",
        )  # fmt: skip
        for cmd in cmds:
            try:
                _run(cmd, progress, env)
            except _Failed as failed:
                raise _explain(failed, offline=offline, folders=folders, hint=hint) from None


def wheels_commands(*, folder: Path, torch_backend: str = "auto", base_python: str | None = None) -> list[str]:
    """`rigpilot engine-env wheels`: what to run elsewhere for `install --offline --find-links folder` here."""
    reqs = worker_requirements()
    have = _env_python_version() if env_python().exists() and base_python is None else None
    version = have or python_version(base_python or default_base_python())
    backend = choose_backend(torch_backend, runtime.has_nvidia_driver())
    return download_commands(folder.expanduser().absolute(), reqs, python_version=version, backend=backend,
                             from_source=self_source()[0] == "source checkout")  # fmt: skip


def processes_using(folder: Path) -> list[int]:
    """This user's processes started from an interpreter in `folder` (jobs running in the engine environment)."""
    import psutil

    # A venv's python is a link to its base interpreter: how the process was started says where it runs from.
    inside = tuple({str(folder).rstrip("/") + "/", os.path.realpath(folder).rstrip("/") + "/"})
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "uids"]):
        uids, cmd = p.info["uids"], p.info["cmdline"] or []
        if uids is not None and uids.real == os.getuid() and cmd and cmd[0].startswith(inside) and p.pid != os.getpid():
            found.append(p.pid)
    return sorted(found)


def remove(progress: Progress = print) -> list[tuple[Path, int]]:
    """Delete the engine environment and its uv cache; what was removed, with the bytes it took."""
    from rigpilot.engine import userdata

    busy = processes_using(env_dir())
    if busy:
        raise UserError(f"the engine environment is in use (pid {', '.join(map(str, busy))}): "
                        "let its jobs end or cancel them first")  # fmt: skip
    removed = []
    seen: set[tuple[int, int]] = set()
    for path in (env_dir(), uv_cache_dir()):
        if os.path.lexists(path):
            size = userdata.disk_usage(path, seen)
            progress(f"removing {path} ({userdata.human_size(size)})")
            userdata.delete(path)
            removed.append((path, size))
    return removed


def repair(progress: Progress = print, **kw) -> None:
    """Start over: remove the environment and its cache, and install it again."""
    remove(progress)
    install(progress=progress, **kw)
