"""Real engine-environment installs with uv, offline, from local wheels.

The wheels: the CPU torch 2.13.0 for CPython 3.11 in /opt/wheels, and everything else fetched once with the
second command `rigpilot engine-env wheels` prints, into a folder kept across runs
($RIGPILOT_TEST_WHEELS, default ~/.cache/rigpilot-test-wheels; about 60 MB). Without that folder and no
way to fill it, these tests skip. Where `unshare -n` works (root, or user namespaces), the install runs
in a network namespace with no network at all.

Each install unpacks about 700 MB of torch into tmp_path.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from rigpilot.engine import __version__, provision

from support.paths import REPO

pytestmark = pytest.mark.slow

TORCH_WHEELS = Path("/opt/wheels")
WHEELS = Path(os.environ.get("RIGPILOT_TEST_WHEELS") or Path.home() / ".cache" / "rigpilot-test-wheels")
BASE_PYTHON = provision.default_base_python()


def _no_network() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    return []


@pytest.fixture(scope="module")
def wheel_folders() -> list[Path]:
    """[/opt/wheels, the cached folder of every other wheel], filled on first use."""
    version = provision.python_version(BASE_PYTHON)
    tag = f"cp{version.replace('.', '')}"
    if not list(TORCH_WHEELS.glob(f"torch-*+cpu-{tag}-{tag}-*.whl")):
        pytest.skip(f"no CPU torch wheel for Python {version} in {TORCH_WHEELS}")
    reqs = provision.worker_requirements()
    _, rest = provision.download_commands(WHEELS, reqs, python_version=version, backend="cpu", from_source=True)
    stamp = WHEELS / f".complete-{hashlib.sha256(rest.encode()).hexdigest()[:16]}"
    if not stamp.exists():
        WHEELS.mkdir(parents=True, exist_ok=True)
        words = shlex.split(rest)
        cmd = [sys.executable, "-m", *words, "--find-links", str(TORCH_WHEELS), "--quiet"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"cannot fetch the worker wheels into {WHEELS}: {done.stderr.strip().splitlines()[-1:]}")
        for copied in WHEELS.glob("torch-*.whl"):
            copied.unlink()  # /opt/wheels has it: no second copy of 180 MB
        stamp.write_text(rest + "\n")
    return [TORCH_WHEELS, WHEELS]


def user_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "RIGPILOT_"))}
    for name in ("DATA", "CACHE", "STATE", "CONFIG"):
        env[f"XDG_{name}_HOME"] = str(tmp_path / name.lower())
    env["PYTHONPATH"] = str(REPO)  # this checkout's code, wherever the suite runs
    return env


def cli(env: dict[str, str], *args: str, prefix: list[str] | None = None, timeout: float = 900):
    cmd = [*(prefix or []), sys.executable, "-m", "rigpilot.engine.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd="/")


def in_env(python: Path, code: str) -> str:
    """Run `code` in the engine environment as a rank would: nothing of ours on the path, cwd elsewhere."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_offline_install_from_local_wheels_then_remove(tmp_path, wheel_folders):
    env = user_env(tmp_path)
    # The editable install of the dev set-up made rigpilot.egg-info; the engine environment's build must not touch it.
    build_outputs = _build_outputs()
    # Ambient settings that would send uv elsewhere: ignored.
    env.update(UV_INDEX_URL="http://127.0.0.1:9/simple", PIP_CONSTRAINT=str(tmp_path / "missing.txt"),
               UV_CACHE_DIR=str(tmp_path / "global-uv"))  # fmt: skip
    links = [w for d in wheel_folders for w in ("--find-links", str(d))]
    offline = _no_network()
    started = time.monotonic()
    done = cli(env, "engine-env", "install", "--offline", *links, "--python", BASE_PYTHON, prefix=offline)
    took = time.monotonic() - started
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr  # 1: status names a problem, below
    print(f"offline install{' in a network namespace without network' if offline else ''}: {took:.1f} s")

    data, cache = tmp_path / "data" / "rigpilot", tmp_path / "cache" / "rigpilot"
    python = data / "engine-env" / "bin" / "python"
    info = json.loads(in_env(python, (
        "import json, pathlib, torch, transformers, peft, rigpilot\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'rigpilot': rigpilot.__version__,"
        " 'file': rigpilot.__file__, 'examples': (pathlib.Path(rigpilot.__file__).parent / 'examples/models/"
        "tiny-llama/config.json').is_file()}))"
    )))  # fmt: skip
    assert info["torch"] == f"{provision.worker_requirements().torch}+cpu" and info["cuda"] is None
    assert info["rigpilot"] == __version__ and info["examples"]
    assert info["file"].startswith(str(data / "engine-env" / "lib"))  # its own copy, not this checkout
    # Built from a copy: nothing written into the checkout.
    assert _build_outputs() == build_outputs

    # The environment's own status, as the engine sees it: this Rigpilot, the CPU build, no problem.
    status = subprocess.run([str(python), "-m", "rigpilot.engine.cli", "engine-env", "status", "--json"],
                            env={**user_env(tmp_path), "PYTHONPATH": ""}, capture_output=True, text=True,
                            timeout=300, cwd="/")  # fmt: skip
    st = json.loads(status.stdout)
    assert st["installed"] and st["python"] == str(python) and st["problems"] == [], status.stdout
    assert st["rigpilot_version"] == __version__

    # uv's cache is Rigpilot's, not the user's global one (nor the one the environment variable named).
    assert (cache / "uv").is_dir() and any((cache / "uv").iterdir())
    assert not (tmp_path / "cache" / "uv").exists() and not (tmp_path / "global-uv").exists()

    started = time.monotonic()
    again = cli(env, "engine-env", "install", "--offline", *links, prefix=offline)
    print(f"second install (nothing to do but Rigpilot itself): {time.monotonic() - started:.1f} s")
    assert again.returncode in (0, 1), again.stderr
    assert "Installed 1 package" in again.stdout  # only Rigpilot itself, reinstalled on purpose

    removed = cli(env, "engine-env", "remove")
    assert removed.returncode == 0, removed.stderr
    assert not (data / "engine-env").exists() and not (cache / "uv").exists()
    assert removed.stdout.splitlines()[-1].startswith("removed the engine environment and its cache (")


