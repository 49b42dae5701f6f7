"""Bad input, every way it comes: each path-taking flag and socket field, given each kind of bad path, against a
real engine service; a head engine's member requests naming folders; secrets in env values; and weird-but-valid
input that must be accepted and then run.

Every refusal must be one line ("rigpilot: error: ..." from the CLI; a coded error from the socket, `bad_path`
with its `problem` for a path), with no traceback, no "Rigpilot hit a bug", no hang, and nothing left behind
(no job, node or study). Every accepted input must not fail later: its job runs to completion.

The CLI cases run its real main() in this process (the same code as the `rigpilot` program, without a
process start per case); a few run the program itself, for what only a real process shows (a traceback on
stderr). A FIFO that something opens for reading or writing would block it forever: a watchdog opens the
other end after a while, so a hang becomes a failure naming the case instead of a stuck test run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rigpilot.engine import paths
from rigpilot.engine.api import protocol
from rigpilot.engine.api.client import EngineError
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.jobspec.secrets import MASK

from support.engine import Engine, engine_home, leftover_job_processes
from support.paths import REPO

pytestmark = pytest.mark.slow

HANG_S = 10.0  # far beyond any refusal; only a blocked open() takes this long

# -- the kinds of bad path -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    name: str
    path: str  # as typed, relative to the work folder
    words: tuple[str, ...] | None  # one of these is in the refusal (None: one line is all that is asked)
    problem: str | None  # the socket's `bad_path` problem code, where the refusal is the path's


def kinds() -> list[Kind]:
    deep = "/".join(["d" * 200] * 21)  # 4221 bytes, every name within NAME_MAX
    return [
        Kind("missing", "missing", ("does not exist", "no such folder"), "missing"),
        Kind("fifo", "fifo", ("named pipe",), "special_file"),
        Kind("link to fifo", "link-to-fifo", ("links to a named pipe",), "special_file"),
        Kind("socket", "sock", ("a socket",), "special_file"),
        Kind("device", "/dev/null", ("character device",), "special_file"),
        Kind("folder", "folder", ("is a folder", "no config.json"), None),
        Kind("file", "data.txt", ("is a file", "not valid JSON", "config.json", "not executable"), None),
        Kind("long name", "n" * 256, ("at most 255 bytes",), "name_too_long"),
        Kind("long UTF-8 name", "é" * 128, ("at most 255 bytes",), "name_too_long"),
        Kind("long path", deep, ("at most 4,095 bytes",), "path_too_long"),
        Kind("NUL", "a\x00b", ("NUL",), "bad_name"),
        Kind("unknown user", "~no-such-user-rigpilot/x", ("no user",), "missing"),
        Kind("dangling link", "dangling", ("does not exist", "no such folder"), "missing"),
        Kind("link loop", "loop", ("symbolic links",), "link_loop"),
        Kind("through a file", "data.txt/x", ("does not exist", "is a file", "no such folder"), "missing"),
        Kind("empty", "", None, None),
    ]


def make_work_folder(w: Path) -> list[Path]:
    """The files every kind names; returns the FIFOs (for the watchdog)."""
    w.mkdir(exist_ok=True)
    (w / "data.txt").write_text("to be or not to be\n" * 20)
    (w / "folder").mkdir(exist_ok=True)
    (w / "wheels").mkdir(exist_ok=True)
    os.mkfifo(w / "fifo")
    (w / "link-to-fifo").symlink_to(w / "fifo")
    (w / "dangling").symlink_to(w / "nowhere")
    (w / "loop").symlink_to(w / "loop")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(w / "sock"))
    s.close()  # the socket file stays
    return [w / "fifo"]


# -- where paths go in --------------------------------------------------------------------------------------------

FILE, FOLDER, MODEL, SCRIPT, OUTPUT, PYTHON, PROFILE = "file", "folder", "model", "script", "output", "python", "profile"
SKIP = {  # kinds that are valid input for a kind of field (or that would start real work), left out
    FILE: {"file"},
    FOLDER: {"folder", "empty"},  # "" is "." for a folder flag: this folder, valid
    MODEL: set(),
    SCRIPT: {"file"},  # any regular file runs as a script
    OUTPUT: {"missing", "dangling link", "file"},  # a file about to be written, or one to overwrite
    PYTHON: {"empty"},  # --python "" is no --python: the default interpreter, which would install
    PROFILE: set(),
}
WHEELS = "wheels"  # an empty folder, so an accepted engine-env install would stop at once, offline

CLI_FLAGS: list[tuple[str, list[str], str]] = [
    ("run train --data", ["run", "train", "--model", "gpt2", "--data", "{P}", "--detach"], FILE),
    ("run train --plan", ["run", "train", "--model", "gpt2", "--data", "data.txt", "--plan", "{P}", "--detach"], FILE),
    ("run train --model", ["run", "train", "--model", "{P}", "--data", "data.txt", "--detach"], MODEL),
    ("run infer --prompts", ["run", "infer", "--model", "gpt2", "--prompts", "{P}", "--detach"], FILE),
    ("run infer --model", ["run", "infer", "--model", "{P}", "--prompt", "hello", "--detach"], MODEL),
    ("run infer --plan", ["run", "infer", "--model", "gpt2", "--prompt", "hi", "--plan", "{P}", "--detach"], FILE),
    ("run calibrate --plan", ["run", "calibrate", "--plan", "{P}", "--detach"], FILE),
    ("run calibrate --model", ["run", "calibrate", "--model", "{P}", "--detach"], MODEL),
    ("run script", ["run", "script", "--detach", "--", "{P}"], SCRIPT),
    ("scaling --model", ["scaling", "--model", "{P}", "--data", "data.txt", "--gpus", "1", "--detach"], MODEL),
    ("scaling --data", ["scaling", "--model", "gpt2", "--data", "{P}", "--gpus", "1", "--detach"], FILE),
    ("scaling --csv", ["scaling", "--model", "gpt2", "--data", "data.txt", "--gpus", "1", "--detach", "--csv", "{P}"],
     OUTPUT),
    ("nodes add --token-file", ["nodes", "add", "n1", "127.0.0.1:9", "--token-file", "{P}"], FILE),
    ("plan --model", ["plan", "--simulate", "4x-rtx4090", "--model", "{P}"], MODEL),
    ("plan --calibration", ["plan", "--simulate", "4x-rtx4090", "--model", "gpt2", "--calibration", "{P}"], FILE),
    ("plan --node-machine", ["plan", "--simulate", "4x-rtx4090", "--model", "gpt2", "--nodes", "2",
                             "--node-machine", "{P}"], FILE),
    ("plan --import", ["plan", "--import", "{P}", "--model", "gpt2"], FILE),
    ("gpus --import", ["gpus", "--import", "{P}"], FILE),
    ("topo --import", ["topo", "--import", "{P}"], FILE),
    ("engine-env install --wheel", ["engine-env", "install", "--offline", "--find-links", WHEELS, "--wheel", "{P}"], FILE),
    ("engine-env install --find-links", ["engine-env", "install", "--offline", "--find-links", "{P}"], FOLDER),
    ("engine-env install --python", ["engine-env", "install", "--offline", "--find-links", WHEELS, "--python", "{P}"],
     PYTHON),
    ("settings set simulated-profile", ["settings", "set", "simulated-profile", "{P}"], PROFILE),
]  # fmt: skip


def typed(kind: Kind, field: str) -> str:
    """The path as a user would type it for this field: models and interpreters need './' to read as local paths."""
    plain_name = kind.path and not kind.path.startswith(("/", "~", "."))
    if plain_name and (field == PYTHON or (field == MODEL and kind.name != "long name")):
        return "./" + kind.path  # a long bare model name stays bare: neither a local name nor a repo id
    return kind.path


def expected_words(kind: Kind, field: str) -> tuple[str, ...] | None:
    if field == PROFILE:
        return ("unknown simulated profile",)
    return kind.words


# -- running one case -----------------------------------------------------------------------------------------


class Watchdog:
    """Unblocks whatever blocked opening one of `fifos` (in this process or the engine), and says it had to."""

    def __init__(self, fifos: list[Path]):
        self.fifos = fifos
        self.fired = False
        self._stop = threading.Event()

    def __enter__(self) -> Watchdog:
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        if self._stop.wait(HANG_S):
            return
        self.fired = True
        while not self._stop.is_set():
            # Opened and closed at once: a blocked reader then reads end-of-file, a blocked writer gets EPIPE.
            for f in self.fifos:
                for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
                    with contextlib.suppress(OSError):  # O_WRONLY fails while nobody reads: nothing blocked there
                        os.close(os.open(f, flags))
            self._stop.wait(0.5)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Result:
    rc: int | None
    out: str
    err: str
    hung: bool
    crash: str | None


def run_cli(argv: list[str], capsys, fifos: list[Path]) -> Result:
    crash = None
    rc: int | None = None
    with Watchdog(fifos) as dog:
        try:
            rc = cli_main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
        except BaseException:  # what would reach the user as a traceback
            crash = traceback.format_exc()
    out, err = capsys.readouterr()
    return Result(rc, out, err, dog.fired, crash)


def refusal_problems(r: Result, words: tuple[str, ...] | None) -> list[str]:
    """What is wrong with a refusal: [] when it is one clean line."""
    text = r.out + r.err
    problems = []
    if r.hung:
        problems.append("hung (a FIFO was opened)")
    if r.crash:
        problems.append("traceback: " + r.crash.strip().splitlines()[-1])
    if "Traceback" in text or "hit a bug" in text:
        problems.append("bug: " + text.strip().splitlines()[-1][:200])
    if r.rc == 0:
        problems.append("accepted")
    elif r.rc != 2:
        problems.append(f"exit {r.rc}")
    lines = [line for line in r.err.splitlines() if not line.startswith("note: ")]
    if len(lines) != 1 or not lines[0].startswith("rigpilot: error: "):
        problems.append(f"not one error line: {r.err[:300]!r}")
    elif words and not any(w in lines[0] for w in words):
        problems.append(f"says {lines[0][:200]!r}, expected one of {words}")
    return problems


COUNTED: dict[str, int] = {}


def count(capsys, part: str, cases: int, detail: str) -> None:
    """Say how many cases a part ran, and the suite's total so far, in the test output (also without -s)."""
    COUNTED[part] = cases
    with capsys.disabled():
        print(f"\nbad-input suite: {part}: {cases} cases ({detail}); {sum(COUNTED.values())} in all so far")


