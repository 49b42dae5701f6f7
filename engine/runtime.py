"""The Python environment the worker processes run in.

The GUI and the engine service need no PyTorch. The workers do, and the right
PyTorch build depends on the machine: a CUDA build matching the driver where
NVIDIA GPUs are, the CPU build elsewhere. So an installed Rigpilot provisions a
per-user "engine environment" in the XDG data directory with uv on first run.
A source checkout (python3 dev.py ...) already has torch in its .venv and uses
that.

    rigpilot engine-env status
    rigpilot engine-env install [--torch-backend auto|cpu|cu126|...] [--torch-version 2.13.0]
                                [--wheel FILE] [--find-links DIR] [--index-url URL]
    rigpilot engine-env repair

Installation is resumable: uv keeps what it downloaded in its cache, and a
step already done (the environment exists, torch imports) is not redone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

from rigpilot.engine.errors import UserError

ENV_OVERRIDE = "RIGPILOT_WORKER_PYTHON"  # use this interpreter for workers (tests, unusual set-ups)
SHIPPED_WHEELS = Path("/opt/rigpilot/wheels")  # where the .deb puts its wheels
WORKER_PACKAGES = ["transformers>=4.45", "peft>=0.12", "safetensors>=0.4", "accelerate>=0.30", "torchao==0.18.0"]

Progress = Callable[[str], None]


def env_dir() -> Path:
    return Path(platformdirs.user_data_dir("rigpilot")) / "engine-env"


def env_python() -> Path:
    return env_dir() / "bin" / "python"


def _has_torch_here() -> bool:
    return importlib.util.find_spec("torch") is not None


def worker_python() -> str:
    """The interpreter to start workers with; a UserError that says how to fix it when there is none."""
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        return override
    if _has_torch_here():
        return sys.executable
    if env_python().exists():
        return str(env_python())
    raise UserError(
        "the PyTorch engine environment is not installed yet: run 'rigpilot engine-env install' "
        "(or, in the app, the install dialog shown at start-up or Settings → Repair engine environment)"
    )


@dataclass
class EnvStatus:
    python: str | None
    installed: bool
    torch_version: str | None = None
    cuda_version: str | None = None  # None: a CPU build
    arch_list: list[str] = field(default_factory=list)  # e.g. ["sm_80", "sm_90"]
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


_PROBE = (
    "import json, torch; "
    "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
    "'arch': torch.cuda.get_arch_list() if torch.version.cuda else []}))"
)


def status(compute_capabilities: Iterable[str] = ()) -> EnvStatus:
    """What the worker environment has, and whether its torch can run on these GPUs."""
    try:
        python = worker_python()
    except UserError as e:
        return EnvStatus(python=None, installed=False, problems=[str(e)])
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return EnvStatus(python=python, installed=False, problems=[f"cannot run {python}: {e}"])
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return EnvStatus(python=python, installed=False, problems=[f"torch does not import in {python}: {last}"])
    info = json.loads(out.stdout.strip().splitlines()[-1])
    st = EnvStatus(python=python, installed=True, torch_version=info["torch"], cuda_version=info["cuda"],
                   arch_list=info["arch"])
    st.problems = check_gpu_support(st, compute_capabilities)
    return st


def check_gpu_support(st: EnvStatus, compute_capabilities: Iterable[str]) -> list[str]:
    """Say which GPUs this torch build cannot drive (too new for its kernels, or a CPU-only build)."""
    caps = sorted(set(c for c in compute_capabilities if c))
    if not caps:
        return []
    if not st.cuda_version:
        return [f"torch {st.torch_version} is a CPU build: the GPUs will not be used (reinstall with --torch-backend auto)"]
    missing = [cap for cap in caps if not _runs_on(cap, st.arch_list)]
    if missing:
        return [
            f"torch {st.torch_version} (CUDA {st.cuda_version}) has no kernels for compute capability "
            f"{', '.join(missing)} (built for {', '.join(st.arch_list) or 'nothing'}): install a newer torch "
            "with 'rigpilot engine-env install --torch-backend auto'"
        ]
    return []


def _runs_on(capability: str, arch_list: list[str]) -> bool:
    """Whether a torch built for `arch_list` has kernels for a GPU of `capability` ("8.9")."""
    major, minor = (int(x) for x in capability.split("."))
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        digits = digits.rstrip("af")  # sm_90a, sm_100f: family-specific variants of the same target
        if not digits.isdigit():
            continue
        a_major, a_minor = int(digits[:-1]), int(digits[-1])
        # Cubins run on the same major at an equal or higher minor; PTX is JIT-compiled for any newer GPU.
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def _uv() -> str:
    try:
        from uv import find_uv_bin  # the uv wheel ships its binary

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
    raise UserError("uv is missing: reinstall Rigpilot (the package ships it)")


def _run(cmd: list[str], progress: Progress) -> None:
    progress("$ " + " ".join(cmd))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            progress(line.rstrip())
        rc = proc.wait()
    if rc != 0:
        raise UserError(f"installing the engine environment failed at: {' '.join(cmd[:4])} … (exit {rc}); "
                        "run 'rigpilot engine-env install' again to resume")


def install(
    *,
    torch_backend: str = "auto",
    torch_version: str | None = None,
    wheel: Path | None = None,
    find_links: list[Path] | None = None,
    index_url: str | None = None,
    base_python: str | None = None,
    progress: Progress = print,
) -> EnvStatus:
    """Create (or complete) the per-user engine environment with uv."""
    uv = _uv()
    target = env_dir()
    python = env_python()
    source = [] if index_url is None else ["--index-url", index_url]
    # The package's own wheels cover Rigpilot and its light dependencies, even offline.
    for d in [*(find_links or []), *([SHIPPED_WHEELS] if SHIPPED_WHEELS.is_dir() else [])]:
        source += ["--find-links", str(d)]
    if not python.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        base = base_python or ("/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable)
        _run([uv, "venv", "--python", base, str(target)], progress)
    if wheel is not None:
        if not wheel.is_file():
            raise UserError(f"no such torch wheel: {wheel}")
        torch_req = [str(wheel)]
    else:
        torch_req = [f"torch=={torch_version}" if torch_version else "torch"]
    backend = [] if wheel is not None else ["--torch-backend", torch_backend]
    _run([uv, "pip", "install", "--python", str(python), *source, *backend, *torch_req], progress)
    _run([uv, "pip", "install", "--python", str(python), *source, *WORKER_PACKAGES], progress)
    # The workers import Rigpilot's own engine package: install this very version, without its GUI.
    _run([uv, "pip", "install", "--python", str(python), *source, "--no-deps", _self_requirement()], progress)
    _run([uv, "pip", "install", "--python", str(python), *source, "psutil", "platformdirs", "numpy",
          "huggingface_hub", "nvidia-ml-py"], progress)
    return status()


def _self_requirement() -> str:
    """What to install for the engine package: the shipped wheel, else this source tree."""
    shipped = sorted(SHIPPED_WHEELS.glob("rigpilot-*.whl"))
    if shipped:
        return str(shipped[-1])
    return str(Path(__file__).resolve().parents[1])


def repair(progress: Progress = print, **kw) -> EnvStatus:
    """Start over: remove the environment and install it again (uv's cache makes this quick)."""
    if env_dir().exists():
        progress(f"removing {env_dir()}")
        shutil.rmtree(env_dir())
    return install(progress=progress, **kw)
