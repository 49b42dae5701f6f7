"""A user's jobs are private to them: 0700/0600 whatever the umask, secrets never on disk in plain text.

Runs a real engine service (the harness of test_service_engine) with its state in a folder every local
user may traverse, so the only thing keeping others out is the engine's own permissions; the reading
check runs as `nobody` with the system Python.
"""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from rigpilot.engine.api.client import EngineError
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.jobspec.secrets import MASK, is_secret, read_secrets_file, split

from support.engine import Engine, engine_home, leftover_job_processes

HF_TOKEN = "hf_" + "Zq7" * 12
WANDB_KEY = "0123456789abcdef" * 2 + "-wandb"

SECRET_SCRIPT = """
import hashlib, os, sys, pathlib
from rigpilot import report
def h(name):
    return hashlib.sha256(os.environ.get(name, "").encode()).hexdigest()
ok = [h("HF_TOKEN"), h("WANDB_API_KEY")] == sys.argv[1:3] and os.environ.get("PLAIN_SETTING") == "1"
report(step=1, secrets_ok=ok)
print("secrets arrived" if ok else "secrets missing", flush=True)
sys.exit(0 if ok and pathlib.Path(sys.argv[3]).exists() else 4)
"""

READ_AS_OTHER_USER = """
import json, os, sys
opened = []
for p in json.load(sys.stdin):
    try:
        if os.path.isdir(p):
            os.listdir(p)
        else:
            open(p, "rb").close()
        opened.append(p)
    except PermissionError:
        pass
print(json.dumps(opened))
"""