# -- the engine ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[Engine, Path, list[Path]]]:
    """One engine for the whole module (on the simulated 4×RTX 4090) and the work folder of bad paths."""
    base = tmp_path_factory.mktemp("bad-input")
    with pytest.MonkeyPatch.context() as mp:
        engine_home(base, mp)
        mp.setenv("XDG_DATA_HOME", str(base / "data"))  # an engine-env install, if one slipped through, stays here
        w = base / "w"
        fifos = make_work_folder(w)
        mp.chdir(w)
        e = Engine(base)
        e.start()
        try:
            yield e, w, fifos
        finally:
            e.stop()
            for p in leftover_job_processes(base):
                p.kill()


def nothing_left(engine: Engine) -> None:
    with engine.client() as c:
        assert c.request("jobs")["jobs"] == []
        assert c.request("nodes")["nodes"] == []
        assert c.request("scaling_studies")["studies"] == []
    assert list(paths.jobs_dir().iterdir()) == []
    assert engine.proc is not None and engine.proc.poll() is None
    log = (engine.tmp / "engine.log").read_text(errors="replace")
    assert "Traceback" not in log and "bug while" not in log, log[-3000:]


# -- the tests -------------------------------------------------------------------------------------------------


def test_every_path_flag_refuses_every_bad_path_in_one_line(served, capsys):
    engine, _, fifos = served
    cases = failures = 0
    report: list[str] = []
    for label, template, field in CLI_FLAGS:
        for kind in kinds():
            if kind.name in SKIP[field]:
                continue
            argv = [a.replace("{P}", typed(kind, field)) for a in template]
            r = run_cli(argv, capsys, fifos)
            cases += 1
            problems = refusal_problems(r, expected_words(kind, field))
            if problems:
                failures += 1
                report.append(f"{label} <{kind.name}>: {'; '.join(problems)}")
    count(capsys, "CLI path flags", cases, f"{len(CLI_FLAGS)} flags × {len(kinds())} kinds of path, {failures} failed")
    assert not report, "\n".join(report)
    assert cases >= 300
    nothing_left(engine)