def test_a_missing_wheel_offline_is_named_with_the_commands_to_fetch_it(tmp_path, wheel_folders):
    """The real uv, offline, with the worker wheels but no torch: the message a user would get."""
    env = user_env(tmp_path)
    done = cli(env, "engine-env", "install", "--offline", "--find-links", str(wheel_folders[1]), prefix=_no_network())
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert lines[0] == f"rigpilot: error: the offline install found no torch wheel in {wheel_folders[1]}."
    assert lines[2].strip().startswith("pip download ") and "download.pytorch.org/whl/cpu" in lines[2]
    assert "Traceback" not in done.stderr


def _build_outputs() -> dict[Path, int]:
    """What a setuptools build in the checkout would write or rewrite: its files and their times."""
    return {f: f.stat().st_mtime_ns for d in ("rigpilot.egg-info", "build") for f in (REPO / d).rglob("*") if f.is_file()}


def _check_record(wheel: Path) -> set[str]:
    """The wheel's RECORD lists every member with its true hash and size; returns the member names."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(zf.read(record).decode().splitlines()))
        assert {r[0] for r in rows} == names
        for path, digest, size in rows:
            if path == record:
                assert digest == size == ""
                continue
            data = zf.read(path)
            algo, _, value = digest.partition("=")
            expected = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
            assert (value, int(size)) == (expected, len(data)), path
    return names


def test_a_pip_installed_rigpilot_provisions_the_engine_with_itself(tmp_path, wheel_folders):
    """pip, pipx and `uv tool` installs: no checkout, no .deb wheel; Rigpilot rebuilds its wheel from its RECORD."""
    src = provision.copy_checkout(REPO, tmp_path / "src")
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index", "--find-links",
                            str(wheel_folders[1]), "-w", str(dist), str(src)], capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert build.returncode == 0, build.stderr
    (original,) = dist.glob("rigpilot-*.whl")
    uv = provision._uv()
    quiet = {**provision.uv_environment(), "UV_CACHE_DIR": str(tmp_path / "uv-cache")}

    def uv_run(*args: str) -> None:
        done = subprocess.run([uv, *args], env=quiet, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr

    app = tmp_path / "app-venv"
    uv_run("venv", "--quiet", "--python", BASE_PYTHON, str(app))
    uv_run("pip", "install", "--quiet", "--python", str(app / "bin" / "python"), "--offline", "--no-index",
           "--find-links", str(wheel_folders[1]), str(original), "platformdirs", "psutil", "numpy", "--no-deps")  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    made = json.loads(in_env(app / "bin" / "python", (
        "import json, pathlib\n"
        "from rigpilot.engine import provision\n"
        f"print(json.dumps(provision.self_requirement(pathlib.Path({str(out)!r}))))"
    )))  # fmt: skip
    wheel, how = Path(made[0]), made[1]
    assert how == "installed distribution" and wheel.parent == out and wheel.name == original.name
    rebuilt = _check_record(wheel)
    with zipfile.ZipFile(original) as zf:
        assert rebuilt == set(zf.namelist())  # the same files as the wheel pip installed

    engine = tmp_path / "engine-venv"
    uv_run("venv", "--quiet", "--python", BASE_PYTHON, str(engine))
    uv_run("pip", "install", "--quiet", "--python", str(engine / "bin" / "python"), "--offline", "--no-deps", str(wheel))
    found = json.loads(in_env(engine / "bin" / "python", (
        "import json, pathlib, rigpilot\n"
        "root = pathlib.Path(rigpilot.__file__).parent\n"
        "print(json.dumps([rigpilot.__version__, str(root), (root / 'examples/models/tiny-llama/config.json').is_file()]))"
    )))  # fmt: skip
    assert found[0] == __version__ and found[1].startswith(str(engine)) and found[2]
