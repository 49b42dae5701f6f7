"""Where the job workers' Python is, and what it can do.

The GUI and the engine service need no PyTorch. The workers do, and the right
PyTorch build depends on the machine: a CUDA build matching the driver where
NVIDIA GPUs are, the CPU build elsewhere. So an installed Rigpilot provisions a
per-user "engine environment" in the XDG data directory on first run
(engine/provision.py, `rigpilot engine-env install`). A source checkout
(python3 dev.py ...) already has torch in its .venv and uses that.

`worker_python()` says which interpreter the ranks start with; `status()` asks
it what torch it has and whether that build suits this machine (a CUDA build
without an NVIDIA driver, a CPU build with one, GPUs its kernels do not cover)
and, for the provisioned environment, whether it holds this very Rigpilot.
Nothing here imports torch: the GUI may use this module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rigpilot.engine import __version__
from rigpilot.engine.capability import WorkerVllm
from rigpilot.engine.errors import UserError
from rigpilot.engine.settings import cache_dir, data_dir

ENV_OVERRIDE = "RIGPILOT_WORKER_PYTHON"  # use this interpreter for workers (tests, unusual set-ups)


def env_dir() -> Path:
    return data_dir() / "engine-env"


def env_python() -> Path:
    return env_dir() / "bin" / "python"


def uv_cache_dir() -> Path:
    return cache_dir() / "uv"


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


def has_nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def standalone_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment without the app's own Python path: the engine environment must stand on its own."""
    return {k: v for k, v in (os.environ if base is None else base).items() if k not in ("PYTHONPATH", "PYTHONHOME")}


# -- status --------------------------------------------------------------------------------------------------


@dataclass
class EnvStatus:
    python: str | None
    installed: bool
    torch_version: str | None = None
    cuda_version: str | None = None  # None: a CPU build (or ROCm: hip_version)
    hip_version: str | None = None
    arch_list: list[str] = field(default_factory=list)  # e.g. ["sm_80", "sm_90"]
    rigpilot_version: str | None = None  # the Rigpilot the workers import there
    vllm_version: str | None = None  # vLLM, where installed there: inference jobs may run on it
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# Whether vLLM is installed, by finding its package without importing it: importing vLLM takes seconds and
# initialises CUDA, and the service asks this at every inference submit on a machine with GPUs.
_VLLM_FOUND = (
    "import importlib.metadata, importlib.util\n"
    "try:\n"
    "    vllm = importlib.metadata.version('vllm') if importlib.util.find_spec('vllm') else None\n"
    "except importlib.metadata.PackageNotFoundError:\n"
    "    vllm = 'unknown version'\n"
)
_PROBE = (
    "import json, torch\n"
    "try:\n"
    "    import rigpilot; rp = rigpilot.__version__\n"
    "except Exception:\n"
    "    rp = None\n"
    + _VLLM_FOUND
    + "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'hip': torch.version.hip,\n"
    "                  'arch': torch.cuda.get_arch_list() if torch.version.cuda else [], 'rigpilot': rp,\n"
    "                  'vllm': vllm}))\n"
)
_VLLM_PROBE = "import json\n" + _VLLM_FOUND + "print(json.dumps({'vllm': vllm}))\n"


def status(compute_capabilities: Iterable[str] = ()) -> EnvStatus:
    """What the worker environment has, and whether its torch can run on these GPUs."""
    try:
        python = worker_python()
    except UserError as e:
        return EnvStatus(python=None, installed=False, problems=[str(e)])
    try:
        out = _ask(python, _PROBE, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return EnvStatus(python=python, installed=False, problems=[f"cannot run {python}: {e}"])
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return EnvStatus(python=python, installed=False, problems=[f"torch does not import in {python}: {last}"])
    info = json.loads(out.stdout.strip().splitlines()[-1])
    st = EnvStatus(python=python, installed=True, torch_version=info["torch"], cuda_version=info["cuda"],
                   hip_version=info.get("hip"), arch_list=info["arch"], rigpilot_version=info.get("rigpilot"),
                   vllm_version=info.get("vllm"))  # fmt: skip
    st.problems = check_gpu_support(st, compute_capabilities) or check_build(st, has_nvidia_driver())
    if python == str(env_python()):
        st.problems += check_rigpilot(st)
    return st


def _ask(python: str, code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    provisioned = python == str(env_python())
    # The provisioned environment is probed as the ranks use it: nothing of the app's on the path.
    env = standalone_environment() if provisioned else None
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd="/" if provisioned else None)  # fmt: skip


def worker_vllm() -> WorkerVllm:
    """Whether vLLM is installed where the job's process starts (engine.capability.choose_infer_backend)."""
    try:
        python = worker_python()
    except UserError as e:
        return WorkerVllm(None, None, str(e))
    try:
        out = _ask(python, _VLLM_PROBE, timeout=30)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            return WorkerVllm(python, None, f"{python} failed: {last}")
        version = json.loads(out.stdout.strip().splitlines()[-1])["vllm"]
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, IndexError) as e:
        return WorkerVllm(python, None, f"cannot run {python}: {e}")
    return WorkerVllm(python, version if isinstance(version, str) else None)


def check_build(st: EnvStatus, driver: bool) -> list[str]:
    """A CUDA build on a machine without an NVIDIA driver, or a CPU build on one with it."""
    if st.hip_version:
        return []
    if st.cuda_version and not driver:
        return [f"torch {st.torch_version} is a CUDA {st.cuda_version} build but this machine has no NVIDIA driver: "
                "jobs run on the CPU and its CUDA libraries take gigabytes for nothing "
                "(reinstall with 'rigpilot engine-env repair --torch-backend cpu')"]  # fmt: skip
    if not st.cuda_version and driver:
        return [f"torch {st.torch_version} is a CPU build but this machine has an NVIDIA driver: the GPUs will not "
                "be used (reinstall with 'rigpilot engine-env repair --torch-backend auto')"]  # fmt: skip
    return []


def check_rigpilot(st: EnvStatus) -> list[str]:
    if st.rigpilot_version is None:
        return ["Rigpilot's own engine package is missing from the environment: run 'rigpilot engine-env install'"]
    if st.rigpilot_version != __version__:
        return [f"the environment has Rigpilot {st.rigpilot_version} and this is {__version__}: "
                "run 'rigpilot engine-env install' to bring it up to date"]  # fmt: skip
    return []


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