SOCKET_FIELDS: list[tuple[str, str, str]] = [
    # (label, request type, field kind); the request is built by socket_request
    ("submit spec.train.dataset", "submit", FILE),
    ("submit spec.model", "submit", MODEL),
    ("submit spec.script", "submit", SCRIPT),
    ("submit spec.infer.prompts_file", "submit", FILE),
    ("submit cwd", "submit", FOLDER),
    ("check spec.train.dataset", "check", FILE),
    ("check spec.model", "check", MODEL),
    ("check cwd", "check", FOLDER),
    ("plan model", "plan", MODEL),
    ("scaling_start model", "scaling_start", MODEL),
    ("scaling_start dataset", "scaling_start", FILE),
    ("scaling_start cwd", "scaling_start", FOLDER),
    ("reload_machine simulated_profile", "reload_machine", PROFILE),
]


def socket_request(label: str, rtype: str, p: str, w: Path) -> dict:
    data = str(w / "data.txt")
    train = {"kind": "train", "model": "gpt2", "train": {"dataset": [data], "max_steps": 1}}
    if label.endswith("spec.train.dataset"):
        return {"spec": {**train, "train": {"dataset": [p]}}, "cwd": str(w)}
    if label.endswith("spec.model"):
        return {"spec": {**train, "model": p}, "cwd": str(w)}
    if label.endswith("spec.script"):
        return {"spec": {"kind": "script", "script": [p]}, "cwd": str(w)}
    if label.endswith("prompts_file"):
        return {"spec": {"kind": "infer", "model": "gpt2", "infer": {"prompts_file": p}}, "cwd": str(w)}
    if label in ("submit cwd", "check cwd"):
        return {"spec": {"kind": "script", "script": [str(w / "data.txt")]}, "cwd": p}
    if rtype == "plan":
        return {"model": p, "deadline_s": 30}
    if label == "scaling_start model":
        return {"gpus": [1], "model": p, "dataset": [data], "steps": 4, "warmup": 1, "cwd": str(w)}
    if label == "scaling_start dataset":
        return {"gpus": [1], "model": "gpt2", "dataset": [p], "steps": 4, "warmup": 1, "cwd": str(w)}
    if label == "scaling_start cwd":
        return {"gpus": [1], "model": "gpt2", "dataset": ["data.txt"], "steps": 4, "warmup": 1, "cwd": p}
    return {"simulated_profile": p}


