"""engine.given_path (a path the user gave) and engine.jobspec.secrets (what of a job's env is secret), in process.

Real files of every kind in tmp_path: FIFOs, a listening socket's file, /dev/null, symlinks (dangling, looping,
to a FIFO), names past NAME_MAX and paths past PATH_MAX. The CLI and the socket use these same functions; the
bad-input suite (test_bad_input.py) drives them end to end.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from rigpilot.engine import given_path as gp
from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import PathRefused, check_given_path, is_given_file, is_given_folder, open_given_file
from rigpilot.engine.jobspec.secrets import MASK, is_masked, is_secret, mask_credentials, plain, shown_text, split
from rigpilot.engine.models.repo_id import repo_id_problem


@pytest.fixture
def kinds(tmp_path: Path):
    (tmp_path / "data.txt").write_text("hello\n")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link-to-fifo").symlink_to(tmp_path / "fifo")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "link-to-data").symlink_to(tmp_path / "data.txt")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "sock"))
    yield tmp_path
    s.close()


@pytest.mark.parametrize(
    ("name", "expect", "problem", "words"),
    [
        ("missing.txt", gp.FILE, gp.MISSING, "does not exist"),
        ("fifo", gp.FILE, gp.SPECIAL, "is a named pipe (FIFO), not a regular file"),
        ("link-to-fifo", gp.FILE, gp.SPECIAL, "links to a named pipe (FIFO)"),
        ("fifo", gp.FOLDER, gp.SPECIAL, "not a folder"),
        ("sock", gp.EITHER, gp.SPECIAL, "is a socket, not a regular file or folder"),
        ("/dev/null", gp.FILE, gp.SPECIAL, "is a character device"),
        ("folder", gp.FILE, gp.NOT_A_FILE, "is a folder; give a file"),
        ("data.txt", gp.FOLDER, gp.NOT_A_FOLDER, "is a file; give a folder"),
        ("dangling", gp.FILE, gp.MISSING, "does not exist"),
        ("loop", gp.FILE, gp.LINK_LOOP, "symbolic links"),
        ("data.txt/x", gp.FILE, gp.MISSING, "a part of it is a file"),
        ("n" * 256, gp.FILE, gp.NAME_TOO_LONG, "256 bytes long; file names have at most 255 bytes"),
        ("é" * 128, gp.FILE, gp.NAME_TOO_LONG, "256 bytes long"),  # 128 characters, 256 bytes
        ("/".join(["d" * 200] * 21), gp.FILE, gp.PATH_TOO_LONG, "paths have at most 4,095 bytes"),
        ("a\x00b", gp.FILE, gp.BAD_NAME, "NUL"),
        ("bad\udcffname", gp.FILE, gp.MISSING, "does not exist"),  # an undecodable byte, as argv brings it
        ("bad\ud800name", gp.FILE, gp.BAD_NAME, "not a valid file name"),  # a lone surrogate: no byte form
        ("~no-such-user-rigpilot/x", gp.FILE, gp.MISSING, "no user 'no-such-user-rigpilot'"),
        ("", gp.FILE, gp.EMPTY, "no data file given"),
    ],
)
def test_every_bad_path_is_one_line_with_its_problem(kinds, name, expect, problem, words):
    with pytest.raises(PathRefused) as e:
        check_given_path(name, "data file", expect=expect, base=kinds)
    assert e.value.problem == problem and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300 and e.value.path == name
    assert isinstance(e.value, UserError)


def test_good_paths_pass_and_missing_ok_lets_a_new_file_through(kinds):
    assert check_given_path("data.txt", "data file", base=kinds) == kinds / "data.txt"
    assert check_given_path("link-to-data", "data file", base=kinds) == kinds / "link-to-data"
    assert check_given_path("folder", "f", expect=gp.FOLDER, base=kinds) == kinds / "folder"
    assert check_given_path("é" * 127 + "a", "data file", base=kinds, missing_ok=True).name == "é" * 127 + "a"  # 255
    assert check_given_path("new.csv", "csv", base=kinds, missing_ok=True) == kinds / "new.csv"
    assert check_given_path("~", "home", expect=gp.FOLDER) == Path.home()
    for name in ("fifo", "n" * 256, "folder"):  # missing_ok is about missing only
        with pytest.raises(PathRefused):
            check_given_path(name, "csv", base=kinds, missing_ok=True)
    assert is_given_file(kinds / "data.txt") and not is_given_file(kinds / "fifo") and not is_given_file("n" * 300)
    assert is_given_folder(kinds) and not is_given_folder(kinds / "data.txt") and not is_given_folder("a\x00")


def test_open_given_file_never_blocks_on_a_fifo(kinds):
    with open_given_file(kinds / "data.txt", "data file") as f:
        assert f.read() == b"hello\n"
    done = threading.Event()

    def try_fifo():
        with pytest.raises(PathRefused, match="named pipe"):
            open_given_file(kinds / "link-to-fifo", "plan")
        done.set()

    t = threading.Thread(target=try_fifo, daemon=True)
    t.start()
    t.join(20)
    if not done.is_set():  # it blocked in open(): let it go, then fail
        os.close(os.open(kinds / "fifo", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("open_given_file blocked on a FIFO")


# -- secrets -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [
    "HF_TOKEN", "MY_PW", "DB_PASS", "AWS_CREDENTIALS", "MY_AUTH", "SSHPASS", "PGPASS", "MYAUTH", "GH_CREDS",
    "dbPassword", "myPw", "api_key", "X_SIGNATURE", "DB_PWD", "HTTP_AUTHORIZATION", "PRIVATE_KEY_PEM",
])  # fmt: skip
def test_secret_names(name):
    assert is_secret(name, "plain-value") and split({name: "v"})[0] == {name: MASK}


@pytest.mark.parametrize("name", ["PATH", "PWD", "OLDPWD", "PYTHONPATH", "KEYBOARD_LAYOUT", "AUTHOR", "PASSAGE_LEN",
                                  "COMPASS_HEADING", "OMP_NUM_THREADS", "DATABASE_URL"])  # fmt: skip
def test_plain_names(name):
    assert not is_secret(name, "1")


@pytest.mark.parametrize(("value", "shown"), [
    ("postgres://u:PASS@host/db", f"postgres://u:{MASK}@host/db"),
    ("postgresql://user:p@ss@db.example:5432/x?sslmode=require", f"postgresql://user:{MASK}@db.example:5432/x?sslmode=require"),
    ("https://ghp_abcdefghijklmnop@github.com/o/r.git", f"https://{MASK}@github.com/o/r.git"),
    ("https://0123456789abcdef0123@o1.ingest.sentry.io/5", f"https://{MASK}@o1.ingest.sentry.io/5"),
    ("https://host/api?user=me&token=abc123&x=1", f"https://host/api?user=me&token={MASK}&x=1"),
    ("Server=db;User Id=sa;Password=hunter2;", f"Server=db;User Id=sa;Password={MASK};"),
    ("--lr=1e-4 --api-key=abc", f"--lr=1e-4 --api-key={MASK}"),
    ("https://s3/b/k?X-Amz-Credential=AKIAX%2F&X-Amz-Signature=ffee", f"https://s3/b/k?X-Amz-Credential={MASK}&X-Amz-Signature={MASK}"),
    ("Bearer abc.def", MASK),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig", MASK),
])  # fmt: skip
def test_credentials_inside_values_are_masked_and_kept_apart(value, shown):
    assert mask_credentials(value) == shown
    stored, hidden = split({"SOME_SETTING": value})
    assert stored == {"SOME_SETTING": shown} and hidden == {"SOME_SETTING": value}
    assert is_masked(stored["SOME_SETTING"]) and plain(stored) == {}


def test_plain_values_and_already_masked_ones():
    env = {"A": "1", "URL": "https://example.com/x?page=2", "USER_URL": "ssh://git@github.com/x", "B": MASK,
           "C": f"postgres://u:{MASK}@h/db"}  # fmt: skip
    stored, hidden = split(env)
    assert stored == env and hidden == {}  # masked ones (a cloned job's) stay masked, for the caller to find
    assert plain(stored) == {"A": "1", "URL": "https://example.com/x?page=2", "USER_URL": "ssh://git@github.com/x"}
    assert shown_text("hf_abcdefghijk") == MASK and shown_text("MY_PW=x") == f"MY_PW={MASK}"
    assert shown_text("A=postgres://u:p@h") == f"A=postgres://u:{MASK}@h" and shown_text("oops") == "oops"


def test_repo_ids():
    for ok in ("gpt2", "meta-llama/Llama-2-7b-hf", "Qwen/Qwen2.5-0.5B", "a_b.c"):
        assert repo_id_problem(ok) is None, ok
    for bad, words in (("a" * 97, "at most 96"), ("a/b/c", "one '/'"), ("a b", "ASCII"), ("a--b", "'--'"),
                       ("/x", "empty"), ("x.git", ".git"), ("é", "ASCII"), ("-x", "start")):  # fmt: skip
        assert words in (repo_id_problem(bad) or ""), bad


def test_the_wizard_and_the_install_dialog_apply_the_same_rule(kinds):
    from rigpilot.app.engine_env.dialog import validate_folder, validate_wheel
    from rigpilot.app.wizard.data_check import inspect_file
    from rigpilot.app.wizard.model_check import missing_weights
    from rigpilot.app.wizard.state import WizardState

    os.mkfifo(kinds / "torch.whl")
    for name, words in (("fifo", "named pipe"), ("link-to-fifo", "links to a named pipe"), ("n" * 256, "255 bytes"),
                        ("missing.txt", "does not exist"), ("folder", "is a folder"), ("sock", "socket")):  # fmt: skip
        problem = inspect_file(str(kinds / name)).problem
        assert problem and words in problem and "\n" not in problem, (name, problem)
    assert "named pipe" in (validate_wheel(str(kinds / "torch.whl")) or "")
    assert "named pipe" in (validate_folder(str(kinds / "fifo")) or "")
    assert "255 bytes" in (validate_folder("w" * 300) or "")
    for model in ("n" * 300 + "/config.json", "~no-such-user-rigpilot/config.json", str(kinds / "fifo" / "config.json")):
        assert WizardState(model=model).planning_model() == model  # never raises: not a local config.json
        assert missing_weights(model) is None
