"""The engine environment (engine/runtime.py, engine/provision.py) without installing: the torch pin, the
commands, uv's environment, what a failure says, the build checks, `engine-env remove`, and that jobs get
nothing of Rigpilot's on PYTHONPATH.

uv itself is replaced by a small script where a test needs it to run; its failure outputs are the ones uv
0.13 printed here (offline without a wheel, a DNS failure, a refused connection, a wrong Python ABI).
The real installs are in test_engine_env_install.py.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tomllib
from pathlib import Path

import pytest

from rigpilot.engine import __version__, provision, runtime
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import shown

from support.paths import REPO

UV_OFFLINE_NO_TORCH = """\
Using Python 3.11.7 environment at: /x/engine-env
error: No solution found when resolving dependencies
  cause: Because torch was not found in the provided package locations and you require torch==2.13.0, we can conclude that your requirements are unsatisfiable.
"""
UV_OFFLINE_NO_FILELOCK = """\
error: No solution found when resolving dependencies
  cause: Because filelock was not found in the provided package locations and all versions of torch depend on filelock, we can conclude that all versions of torch cannot be used.
         And because you require torch==2.13.0, we can conclude that your requirements are unsatisfiable.
"""
UV_OFFLINE_WRONG_ABI = """\
error: No solution found when resolving dependencies
  cause: Because torch==2.13.0+cpu has no wheels with a matching Python ABI tag (e.g., `cp312`) and there is no version of torch==2.13.0, we can conclude that all of:
             torch==2.13.0
             torch==2.13.0+cpu
          cannot be used.
         And because you require torch==2.13.0, we can conclude that your requirements are unsatisfiable.

hint: You require CPython 3.12 (`cp312`), but we only found wheels for `torch` (v2.13.0+cpu) with the following Python ABI tag: `cp311`
"""
UV_DNS = """\
Using Python 3.11.7 environment at: e1
error: Request failed after 3 retries in 9.4s
  cause: Failed to fetch: https://download.pytorch.org/whl/cpu/torch/
  cause: error sending request for url (https://download.pytorch.org/whl/cpu/torch/)
  cause: client error (Connect)
  cause: dns error
  cause: error resolving DNS
  cause: failed to lookup address information: Name or service not known
"""
UV_REFUSED = """\
error: Request failed after 3 retries in 6.3s
  cause: Failed to fetch: http://127.0.0.1:9/simple/six/
  cause: error sending request for url (http://127.0.0.1:9/simple/six/)
  cause: client error (Connect)
  cause: tcp connect error
  cause: Connection refused (os error 111)
"""
UV_CONFLICT = """\
error: No solution found when resolving dependencies
  cause: Because peft==0.21.2 depends on torch>=2.14 and you require torch==2.13.0, we can conclude that your requirements are unsatisfiable.
"""

# A stand-in for uv: logs its words and the variables that matter, then prints and exits as the test asks.
FAKE_UV = r"""#!{python}
import json, os, sys
from pathlib import Path
here = Path(__file__).parent
with (here / "calls.jsonl").open("a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items()
                        if k.startswith(("UV_", "PIP_")) or k == "PYTHONPATH"}}}}) + "\n")
n = len((here / "calls.jsonl").read_text().splitlines())
fail = here / f"fail-{{n}}"
if fail.exists():
    sys.stdout.write(fail.read_text())
    sys.exit(1)
if sys.argv[1] == "venv":
    target = Path(sys.argv[-1])
    (target / "bin").mkdir(parents=True, exist_ok=True)
    (target / "pyvenv.cfg").write_text("home = /usr/bin\nversion_info = {major}.{minor}.0\n")
    os.symlink({python!r}, target / "bin" / "python")