def absolute(kind: Kind, w: Path) -> str:
    """A socket client sends absolute paths where the engine has no folder of its own to resolve them in."""
    if kind.path and not kind.path.startswith(("/", "~")):
        return str(w / kind.path)
    return kind.path


def test_every_socket_path_field_answers_a_coded_error(served, capsys):
    engine, w, fifos = served
    cases = 0
    report: list[str] = []
    with engine.client() as c:
        for label, rtype, field in SOCKET_FIELDS:
            for kind in kinds():
                if kind.name in SKIP[field] or (field == FOLDER and kind.name == "empty"):
                    continue
                # A plan or a study's model is read by the engine's planner, in its own folder: absolute paths.
                relative_ok = rtype in ("submit", "check") and label != "submit cwd" and label != "check cwd"
                p = typed(kind, field) if relative_ok else absolute(kind, w)
                cases += 1
                with Watchdog(fifos) as dog:
                    try:
                        c.request(rtype, **socket_request(label, rtype, p, w))
                        error = None
                    except EngineError as e:
                        error = e
                what = f"{label} <{kind.name}>"
                if dog.fired:
                    report.append(f"{what}: hung (a FIFO was opened)")
                if error is None:
                    report.append(f"{what}: accepted")
                    continue
                if error.code == protocol.INTERNAL or "hit a bug" in str(error) or "\n" in str(error):
                    report.append(f"{what}: {error.code}: {str(error)[:200]}")
                elif field == PROFILE:  # a name, not a path: unknown, or longer than the protocol takes
                    if "unknown simulated profile" not in str(error) and error.code != protocol.INVALID:
                        report.append(f"{what}: {error.code}: {str(error)[:200]}")
                elif kind.problem == "path_too_long" and error.code == protocol.INVALID and "at most 4096" in str(error):
                    pass  # a request's path fields are bounded by the protocol itself, before any check
                elif kind.problem is not None and (error.code, error.fields.get("problem")) != ("bad_path", kind.problem):
                    report.append(f"{what}: {error.code} {error.fields} {str(error)[:160]}, expected bad_path {kind.problem}")
                elif error.code not in ("bad_path", "user_error", "invalid"):
                    report.append(f"{what}: {error.code}: {str(error)[:200]}")
    count(capsys, "socket path fields", cases, f"{len(SOCKET_FIELDS)} fields, {len(report)} failed")
    assert not report, "\n".join(report)
    assert cases >= 150
    nothing_left(engine)


