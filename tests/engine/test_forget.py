"""`rigpilot forget`: one user deletes their own Rigpilot data, and nothing a link inside it points to.

Every folder is under tmp_path (XDG_*), with `~/.cache` a link to another disk as some users have it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rigpilot.engine import userdata
from rigpilot.engine.cli.entry import main as cli_main

from support.paths import REPO
from support.waiting import wait_for


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    elsewhere = tmp_path / "other-disk"
    (elsewhere / "cache" / "another-app").mkdir(parents=True)
    (elsewhere / "cache" / "another-app" / "keep.txt").write_text("not Rigpilot's")
    home.mkdir()
    (home / ".cache").symlink_to(elsewhere / "cache")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / ".local" / "share"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return home


def write(path: Path, data: bytes | str = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def fill(home: Path, tmp_path: Path) -> Path:
    """Rigpilot's folders as a user has them, links to the user's own data inside; returns that data's folder."""
    mine = tmp_path / "my-data"
    write(mine / "dataset" / "train.jsonl", '{"text": "mine"}\n')
    write(mine / "notes.txt", "mine too")
    write(home / ".config" / "rigpilot" / "settings.json", "{}")
    job = home / ".local" / "state" / "rigpilot" / "jobs" / "ab12cd"
    write(job / "checkpoints" / "model.safetensors", os.urandom(300_000))
    (job / "dataset").symlink_to(mine / "dataset")  # a link to a folder elsewhere: unlinked, never followed
    (job / "notes.txt").symlink_to(mine / "notes.txt")
    write(home / ".local" / "state" / "rigpilot" / "engine.db", b"db")
    write(home / ".local" / "share" / "rigpilot" / "engine-env" / "bin" / "python", b"#!")
    (home / ".local" / "share" / "rigpilot" / "models").symlink_to(mine)
    write(home / ".cache" / "rigpilot" / "uv" / "archive-v0" / "torch.so", os.urandom(200_000))
    units = home / ".config" / "systemd" / "user"
    write(units / "rigpilot-engine.service", "[Service]\n")
    write(units / "other.service", "[Service]\n")
    (units / "default.target.wants").mkdir()
    (units / "default.target.wants" / "rigpilot-engine.service").symlink_to(units / "rigpilot-engine.service")
    return mine


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (links followed: what the user sees) with a hash of its bytes."""
    out = {}
    for top, _dirs, files in os.walk(root, followlinks=True):
        for name in files:
            p = Path(top) / name
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def rigpilot_folders(home: Path, tmp_path: Path) -> list[Path]:
    return [home / ".config" / "rigpilot", home / ".local" / "state" / "rigpilot", home / ".local" / "share" / "rigpilot",
            tmp_path / "other-disk" / "cache" / "rigpilot"]  # fmt: skip


def test_forget_lists_what_it_deletes_asks_and_leaves_everything_else(home, tmp_path, monkeypatch, capsys):
    mine = fill(home, tmp_path)
    before = snapshot(mine)
    others = snapshot(tmp_path / "other-disk" / "cache" / "another-app")

    # No terminal to ask on and no --yes: nothing happens.
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    assert cli_main(["forget"]) == 2
    assert "run 'rigpilot forget --yes' to delete" in capsys.readouterr().err
    assert all(p.exists() for p in rigpilot_folders(home, tmp_path))

    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert cli_main(["forget"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "nothing deleted"
    assert all(p.exists() for p in rigpilot_folders(home, tmp_path))
    listing = out.splitlines()
    # Each folder with its size: the state folder holds the 300 kB checkpoint, the cache (through the link) 200 kB.
    state = next(line for line in listing if f"{home}/.local/state/rigpilot " in line)
    assert "KiB" in state and float(state.split()[1]) >= 290
    assert any(str(tmp_path / "other-disk" / "cache" / "rigpilot") in line or f"{home}/.cache/rigpilot" in line
               for line in listing)  # fmt: skip
    assert any("rigpilot-engine.service" in line and "systemd" in line for line in listing)
    assert "Links inside these folders are removed, not followed" in out

    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert cli_main(["forget"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("deleted: ")
    for p in rigpilot_folders(home, tmp_path):
        assert not os.path.lexists(p), p
    assert snapshot(mine) == before  # the data the links pointed to is all there
    assert snapshot(tmp_path / "other-disk" / "cache" / "another-app") == others
    assert (home / ".cache").is_symlink()  # the user's own link stays
    units = home / ".config" / "systemd" / "user"
    assert not os.path.lexists(units / "rigpilot-engine.service")
    assert not os.path.lexists(units / "default.target.wants" / "rigpilot-engine.service")
    assert (units / "other.service").exists()
    assert cli_main(["forget", "--yes"]) == 0
    assert "nothing to delete" in capsys.readouterr().out


def test_a_rigpilot_folder_that_is_itself_a_link_is_unlinked_and_its_target_kept(home, tmp_path, capsys):
    big_disk = tmp_path / "big-disk" / "rigpilot-data"
    write(big_disk / "engine-env" / "bin" / "python", b"#!")
    (home / ".local" / "share").mkdir(parents=True)
    (home / ".local" / "share" / "rigpilot").symlink_to(big_disk)
    (item,) = userdata.plan()
    assert item.link_to == str(big_disk)
    assert cli_main(["forget", "--yes"]) == 0
    assert f"a link to {big_disk}: the link goes, what it points to stays" in capsys.readouterr().out
    assert not os.path.lexists(home / ".local" / "share" / "rigpilot")
    assert (big_disk / "engine-env" / "bin" / "python").exists()


def test_forget_refuses_while_one_of_its_jobs_runs(home, tmp_path, capsys):
    fill(home, tmp_path)
    job_dir = home / ".local" / "state" / "rigpilot" / "jobs" / "ab12cd"
    other = tmp_path / "someone-else" / "jobs" / "ffffff"

    def rank(job: str, folder: Path) -> subprocess.Popen:
        env = {**os.environ, "RIGPILOT_JOB_ID": job, "RIGPILOT_JOB_DIR": str(folder)}
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)

    ranks = [rank("ab12cd", job_dir), rank("ffffff", other)]
    try:
        wait_for(userdata.blockers, 10, 0.05, "the children to exec with their environment")
        assert cli_main(["forget", "--yes"]) == 2
        err = capsys.readouterr().err
        assert f"job ab12cd is running (pid {ranks[0].pid}): cancel it first with 'rigpilot cancel ab12cd'" in err
        assert "ffffff" not in err  # another Rigpilot's job (other folders) is not ours to wait for
        assert job_dir.exists()
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert cli_main(["forget", "--yes"]) == 0
    assert not job_dir.exists()


def test_forget_stops_the_engine_service_first(home, tmp_path, monkeypatch, capsys):
    """A real engine service: forget stops it through the client's shutdown and waits for it to end."""
    monkeypatch.setenv("RIGPILOT_SIMULATE", "4x-rtx4090")
    log = (tmp_path / "engine-out.log").open("ab")
    engine = subprocess.Popen([sys.executable, "-m", "rigpilot.engine.service"], cwd=REPO, stdout=log, stderr=log)
    try:
        from rigpilot.engine.api.client import EngineClient, service_running

        wait_for(lambda: service_running() or engine.poll() is not None, 60, what="the engine service to start")
        assert engine.poll() is None, (tmp_path / "engine-out.log").read_text()
        assert userdata.engine_pid() == engine.pid
        with EngineClient(autostart=False) as client:
            assert client.request("jobs")["jobs"] == []
        assert (home / ".local" / "state" / "rigpilot" / "engine.db").exists()
        assert cli_main(["forget", "--yes"]) == 0
        assert f"Your engine service (pid {engine.pid}) is stopped first." in capsys.readouterr().out
        assert engine.wait(10) == 0  # a clean stop, not a kill
        assert not (home / ".local" / "state" / "rigpilot").exists()
        assert not (tmp_path / "run" / "rigpilot").exists()
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to act as another user")
def test_another_user_forgets_their_own_data_read_only_folders_included():
    """As `nobody`, for whom permissions count (root's rmtree ignores them): a read-only folder goes too."""
    uid = gid = 65534
    base = Path(tempfile.mkdtemp(prefix="rigpilot-forget-"))
    try:
        os.chmod(base, 0o755)
        home = base / "home"
        state = home / ".local" / "state" / "rigpilot"
        write(state / "jobs" / "ab12cd" / "output" / "model.safetensors", b"weights")
        write(home / ".cache" / "rigpilot" / "uv" / "x", b"cache")
        theirs = base / "root-owned"
        write(theirs / "keep.txt", "root's")
        (state / "jobs" / "ab12cd" / "data").symlink_to(theirs)
        (home / "run").mkdir(mode=0o700)
        for top, dirs, files in os.walk(home):
            for name in [*dirs, *files, "."]:
                os.lchown(os.path.join(top, name), uid, gid)
        os.chmod(state / "jobs" / "ab12cd" / "output", 0o500)  # read-only, as some job outputs are
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": str(REPO),
               "XDG_RUNTIME_DIR": str(home / "run"), "XDG_CONFIG_HOME": str(home / ".config"),
               "XDG_STATE_HOME": str(home / ".local" / "state"), "XDG_DATA_HOME": str(home / ".local" / "share"),
               "XDG_CACHE_HOME": str(home / ".cache")}  # fmt: skip
        done = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable, "-m", "rigpilot.engine.cli",
             "forget", "--yes"], env=env, capture_output=True, text=True, timeout=120, cwd="/",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert not state.exists() and not (home / ".cache" / "rigpilot").exists()
        assert (theirs / "keep.txt").read_text() == "root's"
    finally:
        for top, dirs, _files in os.walk(base):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(top, name), 0o700)
        shutil.rmtree(base)