print("fake uv done")
"""


@pytest.fixture
def xdg(tmp_path, monkeypatch) -> Path:
    """Every per-user folder under tmp_path; no NVIDIA driver; workers use the engine environment only."""
    for name in ("DATA", "CACHE", "STATE", "CONFIG"):
        monkeypatch.setenv(f"XDG_{name}_HOME", str(tmp_path / name.lower()))
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    monkeypatch.delenv(runtime.ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(runtime, "has_nvidia_driver", lambda: False)
    monkeypatch.setattr(runtime, "_has_torch_here", lambda: False)
    return tmp_path


@pytest.fixture
def fake_uv(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "fake-uv"
    folder.mkdir()
    uv = folder / "uv"
    uv.write_text(FAKE_UV.format(python=sys.executable, major=sys.version_info.major, minor=sys.version_info.minor))
    uv.chmod(0o755)
    monkeypatch.setattr(provision, "_uv", lambda: str(uv))
    return folder


def uv_calls(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]


def wheels(tmp_path) -> Path:
    d = tmp_path / "wheels"
    d.mkdir(exist_ok=True)
    (d / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    return d


# -- the pin ------------------------------------------------------------------------------------------------


def test_the_torch_pin_and_worker_packages_come_from_pyproject_in_a_checkout():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    workers = project["optional-dependencies"]["workers"]
    reqs = provision.worker_requirements()
    assert f"torch=={reqs.torch}" in workers
    assert set(reqs.packages) == {w for w in workers if not w.startswith("torch==")} | {
        d for d in project["dependencies"] if not d.lower().startswith(("pyside6", "pyqtgraph", "uv", "cryptography"))
    }
    assert not any(provision.normalized_name(p) == "torch" for p in reqs.packages)
    assert "setuptools>=68" in reqs.build  # what uv needs to build this checkout


def test_the_pin_comes_from_the_installed_metadata_outside_a_checkout(monkeypatch):
    monkeypatch.setattr(provision, "checkout_root", lambda: None)
    requires = ["numpy>=1.26", "PySide6-Essentials!=6.12.0,>=6.6", "uv>=0.5", "psutil>=5.9; sys_platform == 'linux'",
                'torch==2.13.0; extra == "workers"', 'peft>=0.12; extra == "workers"',
                'torchao==0.18.0; python_version >= "3.10" and extra == "workers"', 'pytest>=8; extra == "dev"']  # fmt: skip
    monkeypatch.setattr(provision.importlib.metadata, "requires", lambda name: requires)
    monkeypatch.setattr(provision.importlib.metadata, "version", lambda name: "9.9")
    reqs = provision.worker_requirements()
    assert reqs.torch == "2.13.0" and reqs.build == ()
    assert reqs.packages == ("peft>=0.12", 'torchao==0.18.0; python_version >= "3.10"', "numpy>=1.26",
                             "psutil>=5.9; sys_platform == 'linux'")  # fmt: skip
    requires[4] = 'torch>=2.6; extra == "workers"'
    with pytest.raises(UserError, match=r"must pin torch as torch==X \(found 'torch>=2.6'"):
        provision.worker_requirements()


# -- which build, which commands ------------------------------------------------------------------------------


def test_cpu_machines_get_the_cpu_build_and_auto_only_where_a_driver_is():
    assert provision.choose_backend("auto", driver=False) == "cpu"
    assert provision.choose_backend("auto", driver=True) == "auto"
    assert provision.choose_backend("cu126", driver=False) == "cu126"  # asked for: the check afterwards says so
    assert provision.torch_requirement("2.13.0", "cpu", offline=False) == "torch==2.13.0"
    if provision.platform.machine() == "x86_64":
        # Offline, the folder may hold several builds of the pin: the CPU one is asked for by name.
        assert provision.torch_requirement("2.13.0", "cpu", offline=True) == "torch==2.13.0+cpu"
    assert provision.torch_requirement("2.13.0", "auto", offline=True) == "torch==2.13.0"


def test_the_cuda_index_for_auto_follows_the_driver(monkeypatch):
    proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"
    open_module = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n"
    assert provision.driver_version(proprietary) == (550, 54)
    assert provision.driver_version(open_module) == (580, 65)
    for driver, tag in (((580, 65), "cu130"), ((570, 86), "cu128"), ((550, 54), "cu126")):
        monkeypatch.setattr(provision, "driver_version", lambda driver=driver: driver)
        assert provision.cuda_tag("auto") == tag
    assert provision.cuda_tag("cu126") == "cu126" and provision.cuda_tag("cpu") == "cpu"


def commands(**kw) -> list[list[str]]:
    args = dict(uv="uv", target=Path("/e"), create_with="/usr/bin/python3", clear=False, offline=False,
                find_links=[], index_url=None, backend="cpu", torch_req="torch==2.13.0", torch_pin="2.13.0",
                packages=["transformers>=4.45", "numpy>=1.26"], self_req="/src/rigpilot")  # fmt: skip
    return provision.install_commands(**{**args, **kw})


def test_offline_commands_never_reach_the_network():
    cmds = commands(offline=True, find_links=[Path("/w1"), Path("/w2")], torch_req="torch==2.13.0+cpu")
    assert cmds[0] == ["uv", "venv", "--offline", "--python", "/usr/bin/python3", "/e"]
    for cmd in cmds[1:]:
        assert cmd[:5] == ["uv", "pip", "install", "--python", "/e/bin/python"]
        assert "--offline" in cmd and "--no-index" in cmd and "--index-url" not in cmd and "--torch-backend" not in cmd
        assert cmd[cmd.index("--find-links") + 1] == "/w1" and "/w2" in cmd
    assert cmds[1][-1] == "torch==2.13.0+cpu"
    assert cmds[2][-3:] == ["torch==2.13.0", "transformers>=4.45", "numpy>=1.26"]  # the pin holds torch in place
    assert cmds[3][-4:] == ["--no-deps", "--reinstall-package", "rigpilot", "/src/rigpilot"]


def test_online_commands_pin_torch_and_choose_its_build():
    cmds = commands(create_with=None, index_url="https://mirror/simple")
    assert [c[1] for c in cmds] == ["pip", "pip", "pip"]  # the environment exists already
    torch, rest, own = cmds
    assert torch[-3:] == ["--torch-backend", "cpu", "torch==2.13.0"]
    assert rest[rest.index("--torch-backend") + 1] == "cpu" and "torch==2.13.0" in rest
    assert all(c[c.index("--index-url") + 1] == "https://mirror/simple" for c in cmds)
    assert not any(w == "torch" for c in cmds for w in c)  # never an unpinned torch
    assert "--offline" not in own and "--no-deps" in own
    wheel = commands(backend=None, torch_req="/w/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl", clear=True)
    assert "--clear" in wheel[0] and wheel[1][-1].endswith(".whl") and "--torch-backend" not in wheel[1]


def test_uv_runs_with_rigpilots_cache_and_without_ambient_install_settings(xdg):
    ambient = {"UV_INDEX_URL": "https://evil/simple", "UV_EXTRA_INDEX_URL": "x", "UV_CACHE_DIR": "/global/uv",
               "UV_FIND_LINKS": "/x", "UV_TORCH_BACKEND": "cu118", "UV_OFFLINE": "1", "UV_PYTHON": "3.9",
               "PIP_CONSTRAINT": "bad.txt", "PIP_INDEX_URL": "https://evil/simple", "UV_NATIVE_TLS": "1",
               "UV_HTTP_TIMEOUT": "90", "HTTPS_PROXY": "http://proxy:3128", "PYTHONPATH": "/app/site-packages",
               "HOME": "/home/u"}  # fmt: skip
    env = provision.uv_environment(ambient)
    assert env["UV_CACHE_DIR"] == str(xdg / "cache" / "rigpilot" / "uv") == str(runtime.uv_cache_dir())
    assert env["UV_NO_CONFIG"] == "1" and env["UV_PYTHON_DOWNLOADS"] == "never"
    for dropped in ("UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS", "UV_TORCH_BACKEND", "UV_OFFLINE",
                    "UV_PYTHON", "PIP_CONSTRAINT", "PIP_INDEX_URL", "PYTHONPATH"):  # fmt: skip
        assert dropped not in env
    assert env["UV_NATIVE_TLS"] == "1" and env["UV_HTTP_TIMEOUT"] == "90"  # how to connect is the user's choice
    assert env["HTTPS_PROXY"] == "http://proxy:3128" and env["HOME"] == "/home/u"


# -- what a failure says --------------------------------------------------------------------------------------


def failure(output: str, cmd: list[str] | None = None) -> provision._Failed:
    return provision._Failed(cmd or ["/x/uv", "pip", "install", "--python", "/e/bin/python"], 1, output.splitlines())


HINT = provision.download_commands(
    Path("/media/usb/wheels"), provision.WorkerRequirements("2.13.0", ("transformers>=4.45", "numpy>=1.26")),
    python_version="3.12", backend="cpu",
)


def test_download_commands_fetch_the_cpu_build_then_the_rest_from_pypi():
    torch, rest = HINT
    assert torch.startswith("pip download --only-binary=:all: --python-version 3.12 ")
    assert torch.endswith("-d /media/usb/wheels --no-deps torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
    assert "--find-links /media/usb/wheels torch==2.13.0 'transformers>=4.45' 'numpy>=1.26'" in rest
    assert "--index-url" not in rest and "--platform manylinux_2_28_" in rest
    cuda = provision.download_commands(Path("w"), provision.WorkerRequirements("2.13.0", ()), python_version="3.11",
                                     backend="cu128")  # fmt: skip
    assert cuda[0].endswith("torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")


@pytest.mark.parametrize("output, name", [(UV_OFFLINE_NO_TORCH, "torch"), (UV_OFFLINE_NO_FILELOCK, "filelock")])
def test_an_offline_failure_names_the_missing_wheel_and_how_to_fetch_it(output, name):
    message = str(provision._explain(failure(output), offline=True, folders=[Path("/media/usb/wheels")], hint=HINT))
    first, *rest = message.splitlines()
    assert first == f"the offline install found no {name} wheel in /media/usb/wheels."
    assert [line.strip() for line in rest[1:]] == HINT
    assert "On a machine with internet access" in rest[0]


def test_an_offline_failure_for_another_python_says_so():
    message = str(provision._explain(failure(UV_OFFLINE_WRONG_ABI), offline=True, folders=[Path("/w")], hint=HINT))
    lines = message.splitlines()
    assert lines[0] == "the offline install found no torch wheel (no wheel with a matching Python ABI tag) in /w."
    assert lines[1].startswith("uv: You require CPython 3.12 (`cp312`), but we only found wheels for `torch`")
    assert lines[2].startswith("On a machine with internet access, fetch every wheel it needs into /w,")


@pytest.mark.parametrize("output, reached", [
    (UV_DNS, "https://download.pytorch.org/whl/cpu/torch/ (failed to lookup address information: Name or service not known)"),
    (UV_REFUSED, "http://127.0.0.1:9/simple/six/ (Connection refused (os error 111))"),
])  # fmt: skip
def test_a_network_failure_ends_pointing_to_the_offline_install(output, reached):
    message = str(provision._explain(failure(output), offline=False, folders=[], hint=HINT))
    lines = message.splitlines()
    assert lines[0] == f"installing the engine environment failed: cannot reach {reached}."
    assert len(lines) == 2 and "'rigpilot engine-env install --offline --find-links DIR'" in lines[1]
    assert "'rigpilot engine-env wheels'" in lines[1]


def test_other_failures_say_what_uv_said_and_that_install_resumes():
    message = str(provision._explain(failure(UV_CONFLICT), offline=False, folders=[], hint=HINT))
    assert message.startswith("installing the engine environment failed at: uv pip install --python … (exit 1): ")
    assert "depends on torch>=2.14" in message and message.endswith("run 'rigpilot engine-env install' again to resume")
    assert provision.network_failure(UV_CONFLICT.splitlines()) is None and provision.missing_package([]) is None


# -- install() with a stand-in uv -----------------------------------------------------------------------------


def test_offline_install_runs_uv_offline_with_rigpilots_cache(xdg, fake_uv, monkeypatch, capsys):
    monkeypatch.setenv("UV_INDEX_URL", "https://evil/simple")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    folder = wheels(xdg)
    rc = cli_main(["engine-env", "install", "--offline", "--find-links", str(folder), "--python", sys.executable])
    calls = uv_calls(fake_uv)
    assert [c["argv"][:2] for c in calls] == [["venv", "--offline"], ["pip", "install"], ["pip", "install"],
                                              ["pip", "install"]]  # fmt: skip
    for c in calls:
        assert c["env"]["UV_CACHE_DIR"] == str(xdg / "cache" / "rigpilot" / "uv")
        assert "UV_INDEX_URL" not in c["env"] and "PYTHONPATH" not in c["env"]
    for c in calls[1:]:
        assert "--offline" in c["argv"] and "--no-index" in c["argv"] and str(folder) in c["argv"]
    # This checkout, at exactly the running version, built from a copy (it ran in a temporary folder, gone now).
    assert calls[-1]["argv"][-1].endswith("/src") and not Path(calls[-1]["argv"][-1]).exists()
    out = capsys.readouterr().out
    assert "no NVIDIA driver on this machine: installing the CPU build of torch" in out
    assert rc == 1  # the stand-in installed no torch: status says so


def test_a_failed_offline_install_prints_the_download_commands(xdg, fake_uv, capsys):
    (fake_uv / "fail-2").write_text(UV_OFFLINE_NO_TORCH)
    folder = wheels(xdg)
    rc = cli_main(["engine-env", "install", "--offline", "--find-links", str(folder)])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.splitlines()
    assert lines[0] == f"rigpilot: error: the offline install found no torch wheel in {folder}."
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert lines[2].strip().startswith(f"pip download --only-binary=:all: --python-version {version} ")
    assert lines[2].endswith("--index-url https://download.pytorch.org/whl/cpu")
    assert f"-d {folder} --find-links {folder} torch==2.13.0 " in lines[3] and "'setuptools>=68'" in lines[3]
    assert "Traceback" not in err


def test_an_online_dns_failure_points_to_the_offline_install(xdg, fake_uv, capsys):
    (fake_uv / "fail-2").write_text(UV_DNS)
    assert cli_main(["engine-env", "install"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("rigpilot: error: installing the engine environment failed: cannot reach https://")
    assert err[-1].endswith("then 'rigpilot engine-env install --offline --find-links DIR'.")
    torch_step = uv_calls(fake_uv)[1]["argv"]
    assert torch_step[-3:] == ["--torch-backend", "cpu", "torch==2.13.0"]


@pytest.mark.parametrize("argv, message", [
    (["--offline"], "--offline needs --find-links DIR"),
    (["--offline", "--find-links", "{w}", "--index-url", "https://x/simple"], "leave out --index-url"),
    (["--find-links", "{tmp}/nowhere"], "--find-links folder {tmp}/nowhere does not exist"),
    (["--python", "{tmp}/nowhere/python3"], "Python interpreter {tmp}/nowhere/python3 does not exist"),
    (["--torch-version", ">=2"], "--torch-version takes a version such as 2.13.0"),
    (["--wheel", "{w}/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "--torch-version", "2.14.0"],
     "is not torch 2.14.0"),
])  # fmt: skip
def test_bad_install_options_get_one_line(xdg, fake_uv, capsys, argv, message):
    w = wheels(xdg)
    argv = [a.format(w=w, tmp=xdg) for a in argv]
    assert cli_main(["engine-env", "install", *argv]) == 2
    err = capsys.readouterr().err
    for path in ("{tmp}/nowhere/python3", "{tmp}/nowhere"):  # a long temporary folder is shortened in the message
        message = message.replace(path, shown(path.format(tmp=xdg)))
    assert err.count("\n") == 1 and message in err
    assert not (fake_uv / "calls.jsonl").exists()  # nothing ran


def test_an_old_python_is_refused(xdg, fake_uv):
    old = xdg / "python3.9"
    old.write_text("#!/bin/sh\necho 3 9\n")
    old.chmod(0o755)
    with pytest.raises(UserError, match=r"is Python 3\.9; the engine environment needs 3\.11 or newer"):
        provision.install(offline=True, find_links=[wheels(xdg)], base_python=str(old), progress=lambda _: None)


def test_wheels_prints_the_commands_for_this_machine(xdg, capsys):
    assert cli_main(["engine-env", "wheels", "--find-links", str(xdg / "w")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(f"'rigpilot engine-env install --offline --find-links {xdg / 'w'}':")
    assert out[1].endswith("--index-url https://download.pytorch.org/whl/cpu")  # no driver here: the CPU build
    assert out[2].startswith("pip download ") and len(out) == 3


# -- the build check ------------------------------------------------------------------------------------------


def fake_worker(tmp_path: Path, cuda: str | None, rigpilot: str | None = __version__) -> str:
    script = tmp_path / "fake-python"
    info = {"torch": "2.13.0+cu130" if cuda else "2.13.0+cpu", "cuda": cuda, "hip": None,
            "arch": ["sm_90"] if cuda else [], "rigpilot": rigpilot}  # fmt: skip
    script.write_text(f"#!/bin/sh\necho '{json.dumps(info)}'\n")
    script.chmod(0o755)
    return str(script)


def test_a_cuda_build_without_a_driver_and_a_cpu_build_with_one_are_named(xdg, monkeypatch):
    monkeypatch.setenv(runtime.ENV_OVERRIDE, fake_worker(xdg, cuda="13.0"))
    st = runtime.status()
    assert st.installed and len(st.problems) == 1
    assert "is a CUDA 13.0 build but this machine has no NVIDIA driver" in st.problems[0]
    assert "--torch-backend cpu" in st.problems[0]
    monkeypatch.setenv(runtime.ENV_OVERRIDE, fake_worker(xdg, cuda=None))
    assert runtime.status().problems == []
    monkeypatch.setattr(runtime, "has_nvidia_driver", lambda: True)
    (problem,) = runtime.status().problems
    assert "is a CPU build but this machine has an NVIDIA driver" in problem
    (problem,) = runtime.status(["8.9"]).problems  # with the GPUs known, one message, not two
    assert "the GPUs will not be used" in problem


def test_an_engine_environment_without_this_rigpilot_says_so(xdg):
    for found, problem in ((None, "engine package is missing"), ("0.0.1", "has Rigpilot 0.0.1 and this is")):
        python = runtime.env_python()
        python.parent.mkdir(parents=True, exist_ok=True)
        python.unlink(missing_ok=True)
        python.symlink_to(fake_worker(xdg, cuda=None, rigpilot=found))
        (msg,) = runtime.status().problems
        assert problem in msg and "rigpilot engine-env install" in msg


# -- remove ---------------------------------------------------------------------------------------------------


def test_remove_deletes_the_environment_and_its_cache_but_nothing_a_link_points_to(xdg, capsys):
    env, cache = runtime.env_dir(), runtime.uv_cache_dir()
    (env / "lib").mkdir(parents=True)
    (env / "lib" / "torch.so").write_bytes(b"x" * 100_000)
    (cache / "archive-v0").mkdir(parents=True)
    (cache / "archive-v0" / "wheel").write_bytes(b"y" * 50_000)
    os.chmod(cache / "archive-v0", stat.S_IRUSR | stat.S_IXUSR)  # read-only, as some cache folders are
    keep = xdg / "my-models"
    keep.mkdir()
    (keep / "model.safetensors").write_text("mine")
    (env / "models").symlink_to(keep)
    (cache.parent / "other").mkdir()
    assert cli_main(["engine-env", "remove"]) == 0
    out = capsys.readouterr().out
    assert f"removing {env} (" in out and f"removing {cache} (" in out
    assert out.splitlines()[-1].startswith("removed the engine environment and its cache (")
    assert not env.exists() and not cache.exists()
    assert (keep / "model.safetensors").read_text() == "mine" and (cache.parent / "other").is_dir()
    assert cli_main(["engine-env", "remove"]) == 0
    assert capsys.readouterr().out == "no engine environment to remove\n"


def test_remove_refuses_while_jobs_run_in_the_environment(xdg):
    python = runtime.env_python()
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    import subprocess

    proc = subprocess.Popen([str(python), "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(UserError, match=rf"the engine environment is in use \(pid {proc.pid}\)"):
            provision.remove(progress=lambda _: None)
        assert python.is_symlink()
    finally:
        proc.kill()
        proc.wait()


# -- jobs get nothing of Rigpilot's on PYTHONPATH (issue item 4) ------------------------------------------------


def _rank_environment(tmp_path: Path) -> dict[str, str]:
    from rigpilot.engine.hardware.simulated import load_profile
    from rigpilot.engine.jobs.store import QUEUED, JobRecord, JobStore
    from rigpilot.engine.jobs.supervisor import Supervisor
    from rigpilot.engine.jobspec.spec import JobSpec

    store = JobStore(tmp_path / "engine.db")
    sup = Supervisor(store, tmp_path / "jobs", load_profile("4x-rtx4090"))
    rec = JobRecord(id="ab12cd", seq=store.next_seq(), kind="script", name="demo", state=QUEUED, gpus=[0, 1],
                    ranks=2, simulated=True, created=0.0)  # fmt: skip
    spec = JobSpec(id="ab12cd", kind="script", script=["train.py"], env={"MY_SETTING": "1"})
    return sup._environment(rec, spec, tmp_path / "jobs" / "ab12cd", "/e/bin/python")


def test_ranks_get_no_pythonpath_from_rigpilot(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = _rank_environment(tmp_path)
    assert "PYTHONPATH" not in env and env["MY_SETTING"] == "1"
    # The user's own PYTHONPATH passes through as it is: nothing of Rigpilot's is added to it.
    monkeypatch.setenv("PYTHONPATH", "/home/u/research")
    assert _rank_environment(tmp_path)["PYTHONPATH"] == "/home/u/research"
    # The engine environment's own tools (uv, the status probe) drop the app's PYTHONPATH too.
    assert "PYTHONPATH" not in provision.uv_environment() and "PYTHONPATH" not in runtime.standalone_environment()


def test_only_the_packaged_rigpilot_builds_from_the_packages_wheels(tmp_path, monkeypatch):
    """A checkout on a machine that also has the .deb must not take its wheels: a purge removes them mid-install."""
    prefix = tmp_path / "opt" / "rigpilot"
    (prefix / "wheels").mkdir(parents=True)
    monkeypatch.setattr(provision, "SHIPPED_WHEELS", prefix / "wheels")
    assert provision.shipped_wheels() is None  # this checkout's own code is elsewhere
    monkeypatch.setattr(provision, "__file__", str(prefix / "lib/common/rigpilot/engine/provision.py"))
    assert provision.shipped_wheels() == prefix / "wheels"
    (prefix / "wheels").rmdir()
    assert provision.shipped_wheels() is None