def test_a_members_request_names_no_folder_outside_its_own_and_opens_no_fifo(served, capsys):
    """A head engine's `submit_member` names the job (a folder here) and folders to check: none may escape."""
    engine, w, fifos = served
    spec = {"kind": "script", "script": [str(w / "data.txt")], "gpus": [0]}
    report = []
    with engine.client() as c:
        ranks = c.request("check", spec=spec)["would_run"]["ranks"]
        nodes = {"role": "member", "count": 2, "endpoint": "127.0.0.1:29500", "local_addr": "127.0.0.1",
                 "node": "box2", "head": "box1", "checkpoints": str(w / "folder"), "output": str(w / "folder"),
                 "ranks_per_node": ranks}  # fmt: skip
        cases = [(f"job {job[:12]!r}", job, nodes, "is not a job id")
                 for job in ("../escape", "/", "..", "a" * 300, "A-B", "x/y", "")]
        cases += [(f"{key} {name[:12]!r}", "abc123", {**nodes, key: str(w / name)}, f"cannot see the job's {key} folder")
                  for key in ("checkpoints", "output") for name in ("fifo", "link-to-fifo", "n" * 256, "loop")]  # fmt: skip
        cases += [(f"shared marker {name[:12]!r}", "abc123", {**nodes, "shared_marker": {"path": str(w / name), "nonce": "n"}},
                   "does not see the shared folder") for name in ("fifo", "link-to-fifo", "sock", "n" * 256, "a\x00b")]  # fmt: skip
        for rtype in ("check_member", "submit_member"):
            for label, job, facts, words in cases:
                with Watchdog(fifos) as dog:
                    try:
                        c.request(rtype, job=job, spec=spec, nodes=facts)
                        error = None
                    except EngineError as e:
                        error = e
                refused_well = error is not None and (error.code == "invalid" or (
                    error.code == "user_error" and words in str(error)))  # fmt: skip
                if dog.fired or not refused_well:
                    report.append(f"{rtype} {label}: {'hung; ' if dog.fired else ''}{error and error.code}: {error}")
    count(capsys, "a head's member requests", 2 * len(cases), f"{len(report)} failed")
    assert not report, "\n".join(report)
    assert not (paths.jobs_dir().parent / "escape").exists()
    nothing_left(engine)