def test_secret_names_and_values_are_recognised():
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                 "OPENAI_APIKEY", "GITHUB_PAT"):  # fmt: skip
        assert is_secret(name, "x"), name
    for name in ("PATH", "PWD", "PYTHONPATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "KEYBOARD_LAYOUT_X"):
        assert not is_secret(name, "1"), name
    assert is_secret("SOMETHING", "hf_abcdefgh") and is_secret("X", "sk-abcdef")
    assert split({"HF_TOKEN": "hf_x1", "A": "1", "B": MASK}) == ({"HF_TOKEN": MASK, "A": "1", "B": MASK}, {"HF_TOKEN": "hf_x1"})


def test_a_secrets_file_others_could_read_is_refused(tmp_path):
    f = tmp_path / "secrets.env"
    f.write_text("# mine\nexport HF_TOKEN='hf_abc'\nOTHER=2\n")
    os.chmod(f, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_secrets_file(f)
    os.chmod(f, 0o600)
    assert read_secrets_file(f) == {"HF_TOKEN": "hf_abc", "OTHER": "2"}
    assert read_secrets_file(tmp_path / "none.env") == {}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _everything_under(*roots: Path) -> list[Path]:
    out = []
    for root in roots:
        for top, dirs, files in os.walk(root):
            out += [Path(top) / n for n in dirs + files]
    return out


def _readable_by_nobody(paths: list[Path]) -> list[str]:
    proc = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3", "-c", READ_AS_OTHER_USER],
        input=json.dumps([str(p) for p in paths]), capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def shared_engine(monkeypatch):
    """An engine whose XDG folders sit in a 0755 folder any user may traverse (tmp_path is root's 0700)."""
    if os.geteuid() != 0:
        pytest.skip("checking what another user can read needs root (to run the check as nobody)")
    if not shutil.which("setpriv") or not Path("/usr/bin/python3").exists():
        pytest.skip("needs setpriv and /usr/bin/python3 to read as nobody")
    base = Path(tempfile.mkdtemp(prefix="rigpilot-private-"))
    os.chmod(base, 0o755)
    engine_home(base, monkeypatch)
    old_umask = os.umask(0o022)  # a usual umask: the engine must not depend on a strict one
    e = Engine(base)
    try:
        yield e
    finally:
        os.umask(old_umask)
        e.stop()
        for p in leftover_job_processes(base):
            p.kill()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_job_data_is_private_and_secrets_stay_in_memory(shared_engine, capsys):
    engine = shared_engine
    state, config = engine.tmp / "state" / "rigpilot", engine.tmp / "config" / "rigpilot"
    config.mkdir(parents=True)
    old = state / "jobs" / "old-version"
    old.mkdir(parents=True)  # what an older Rigpilot left, world-readable: tightened at start
    (old / "job.json").write_text("{}")
    os.chmod(state, 0o755), os.chmod(state / "jobs", 0o755), os.chmod(old, 0o755), os.chmod(old / "job.json", 0o644)
    engine.start("--tcp", "127.0.0.1:0")
    gate = engine.tmp / "gate"
    script = engine.script("secret.py", SECRET_SCRIPT)
    env = {"HF_TOKEN": HF_TOKEN, "WANDB_API_KEY": WANDB_KEY, "PLAIN_SETTING": "1"}
    with engine.client() as c:
        spec = {"kind": "script", "script": [script, _sha(HF_TOKEN), _sha(WANDB_KEY), str(gate)], "gpus": [0, 1],
                "env": env, "name": "secret \x1b[31mred"}  # fmt: skip
        job = c.request("submit", spec=spec, cwd=str(engine.tmp))["job"]
        done = engine.wait_state(c, job["id"], "failed", "completed")
        records = c.request("metrics", job=job["id"])["records"]
    # The ranks got the secrets (they exit 4 only because the gate is shut) ...
    assert done["state"] == "failed" and all(r.get("secrets_ok") for r in records if "secrets_ok" in r), records
    job_dir = Path(done["job_dir"])
    # ... and job.json shows them masked.
    assert json.loads((job_dir / "job.json").read_text())["env"] == {
        "HF_TOKEN": MASK, "WANDB_API_KEY": MASK, "PLAIN_SETTING": "1"
    }  # fmt: skip

    # A restarted engine has lost them: resume asks for them, naming where they may be kept.
    engine.stop()
    engine.start("--tcp", "127.0.0.1:0")
    with engine.client() as c, pytest.raises(EngineError, match="needs HF_TOKEN, WANDB_API_KEY again") as refused:
        c.request("resume", job=job["id"])
    assert f"rigpilot resume {job['id']} --env NAME=VALUE" in str(refused.value) and "secrets.env" in str(refused.value)
    secrets_file = config / "secrets.env"
    secrets_file.write_text(f"HF_TOKEN={HF_TOKEN}\n")
    os.chmod(secrets_file, 0o644)
    with engine.client() as c, pytest.raises(EngineError, match="chmod 600"):
        c.request("resume", job=job["id"])
    os.chmod(secrets_file, 0o600)
    gate.touch()
    capsys.readouterr()
    # One from the user's file, one given again on the command line.
    assert cli_main(["resume", job["id"], "--env", f"WANDB_API_KEY={WANDB_KEY}"]) == 0
    out = capsys.readouterr().out
    assert "queued again (run 2" in out and "completed" in out
    # The step both runs reported: the first run's record is superseded by the resumed run's.
    assert cli_main(["metrics", job["id"], "--json"]) == 0
    steps = [r for r in json.loads(capsys.readouterr().out)["records"] if r.get("step") == 1 and r["rank"] == 0]
    assert [(r["run"], r.get("superseded", False)) for r in steps] == [(1, True), (2, False)]
    assert cli_main(["jobs"]) == 0
    listing = capsys.readouterr().out
    assert "secret \\x1b[31mred" in listing and "\x1b" not in listing  # the name's escape is shown, not obeyed

    # Nothing under the state or config folders holds a secret in plain text (the user's own file aside) ...
    files = [p for p in _everything_under(state, config) if p.is_file() and p != secrets_file]
    for f in files:
        data = f.read_bytes()
        assert HF_TOKEN.encode() not in data and WANDB_KEY.encode() not in data, f
    assert HF_TOKEN not in (engine.tmp / "engine.log").read_text()
    # ... every folder is 0700 and every file 0600 although this test's umask is 022 ...
    for p in [state, config, *_everything_under(state, config)]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode & 0o077 == 0, f"{p} is {oct(mode)}"
    assert (state / "engine.db").is_file() and (state / "jobs" / "old-version" / "job.json").is_file()
    assert (config / "engine-token").is_file() and (job_dir / "job.json").is_file()
    assert list((job_dir / "metrics").glob("rank*.jsonl")) and list((job_dir / "logs").glob("rank*.log"))
    # ... and another user can open none of it. A control file beside them shows the check can fail.
    control = engine.tmp / "control.txt"
    control.write_text("readable")
    os.chmod(control, 0o644)
    everything = [state, config, *_everything_under(state, config)]
    assert _readable_by_nobody([*everything, control]) == [str(control)]
    # Even with the folders opened up, the files themselves keep other users out.
    for p in everything:
        if p.is_dir():
            os.chmod(p, 0o755)
    assert _readable_by_nobody([p for p in everything if p.is_file() and p != secrets_file]) == []
