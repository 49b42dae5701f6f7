"""dev.py, the first thing a newcomer runs: a probe that cannot hang, a clear word when python3 lacks
ensurepip, and never CUDA torch on a machine without an NVIDIA driver unless asked for.

dev.py is imported from its path (it is no module of Rigpilot's and runs before any venv exists).
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import sysconfig
import threading
import tomllib
import zipfile
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

from support.dev_script import load_dev
from support.paths import REPO

VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

# Trimmed from a real `pip install --dry-run --quiet --no-deps --report FILE torch==2.13.0` here
# (pip 23.2.1, the CPU wheel found in a find-links folder).
CPU_REPORT = {
    "version": "1",
    "pip_version": "23.2.1",
    "install": [
        {
            "download_info": {
                "url": "file:///opt/wheels/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                "archive_info": {"hash": "sha256=6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b"},
            },
            "is_direct": False,
            "requested": True,
            "metadata": {
                "metadata_version": "2.4",
                "name": "torch",
                "version": "2.13.0+cpu",
                "requires_dist": ["filelock", "typing-extensions>=4.10.0", "setuptools>=77.0.3", "sympy>=1.13.3"],
                "requires_python": ">=3.10",
            },
        }
    ],
    "environment": {"platform_machine": "x86_64", "python_version": "3.11"},
}


def _installed(name: str, version: str, url: str) -> dict:
    return {"download_info": {"url": url}, "is_direct": False, "requested": name == "torch", "metadata": {"name": name, "version": version}}


# What PyPI's Linux torch resolves to with its dependencies, in pip's documented report format
# (https://pip.pypa.io/en/stable/reference/installation-report/).
CUDA_REPORT = {
    "version": "1",
    "pip_version": "23.2.1",
    "install": [
        _installed("torch", "2.13.0", "https://files.pythonhosted.org/packages/01/79/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"),
        _installed("nvidia_cublas", "13.1.0.3", "https://files.pythonhosted.org/packages/nvidia_cublas-13.1.0.3-py3-none-manylinux_2_27_x86_64.whl"),
        _installed("sympy", "1.14.0", "https://files.pythonhosted.org/packages/sympy-1.14.0-py3-none-any.whl"),
    ],
    "environment": {"platform_machine": "x86_64", "python_version": "3.11"},
}


@pytest.fixture
def dev(tmp_path, monkeypatch):
    """dev.py as a module, its venv in a temporary folder."""
    module = load_dev()
    monkeypatch.setattr(module, "VENV", tmp_path / "venv")
    monkeypatch.setattr(module, "STAMP", tmp_path / "venv" / ".rigpilot-setup")
    monkeypatch.delenv("RIGPILOT_ALLOW_CUDA_TORCH", raising=False)
    return module


def test_probe_gives_up_on_a_resolver_that_never_answers(dev, monkeypatch):
    looking_up, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def silent_resolver(*args, **kwargs):
        looking_up.set()
        release.wait(30)
        finished.append(True)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", silent_resolver)
    try:
        assert dev.reachable("https://download.pytorch.org/whl/cpu/torch/", seconds=1.0) is False
        assert looking_up.is_set(), "the probe never started its name lookup"
        assert not finished, "the probe returned only after the lookup did"
    finally:
        release.set()


def test_probe_tells_a_server_that_answers_from_a_closed_port(dev, monkeypatch):
    monkeypatch.setenv("no_proxy", "*")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert dev.reachable(f"http://127.0.0.1:{server.server_port}/") is True
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    assert dev.reachable(f"http://127.0.0.1:{closed_port}/") is False


def _hide_module(monkeypatch, hidden: str, spec: ModuleSpec | None) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == hidden else real(name, *a))


@pytest.mark.parametrize("left_behind", [None, ModuleSpec("ensurepip", None, is_package=True)], ids=["absent", "empty-folder"])
def test_without_ensurepip_it_names_the_package_and_makes_no_venv(dev, monkeypatch, left_behind):
    _hide_module(monkeypatch, "ensurepip", left_behind)
    with pytest.raises(SystemExit) as stop:
        dev.ensure_venv()
    message = str(stop.value.code)
    assert f"sudo apt install python{VERSION}-venv" in message
    assert sys.executable in message and "\n" not in message
    assert not dev.VENV.exists()


def test_with_venv_and_ensurepip_nothing_is_missing(dev):
    assert dev.venv_tools_missing() is None


def test_a_venv_left_without_pip_is_made_again(dev, monkeypatch):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", dev.VENV], check=True)
    assert not dev.venv_has_pip()
    steps = []
    monkeypatch.setattr(dev, "step", lambda what, cmd: steps.append(cmd))
    dev.ensure_venv()
    assert steps == [[sys.executable, "-m", "venv", "--clear", dev.VENV]]


def test_a_new_venv_is_made_without_clear(dev, monkeypatch):
    steps = []
    monkeypatch.setattr(dev, "step", lambda what, cmd: steps.append(cmd))
    dev.ensure_venv()
    assert steps == [[sys.executable, "-m", "venv", dev.VENV]]


def test_a_failing_step_ends_with_one_line_naming_it(dev):
    with pytest.raises(SystemExit) as stop:
        dev.step("install PyTorch", [sys.executable, "-c", "raise SystemExit(3)"])
    message = str(stop.value.code)
    assert "install PyTorch" in message and "run dev.py again" in message and "\n" not in message
    with pytest.raises(SystemExit) as stop:
        dev.step("create the virtual environment", ["/nonexistent/python3", "-m", "venv"])
    assert "create the virtual environment" in str(stop.value.code)


def test_the_torch_pin_is_the_workers_extra_of_pyproject(dev):
    workers = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["workers"]
    assert dev.torch_pin() in workers
    assert not re.search(r"torch\s*==\s*\d", (REPO / "dev.py").read_text()), "dev.py must not carry its own torch pin"


def test_the_pin_is_told_apart_from_torchao_and_its_absence_said(dev, tmp_path, monkeypatch):
    monkeypatch.setattr(dev, "ROOT", tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project.optional-dependencies]\nworkers = ["torchao==0.18.0", "torch == 2.99.1"]\n')
    assert dev.torch_pin() == "torch==2.99.1"
    (tmp_path / "pyproject.toml").write_text('[project.optional-dependencies]\nworkers = ["torchao==0.18.0", "torch>=2"]\n')
    with pytest.raises(SystemExit) as stop:
        dev.torch_pin()
    assert "torch==X.Y.Z" in str(stop.value.code)


def test_pip_reports_are_read_for_cuda_builds(dev):
    assert dev.cuda_packages(CPU_REPORT) == []
    assert dev.cuda_packages(CUDA_REPORT) == ["torch 2.13.0", "nvidia-cublas 13.1.0.3"]
    assert dev.cuda_packages({"version": "1", "install": []}) == []  # the pinned torch is already there
    cu130 = {"install": [_installed("torch", "2.13.0+cu130", "file:///w/torch-2.13.0+cu130-cp311-cp311-linux_x86_64.whl")]}
    assert dev.cuda_packages(cu130) == ["torch 2.13.0+cu130"]


def _fake_torch_wheel(folder: Path, version: str) -> None:
    """A wheel pip takes for torch `version`: enough for a dry run, which reads only its metadata."""
    folder.mkdir(exist_ok=True)
    dist_info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        whl.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist_info}/RECORD", "")


@pytest.fixture
def wheels_only(tmp_path, monkeypatch) -> Path:
    """pip sees nothing but the wheels in the returned folder: no index, no configuration."""
    folder = tmp_path / "wheels"
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


# 2.13.1, not the pin: pip's dry run leaves out what is installed already, and the suite's venv has the pin.
PIP = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]


def test_pip_resolving_to_a_cpu_wheel_goes_ahead(dev, wheels_only):
    _fake_torch_wheel(wheels_only, "2.13.1+cpu")
    _fake_torch_wheel(wheels_only, "2.13.0")
    dev.require_cpu_torch(PIP, ["torch==2.13.1"], index_reachable=False)


@pytest.mark.parametrize("versions", [["2.13.1"], ["2.13.1+cpu", "2.13.1+cu130"]], ids=["pypi-like", "cu130-preferred"])
def test_pip_resolving_to_cuda_stops_with_what_to_do(dev, wheels_only, versions):
    for version in versions:
        _fake_torch_wheel(wheels_only, version)
    with pytest.raises(SystemExit) as stop:
        dev.require_cpu_torch(PIP, ["torch==2.13.1"], index_reachable=False)
    message = str(stop.value.code)
    assert "\n" not in message
    assert "cannot be reached" in message and "no NVIDIA driver" in message
    assert f"torch {versions[-1]}" in message
    assert "PIP_FIND_LINKS=" in message and "RIGPILOT_ALLOW_CUDA_TORCH=1" in message


def test_cuda_torch_asked_for_is_not_questioned(dev, monkeypatch):
    monkeypatch.setenv("RIGPILOT_ALLOW_CUDA_TORCH", "1")
    monkeypatch.setattr(dev, "step", lambda what, cmd: pytest.fail(f"ran {cmd}"))
    dev.require_cpu_torch(PIP, ["torch==2.13.1"], index_reachable=False)


def test_a_python_without_ensurepip_gets_one_line_not_a_traceback(tmp_path):
    """The real thing: dev.py run by a Python whose ensurepip is gone (as on Debian without
    python3.X-venv), hidden by an overlay in a private mount namespace."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if os.geteuid() != 0 or not (stdlib / "ensurepip" / "__init__.py").exists():
        pytest.skip("needs root and a Python with ensurepip to hide")
    upper, work = tmp_path / "upper", tmp_path / "work"
    upper.mkdir()
    work.mkdir()
    os.mknod(upper / "ensurepip", 0o600 | 0o020000, os.makedev(0, 0))  # an overlay whiteout
    half_made = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", half_made], check=True)
    before = sorted(p.name for p in half_made.iterdir())
    script = 'mount -t overlay overlay -o lowerdir="$1",upperdir="$2",workdir="$3" "$1" || exit 77; shift 3; exec "$@"'
    run = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", stdlib, upper, work, sys.executable, REPO / "dev.py", "setup"],
        capture_output=True, text=True, env={**os.environ, "RIGPILOT_VENV": str(half_made)}, timeout=60,
    )  # fmt: skip
    if run.returncode == 77 or "unshare:" in run.stderr:
        pytest.skip(f"no private mount namespace with overlayfs here: {run.stderr.strip()}")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [run.stderr.strip()]
    assert f"apt install python{VERSION}-venv" in run.stderr and "Traceback" not in run.stderr
    assert sorted(p.name for p in half_made.iterdir()) == before