# Run as the `rigpilot` program: a traceback on stderr, an exit code, a hang are what a user sees.
PROGRAM_CASES = [
    ["plan", "--simulate", "4x-rtx4090", "--model", "m" * 300],
    ["plan", "--simulate", "4x-rtx4090", "--model", "./fifo"],
    ["settings", "set", "simulated-profile", "p" * 300],
    ["run", "train", "--model", "gpt2", "--data", "link-to-fifo", "--detach"],
    ["run", "train", "--model", "gpt2", "--data", "data.txt", "--plan", "fifo", "--detach"],
    ["nodes", "add", "n1", "127.0.0.1:9", "--token-file", "fifo"],
    ["run", "script", "--detach", "--", "s" * 256 + ".py"],
    ["scaling", "--model", "gpt2", "--data", "é" * 200, "--gpus", "1", "--detach"],
]


def test_the_program_itself_prints_one_line_and_never_hangs(served, capsys):
    engine, w, fifos = served
    report = []
    for argv in PROGRAM_CASES:
        with Watchdog(fifos) as dog:
            r = subprocess.run([sys.executable, "-m", "rigpilot.engine.cli", *argv], cwd=w, capture_output=True,
                               text=True, timeout=120)  # fmt: skip
        problems = refusal_problems(Result(r.returncode, r.stdout, r.stderr, dog.fired, None), None)
        if problems:
            report.append(f"{argv[:4]}: {'; '.join(problems)}")
    count(capsys, "the rigpilot program", len(PROGRAM_CASES), f"{len(report)} failed")
    assert not report, "\n".join(report)
    nothing_left(engine)


# -- secrets and weird-but-valid input: accepted, then run to the end -----------------------------------------

SECRETS = {  # name: (value, as job.json must show it, the part that must be nowhere on disk)
    "DATABASE_URL": ("postgres://u:PASS-1@db.example/app", f"postgres://u:{MASK}@db.example/app", "PASS-1"),
    "MY_PW": ("pw-2", MASK, "pw-2"),
    "DB_PASS": ("pass-3", MASK, "pass-3"),
    "GCP_CREDENTIALS": ("cred-4", MASK, "cred-4"),
    "PROXY_AUTH": ("auth-5", MASK, "auth-5"),
    "SSHPASS": ("ssh-6", MASK, "ssh-6"),
    "dbPassword": ("camel-7", MASK, "camel-7"),
    "REPO_URL": ("https://ghp_abcdefghijklmnopqrst@github.com/o/r.git", f"https://{MASK}@github.com/o/r.git",
                 "ghp_abcdefghijklmnopqrst"),
    "API_ENDPOINT": ("https://api.example/v1?key=k-8&region=eu", f"https://api.example/v1?key={MASK}&region=eu", "k-8"),
    "PLAIN_SETTING": ("1", "1", None),
}
NEW_DSN = "postgres://u:NEW-9@db.example/app"

EDGE_SCRIPT = """
import hashlib, json, os, sys
from rigpilot import report
want = json.loads(open(sys.argv[1], encoding="utf-8").read())
got = {k: hashlib.sha256(os.environ.get(k, "").encode()).hexdigest() for k in want}
data = open(sys.argv[2], encoding="utf-8").read()
run = int(os.environ["RIGPILOT_RUN"])
ok = got == want and data.startswith("to be")
report(step=run, secrets_ok=ok)
print("edge run", run, "ok" if ok else f"MISMATCH {sorted(k for k in want if got[k] != want[k])}", flush=True)
sys.exit(0 if ok and run >= int(sys.argv[3]) else 3)
"""


def _hashes(env: dict[str, str]) -> dict[str, str]:
    return {k: hashlib.sha256(v.encode()).hexdigest() for k, v in env.items()}