@pytest.mark.slow
def test_setup_from_a_half_made_venv_installs_the_pinned_cpu_torch(dev, tmp_path):
    """`dev.py setup` for real, in a scratch project that has dev.py, the real torch pin and no other
    dependency (the rest of the set-up is plain pip), starting from a venv an earlier run left without pip."""
    if dev.has_nvidia_driver():
        pytest.skip("with an NVIDIA driver the CUDA build is the right one, and gigabytes")
    pin = dev.torch_pin()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "dev.py").write_bytes((REPO / "dev.py").read_bytes())
    (scratch / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "rigpilot-dev-scratch"\nversion = "0"\ndependencies = []\n'
        f'[project.optional-dependencies]\nworkers = ["{pin}"]\ndev = []\n'
        "[tool.setuptools]\npy-modules = []\npackages = []\n"
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    env = {**os.environ, "RIGPILOT_VENV": str(venv)}
    env.pop("RIGPILOT_ALLOW_CUDA_TORCH", None)
    setup = [sys.executable, scratch / "dev.py", "setup"]

    first = subprocess.run(setup, capture_output=True, text=True, env=env, timeout=540)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "has no working pip: creating it again" in first.stdout
    probe = "import importlib.metadata as m, json; print(json.dumps(sorted((d.metadata['Name'], d.version) for d in m.distributions())))"
    installed = dict(json.loads(subprocess.run([venv / "bin" / "python", "-c", probe], capture_output=True, text=True, check=True).stdout))
    assert installed["torch"] == pin.partition("==")[2] + "+cpu"
    assert not [name for name in installed if name.lower().startswith("nvidia")]

    again = subprocess.run(setup, capture_output=True, text=True, env=env, timeout=60)
    assert (again.returncode, again.stdout) == (0, "")  # nothing changed: nothing to set up