def test_valid_edge_input_is_accepted_and_runs_and_no_secret_reaches_job_json(served, capsys):
    engine, w, fifos = served
    # A script whose name is exactly NAME_MAX bytes, in a folder with spaces and non-ASCII letters, reading its
    # data through a symlink, its arguments through a path close to PATH_MAX.
    folder = w / "my scripts — ünïcode"
    folder.mkdir()
    script = folder / ("é" * 126 + ".py")
    assert len(os.fsencode(script.name)) == 255
    script.write_text(EDGE_SCRIPT)
    (w / "data-link.txt").symlink_to(w / "data.txt")
    deep = w.joinpath(*["d" * 200] * ((4000 - len(str(w))) // 201))
    deep.mkdir(parents=True)
    want_file = deep / "want.json"
    assert 3800 < len(os.fsencode(want_file)) < 4096
    env = {k: v for k, (v, _, _) in SECRETS.items()}
    want_file.write_text(json.dumps(_hashes(env)))
    env_flags = [x for k, v in env.items() for x in ("--env", f"{k}={v}")]

    # Accepted only on its second run: the first fails, and `resume --env` gives a new value under the same rule.
    argv = ["run", "script", "--gpus", "0", "--detach", "--name", "edge", *env_flags, "--",
            str(script.relative_to(w)), str(want_file), "data-link.txt", "2"]  # fmt: skip
    r = run_cli(argv, capsys, fifos)
    assert r.rc == 0 and not r.hung and r.crash is None, r
    job_id = r.out.split()[1]
    with engine.client() as c:
        first = engine.wait_state(c, job_id, "failed", "completed", timeout=120)
        assert first["state"] == "failed", first
        job_json = json.loads((Path(first["job_dir"]) / "job.json").read_text())
        assert job_json["env"] == {k: shown for k, (_, shown, _) in SECRETS.items()}
        want_file.write_text(json.dumps(_hashes({**env, "DATABASE_URL": NEW_DSN})))
        r = run_cli(["resume", job_id, "--detach", "--env", f"DATABASE_URL={NEW_DSN}"], capsys, fifos)
        assert r.rc == 0 and "queued again" in r.out, r
        done = engine.wait_state(c, job_id, "failed", "completed", timeout=120)
        log = (Path(done["job_dir"]) / "logs" / "rank0.log").read_text()
        assert done["state"] == "completed", (done["exit_reason"], log[-2000:])
        assert "edge run 1 ok" in log and "edge run 2 ok" in log  # the ranks had every real value, both runs
        job_dir = Path(done["job_dir"])
        # Nowhere on disk: not in the job's folder (job.json, logs, metrics), the engine's database or its log.
        on_disk = b"".join(p.read_bytes() for p in (engine.tmp / "state").rglob("*") if p.is_file())
        on_disk += (engine.tmp / "engine.log").read_bytes()
        for name, (_, _, secret) in SECRETS.items():
            assert secret is None or secret.encode() not in on_disk, name
        assert b"NEW-9" not in on_disk
        assert json.loads((job_dir / "job.json").read_text())["env"]["DATABASE_URL"] == f"postgres://u:{MASK}@db.example/app"
        assert "--env expects NAME=VALUE, not '••••'" in _refused_env(capsys, fifos)

        # Training and inference input at the edges, through the whole submission path (--check: nothing starts).
        long_data = w / ("é" * 127 + "a")  # 255 bytes
        long_data.write_text("to be or not to be\n")
        (w / "prompts\nwith newline.jsonl").write_text('{"prompt": "hi"}\n')
        tiny = REPO / "examples" / "models" / "tiny-llama"
        accepted = [
            ["run", "train", "--model", str(tiny), "--data", long_data.name, "--data", "data-link.txt", "--check"],
            ["run", "train", "--model", str(tiny / "config.json"), "--method", "scratch", "--data", "data.txt", "--check"],
            ["run", "infer", "--model", str(tiny), "--prompts", "prompts\nwith newline.jsonl", "--check"],
        ]  # fmt: skip
        for argv in accepted:
            r = run_cli(argv, capsys, fifos)
            assert r.rc == 0 and r.out.startswith("would run:") and not r.hung and r.crash is None, (argv, r)
        c.request("delete", job=job_id)
    count(capsys, "accepted, then run", 1 + 1 + 1 + len(accepted), "a job with secrets and edge paths, its resume "
          "with --env, a refused --env, checks of edge paths")  # fmt: skip
    nothing_left(engine)


def _refused_env(capsys, fifos) -> str:
    r = run_cli(["run", "script", "--env", "hf_abcdefghijklmnopqrstu", "--", "x.py"], capsys, fifos)
    assert r.rc == 2 and "hf_abc" not in r.err, r
    return r.err
