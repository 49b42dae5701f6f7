"""The engine service end to end: a real service process, real torchrun jobs with CPU ranks.

Each test runs its own service in a subprocess with XDG_RUNTIME_DIR,
XDG_STATE_HOME and XDG_CONFIG_HOME inside tmp_path, on a simulated 4×RTX 4090.
Jobs are small scripts written here; most wait on a "gate" file so the test
decides when they end.
"""

import json
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rigpilot.engine import paths
from rigpilot.engine.api import protocol
from rigpilot.engine.api.client import EngineClient, EngineError
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.jobs.processes import job_processes

from support.engine import (
    CRASH_SCRIPT,
    GATE_SCRIPT,
    OOM_SCRIPT,
    QUICK_SCRIPT,
    Engine,
    gate,
    leftover_job_processes,
    raw_exchange,
)
from support.paths import REPO
from support.waiting import wait_for

GIB = 2**30


STUBBORN_SCRIPT = """
import signal, time
from rigpilot import report
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker that never checkpoints: SIGKILL must follow
step = 0
while True:
    report(step=step)
    step += 1
    time.sleep(0.1)
"""


# -- the socket -----------------------------------------------------------------------


def test_socket_is_private_and_bad_messages_get_error_replies(engine):
    engine.start("--tcp", "127.0.0.1:0")
    sock_path = paths.socket_path()
    assert stat.S_IMODE(sock_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock_path.parent.stat().st_mode) == 0o700

    s = socket.socket(socket.AF_UNIX)
    s.connect(str(sock_path))
    s.settimeout(10)
    assert raw_exchange(s, b"\xff\xfe\x00garbage\n")["error"]["code"] == protocol.BAD_MESSAGE
    assert raw_exchange(s, b'{"v": 1, "id": 2, "type": \n')["error"]["code"] == protocol.BAD_MESSAGE
    r = raw_exchange(s, b'{"v": 1, "id": 3, "type": "format_disk"}\n')
    assert (r["id"], r["error"]["code"]) == (3, protocol.UNKNOWN_TYPE)
    r = raw_exchange(s, b'{"v": 1, "id": 4, "type": "job", "args": {"job": 7}}\n')
    assert r["error"]["code"] == protocol.INVALID and "expected a string" in r["error"]["message"]
    assert raw_exchange(s, b'{"v": 9, "id": 5, "type": "jobs"}\n')["error"]["code"] == protocol.UNSUPPORTED_VERSION
    r = raw_exchange(s, b'{"v": 1, "id": 6, "type": "job", "args": {"job": "nope"}}\n')
    assert r["error"]["code"] == protocol.NOT_FOUND
    assert raw_exchange(s, b'{"v": 1, "id": 7, "type": "hello"}\n')["ok"]  # still the same connection
    # Oversized: an error reply, then the connection ends (the rest of the line cannot be skipped safely).
    s.sendall(b'{"v": 1, "id": 8, "type": "jobs", "pad": "' + b"x" * (protocol.MAX_MESSAGE_BYTES + 100))
    assert json.loads(s.makefile("rb").readline())["error"]["code"] == protocol.TOO_LARGE
    s.close()

    with engine.client() as c:  # the service shrugged it all off
        hello = c.request("hello")
        assert hello["protocol"] == 1 and hello["machine"] == "simulated: 4×RTX 4090"
        assert len(c.request("machine")["machine"]["gpus"]) == 4
        assert c.request("topology")["matrix"]["gpus"] == [0, 1, 2, 3]
        assert c.request("jobs")["jobs"] == []
        host, port = hello["tcp"]
        with pytest.raises(EngineError) as e:
            c.request("plan", model="gpt2", workload={"seq_len": "long"})
        assert e.value.code == protocol.INVALID and "plan.workload.seq_len" in str(e.value)
        plan = c.request("plan", model="qwen2.5-0.5b", workload={"seq_len": 512, "global_batch": 8}, gpus=[0, 1])
        assert plan["result"]["best"]["parallelism"]["gpu_indices"] == [0, 1]

    # TCP: nothing in plain text (tests/engine/test_service_tls.py has the rest), nothing without the token, everything with it.
    t = socket.create_connection((host, port), timeout=10)
    assert raw_exchange(t, protocol.encode(protocol.request(1, "jobs")))["error"]["code"] == protocol.TLS_REQUIRED
    assert t.recv(10) == b""  # and then it hangs up
    t.close()
    with EngineClient(tcp=f"{host}:{port}", timeout=10) as remote:
        assert remote.request("jobs")["jobs"] == []
    with pytest.raises(EngineError, match="token"):
        EngineClient(tcp=f"{host}:{port}", token="wrong").connect()
    assert stat.S_IMODE(paths.token_path().stat().st_mode) == 0o600


def planner_processes(engine: Engine) -> list[psutil.Process]:
    return [c for c in psutil.Process(engine.proc.pid).children() if "rigpilot.engine.service.planworker" in c.cmdline()]


def engine_log_tracebacks(engine: Engine) -> int:
    return (engine.tmp / "engine.log").read_text(errors="replace").count("Traceback")


def test_a_plan_past_its_deadline_answers_timeout_and_an_abandoned_one_stops(engine):
    engine.start()
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(paths.socket_path()))
    s.settimeout(30)
    # The first plan starts a planner process (imports alone take longer than 0.1 s): past its deadline.
    r = raw_exchange(s, protocol.encode(protocol.request(1, "plan", model="llama-2-7b", deadline_s=0.1)))
    assert (r["id"], r["error"]["code"]) == (1, protocol.TIMEOUT)
    assert planner_processes(engine) == []  # killed, not left searching
    # 2^63 sequences made the search spin for 25+ minutes; now it ends by its deadline (or is refused).
    t0 = time.monotonic()
    r = raw_exchange(s, protocol.encode(protocol.request(
        2, "plan", model="llama-2-7b", workload={"global_batch": 2**63}, deadline_s=3
    )))  # fmt: skip
    assert r["error"]["code"] in (protocol.TIMEOUT, protocol.INVALID, protocol.USER_ERROR)
    assert time.monotonic() - t0 < 10
    r = raw_exchange(s, protocol.encode(protocol.request(3, "plan", model="qwen2.5-0.5b", workload={"global_batch": 8})))
    assert r["ok"] and r["result"]["result"]["best"] is not None  # the service and its planner are fine
    # A client that leaves takes its search with it.
    s.sendall(protocol.encode(protocol.request(4, "plan", model="llama-2-7b", workload={"global_batch": 2**63})))
    time.sleep(0.5)
    s.close()

    def planners_idle():
        try:
            procs = planner_processes(engine)
            before = [p.cpu_times().user + p.cpu_times().system for p in procs]
            time.sleep(1.0)
            return all(p.cpu_times().user + p.cpu_times().system - b < 0.3 for p, b in zip(procs, before, strict=True))
        except psutil.NoSuchProcess:
            return False  # one was being killed: look again

    wait_for(planners_idle, 15, what="the abandoned search to stop")
    assert engine_log_tracebacks(engine) == 0


def test_malformed_frames_and_extreme_values_get_one_line_replies(engine):
    engine.start()
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(paths.socket_path()))
    s.settimeout(30)
    for frame in (b"[" * 5000 + b"]" * 5000, b'{"a": ' + b"[" * 999 + b"]" * 999 + b"}",
                  b'{"v": 1, "id": "\\ud800", "type": "jobs"}', b'{"v": 1, "id": 1, "type": "jobs", "args": "\\udfff"}'):  # fmt: skip
        r = raw_exchange(s, frame + b"\n")
        assert r["error"]["code"] == protocol.BAD_MESSAGE, r
    paired = raw_exchange(s, b'{"v": 1, "id": "\\ud83d\\ude00", "type": "jobs"}\n')  # a real emoji, escaped
    assert paired["ok"] and paired["id"] == "\U0001f600"
    cases = [
        ("jobs", {"limit": 10**30}, "jobs.limit"),
        ("jobs", {"limit": -1}, "jobs.limit"),
        ("metrics", {"job": "x", "since_cursor": {"0": -1}}, "metrics.since_cursor"),
        ("subscribe", {"topics": ["jobs"], "metrics_cursors": {"x": {"0": -5}}}, "subscribe.metrics_cursors"),
        ("logs", {"job": "x", "since_offset": 10**30}, "logs.since_offset"),
        ("logs", {"job": "x", "max_bytes": 2**63}, "logs.max_bytes"),
        ("plan", {"model": "m" * 100_000}, "plan.model"),
        ("job", {"job": "j" * 100_000}, "job.job"),
        ("telemetry_history", {"limit": 2**64}, "telemetry_history.limit"),
    ]
    for i, (rtype, args, field) in enumerate(cases):
        r = raw_exchange(s, protocol.encode(protocol.request(i, rtype, **args)))
        assert (r["id"], r["error"]["code"]) == (i, protocol.INVALID), r
        message = r["error"]["message"]
        assert message.startswith(field) and "\n" not in message and len(message) < 200, message
    # A path the file system refuses (a component over NAME_MAX) is refused by name, not as an OSError.
    r = raw_exchange(s, protocol.encode(protocol.request(99, "plan", model="/tmp/" + "m" * 300)))
    assert r["error"]["code"] == protocol.BAD_PATH and r["error"]["problem"] == "name_too_long", r
    assert "at most 255 bytes" in r["error"]["message"]
    assert raw_exchange(s, protocol.encode(protocol.request(100, "hello")))["ok"]  # the same connection goes on
    s.close()
    assert engine_log_tracebacks(engine) == 0


def test_connections_are_capped_tcp_logins_time_out_and_a_client_that_does_not_read_is_held(engine):
    engine.start("--tcp", "127.0.0.1:0")
    with engine.client() as c:
        host, port = c.request("hello")["tcp"]
    proc = psutil.Process(engine.proc.pid)
    # Over the cap: a `busy` line, then the connection is closed; those within it are all served.
    socks = []
    for _ in range(256):
        socks.append(socket.socket(socket.AF_UNIX))
        socks[-1].connect(str(paths.socket_path()))
    extra = socket.socket(socket.AF_UNIX)
    extra.connect(str(paths.socket_path()))
    extra.settimeout(10)
    refusal = json.loads(extra.makefile("rb").readline())
    assert refusal["error"]["code"] == protocol.BUSY and "limit" in refusal["error"]["message"]
    assert proc.num_threads() < 2 * 256 + 40
    for s in socks[:5]:
        s.settimeout(10)
        assert raw_exchange(s, protocol.encode(protocol.request(1, "hello")))["ok"]
    for s in socks:
        s.close()
    extra.close()
    wait_for(lambda: proc.num_threads() < 40, 10, what="the closed connections' threads to end")

    # TCP without a login is closed after the login timeout (10 s), saying why and naming no path.
    t = socket.create_connection((host, port), timeout=20)
    t0 = time.monotonic()
    line = t.makefile("rb").readline()
    assert time.monotonic() - t0 > 9  # not before the login timeout; how late depends on the machine's load
    assert json.loads(line)["error"]["code"] == protocol.UNAUTHORIZED and b"/" not in line
    assert t.recv(10) == b""
    t.close()

    # Pipelining without reading: the service stops reading this client instead of queueing without end.
    rss = proc.memory_info().rss
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(paths.socket_path()))
    s.setblocking(False)
    sent, frame = 0, protocol.encode(protocol.request(7, "topology"))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            s.send(frame)
            sent += 1
        except BlockingIOError:
            time.sleep(0.05)
    assert sent < 20_000, "the service kept reading requests whose replies were not read"
    assert proc.memory_info().rss - rss < 32 * 2**20
    s.setblocking(True)
    s.settimeout(10)
    f = s.makefile("rb")
    assert all(json.loads(f.readline())["ok"] for _ in range(sent))  # every request is answered once read
    s.close()
    assert engine_log_tracebacks(engine) == 0


def test_clients_start_the_service_and_replace_a_stale_socket(engine):
    stale = paths.socket_path()
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))  # left behind by a service that was killed
    s.close()
    with EngineClient(timeout=10) as c:  # autostart
        pid = c.hello["pid"]
        assert psutil.pid_exists(pid)
        # A second service refuses to run beside the first (one per user).
        second = subprocess.run([sys.executable, "-m", "rigpilot.engine.service"], cwd=REPO, capture_output=True, text=True,
                                timeout=60)  # fmt: skip
        assert second.returncode == 2 and "already running" in second.stderr
        quiet = subprocess.run([sys.executable, "-m", "rigpilot.engine.service", "--background"], cwd=REPO, timeout=60)
        assert quiet.returncode == 0
        c.request("shutdown")
    # Clients that come while the service stops (it may still greet them, then hang up) get the next one.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        with EngineClient(timeout=10) as c:
            assert c.request("jobs")["jobs"] == []
            last = c.hello["pid"]
    assert last != pid
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 15,
             what="the first service to stop")  # fmt: skip
    with EngineClient(timeout=10) as c:
        c.request("shutdown")
    pid = last
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 15,
             what="the service to stop")  # fmt: skip
    assert not stale.exists()


# -- jobs ------------------------------------------------------------------------------


def test_script_job_runs_to_completion_with_metrics_logs_and_telemetry_load(engine):
    engine.start()
    script = engine.script("gate.py", GATE_SCRIPT)
    with engine.client() as watcher, engine.client() as c:
        watcher.request("subscribe", topics=["jobs", "telemetry"])
        job = engine.submit(c, script, str(gate(engine, "a")), gpus=[1, 2], name="demo")
        assert (job["state"], job["ranks"], job["simulated"]) == ("queued", 2, True)
        engine.wait_state(c, job["id"], "running")

        states: list[str] = []

        def next_event() -> dict | None:
            ev = watcher.next_event(1.0)
            if ev and ev["event"] == "job" and ev["job"]["id"] == job["id"] and ev["job"]["state"] not in states[-1:]:
                states.append(ev["job"]["state"])
            return ev

        def loaded() -> bool:
            ev = next_event()
            if not ev or ev["event"] != "telemetry":
                return False
            g = {x["index"]: x for x in ev["sample"]["gpus"]}
            busy = all(g[i]["gpu_util"] > 60 and g[i]["memory_used"] > 3 * GIB for i in (1, 2))
            return busy and g[0]["gpu_util"] < 10 and g[3]["memory_used"] < GIB

        wait_for(loaded, 20, 0, "the simulated GPUs 1 and 2 to show the job")
        gate(engine, "a").touch()
        done = engine.wait_state(c, job["id"], "completed", "failed")
        assert done["state"] == "completed", done
        # Telemetry keeps coming, so read until the job's last event rather than until silence.
        wait_for(lambda: next_event() and "completed" in states, 20, 0, "the job events")
        assert states == ["queued", "starting", "running", "completed"]
        progress = done["progress"]
        assert progress["peak_memory_by_rank"] == {"0": 3 * GIB, "1": 4 * GIB}
        # Each of the 2 ranks reports 1000 tokens/s of its own: the job's rate is their sum.
        assert progress["loss"] == 0.01 and progress["tokens_per_s"] == 2000.0

        logs = c.request("logs", job=job["id"], rank=1)
        assert "rank 1 of 2 starts (run 1)" in logs["text"] and "rank 1 done" in logs["text"]
        assert Path(logs["path"]).name == "rank1.log"
        history = c.request("telemetry_history", since=0)
        assert len(history["samples"]) >= 3

    # A client that connects afterwards gets the whole metric history, pushed and polled alike.
    metrics_dir = Path(done["job_dir"]) / "metrics"
    lines = sum(len(f.read_text().splitlines()) for f in metrics_dir.glob("rank*.jsonl"))
    with engine.client() as late:
        polled = late.request("metrics", job=job["id"])
        assert len(polled["records"]) == lines and not polled["more"]
        late.request("subscribe", topics=[f"metrics:{job['id']}"])
        pushed = []
        while (ev := late.next_event(1.0)) is not None:
            pushed += ev["records"]
        assert pushed == polled["records"]
        # The service never loads torch: only the ranks do.
        maps = Path(f"/proc/{late.hello['pid']}/maps").read_text()
        assert "libtorch" not in maps

    # Telemetry history is on disk: a restarted service still has the curve.
    engine.stop()
    engine.start()
    with engine.client() as c:
        assert len(c.request("telemetry_history", since=0)["samples"]) >= len(history["samples"])
        assert c.request("jobs")["jobs"][0]["state"] == "completed"


def test_crashing_rank_fails_the_job_within_seconds_naming_the_rank(engine):
    engine.start()
    script = engine.script("crash.py", CRASH_SCRIPT)
    with engine.client() as c:
        job = engine.submit(c, script, gpus=[0, 3])
        done = engine.wait_state(c, job["id"], "failed", "completed", "cancelled")
        assert done["state"] == "failed" and done["failed_rank"] == 1
        assert done["exit_reason"] == "rank 1 exited with code 1"
        assert any("boom on rank 1" in line for line in done["last_log"])
        ranks = {int(f.stem[4:]): json.loads(f.read_text()) for f in (Path(done["job_dir"]) / "ranks").glob("*.json")}
        crashed_at = ranks[1]["exit"]["time"]
        assert done["ended"] - crashed_at < 5.0, "teardown took too long"
        assert not leftover_job_processes(engine.tmp)
        assert c.request("logs", job=job["id"])["rank"] == 1  # logs default to the rank that failed


def test_script_job_imports_its_own_engine_app_and_resources_not_rigpilots(engine, tmp_path):
    """Research code often has its own engine.py (DETR), app.py or resources/: a script job imports those,
    and Rigpilot only as `rigpilot`, from the worker's environment (nothing of ours on PYTHONPATH)."""
    engine.start()
    project = tmp_path / "my-research"
    (project / "resources").mkdir(parents=True)
    (project / "engine.py").write_text("def train_one_epoch():\n    return 0.25\n")
    (project / "app.py").write_text("NAME = 'my app'\n")
    (project / "resources" / "__init__.py").write_text("WEIGHTS = 'mine'\n")
    (project / "main.py").write_text(
        "import os, engine, app, resources\n"
        "from rigpilot import report\n"
        "assert not any('rigpilot' in p or 'site-packages' in p for p in os.environ.get('PYTHONPATH', '').split(':') if p), os.environ['PYTHONPATH']\n"
        "print('imports', engine.__file__, app.NAME, resources.WEIGHTS, flush=True)\n"
        "report(step=1, loss=engine.train_one_epoch())\n"
    )
    with engine.client() as c:
        spec = {"kind": "script", "script": [str(project / "main.py")], "gpus": [0]}
        job = c.request("submit", spec=spec, cwd=str(project))["job"]
        done = engine.wait_state(c, job["id"], "completed", "failed")
        log = c.request("logs", job=job["id"], rank=0)["text"]
        assert done["state"] == "completed", (done.get("exit_reason"), log)
        assert f"imports {project / 'engine.py'} my app mine" in log
        assert [r["loss"] for r in c.request("metrics", job=job["id"])["records"] if "loss" in r] == [0.25]


def test_out_of_memory_is_reported_with_the_plans_prediction(engine):
    engine.start()
    script = engine.script("oom.py", OOM_SCRIPT)
    plan = {"parallelism": {"gpu_indices": [0], "dp": 1, "tp": 1, "pp": 1, "checkpointing": "none"},
            "memory": [{"gpu": 0, "total": 18 * GIB}], "timing": {"step_s": 1.0, "tokens_per_s": 500.0}}  # fmt: skip
    with engine.client() as c:
        spec = {"kind": "script", "script": [script], "gpus": [0]}
        job = c.request("submit", spec=spec, plan=plan)["job"]
        assert (Path(job["job_dir"]) / "plan.json").is_file()
        done = engine.wait_state(c, job["id"], "failed", "completed")
    assert done["state"] == "failed" and done["failed_rank"] == 0
    reason = done["exit_reason"]
    assert reason.startswith("out of memory on rank 0") and "allocated 22.00 GiB" in reason
    assert "the plan predicted a peak of 18.00 GiB" in reason and "activation checkpointing" in reason
    assert done["error"]["predicted"]["peak_memory_bytes"] == 18 * GIB
    assert done["comparison"]["peak_memory_bytes"] == {"predicted": 18 * GIB, "measured": 20 * GIB}
    assert any("out of memory" in line for line in done["last_log"])


def test_cancel_kills_every_process_after_the_grace_period(engine):
    engine.start()
    script = engine.script("stubborn.py", STUBBORN_SCRIPT)
    with engine.client() as c:
        job = engine.submit(c, script, gpus=[2, 3])
        # A reported step means both ranks got past installing their SIGTERM handler.
        wait_for(lambda: {r["rank"] for r in c.request("metrics", job=job["id"])["records"]} == {0, 1}, 60,
                 what="both ranks to report")  # fmt: skip
        job_dir = Path(job["job_dir"])
        token = f"{job['id']}:1"
        assert job_processes(token), "the job's processes carry the run marker"
        t0 = time.monotonic()
        assert c.request("cancel", job=job["id"])["job"]["cancel_requested"]
        done = engine.wait_state(c, job["id"], "cancelled", "failed", "completed", timeout=30)
        assert done["state"] == "cancelled" and "killed after the grace period" in done["exit_reason"]
        assert 2.5 < time.monotonic() - t0 < 15
        assert job_processes(token) == []
        for f in (job_dir / "ranks").glob("*.json"):
            state = json.loads(f.read_text())
            assert not psutil.pid_exists(state["pid"]) or psutil.Process(state["pid"]).status() == "zombie"
        with pytest.raises(EngineError, match="already ended"):
            c.request("cancel", job=job["id"])


def test_queue_restart_and_readoption(engine):
    """Disjoint jobs run together; a job on busy GPUs queues, survives a SIGKILLed service, runs after."""
    engine.start()
    gate_script = engine.script("gate.py", GATE_SCRIPT)
    quick = engine.script("quick.py", QUICK_SCRIPT)
    with engine.client() as c:
        a = engine.submit(c, gate_script, str(gate(engine, "a")), gpus=[0], name="a")
        b = engine.submit(c, gate_script, str(gate(engine, "b")), gpus=[1], name="b")
        jobs_c = engine.submit(c, quick, gpus=[0], name="c")
        wait_for(lambda: all(engine.job(c, j["id"])["state"] == "running" for j in (a, b)), 60,
                 what="a and b to run side by side")  # fmt: skip
        queued = engine.job(c, jobs_c["id"])
        assert queued["state"] == "queued" and queued["waiting_for"] == [0]

    engine.kill()  # SIGKILL: no chance to clean up; the socket file stays behind
    assert paths.socket_path().exists()
    engine.start()
    with engine.client() as c:
        states = {j["name"]: j["state"] for j in c.request("jobs")["jobs"]}
        assert states == {"a": "running", "b": "running", "c": "queued"}  # re-adopted, and the queue survived
        gate(engine, "a").touch()
        done_a = engine.wait_state(c, a["id"], "completed", "failed")
        assert done_a["state"] == "completed", done_a  # judged from the ranks' exit records
        done_c = engine.wait_state(c, jobs_c["id"], "completed", "failed")
        assert done_c["state"] == "completed" and done_c["started"] >= done_a["ended"] - 0.5
        assert engine.job(c, b["id"])["state"] == "running"
        gate(engine, "b").touch()
        assert engine.wait_state(c, b["id"], "completed", "failed")["state"] == "completed"


def test_job_whose_processes_died_with_the_service_is_interrupted_then_resumes(engine, capsys):
    engine.start()
    script = engine.script("gate.py", GATE_SCRIPT)
    with engine.client() as c:
        job = engine.submit(c, script, str(gate(engine, "d")), gpus=[3], name="d")
        running = engine.wait_state(c, job["id"], "running")
    # "running" can come before the script has printed its first line; the log must show run 1 first.
    first_log = Path(running["job_dir"]) / "logs" / "rank0.log"
    wait_for(lambda: first_log.exists() and "(run 1)" in first_log.read_text(), 20, what="run 1's first log line")
    engine.kill()
    for p in job_processes(f"{job['id']}:1"):
        p.kill()
    wait_for(lambda: not job_processes(f"{job['id']}:1"), 10, what="the job's processes to die")
    engine.start()
    with engine.client() as c:
        interrupted = engine.job(c, job["id"])
        assert interrupted["state"] == "interrupted" and interrupted["resumable"]

    gate(engine, "d").touch()
    assert cli_main(["resume", job["id"][:4]]) == 0  # follows the job until it ends
    out = capsys.readouterr().out
    assert "queued again (run 2" in out and "completed" in out
    job_dir = Path(interrupted["job_dir"])
    assert json.loads((job_dir / "job.json").read_text())["resume"] is True
    log = (job_dir / "logs" / "rank0.log").read_text()
    assert "(run 1)" in log and "(run 2)" in log


def test_cli_refuses_bad_input_and_leaves_nothing_behind(engine, capsys, tmp_path, monkeypatch):
    engine.start()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "data.txt").write_text("hello world\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama",')
    (tmp_path / "quick.py").write_text(QUICK_SCRIPT)
    cases = [
        (["run", "train", "--model", "gpt2", "--data", "missing.txt"], "does not exist"),
        (["run", "train", "--model", "gpt2", "--data", "empty.txt"], "is empty"),
        (["run", "train", "--model", "gpt2"], "needs a dataset"),
        (["run", "train", "--model", "./broken", "--data", "data.txt"], "not valid JSON"),
        (["run", "script", "--gpus", "4", "--", "quick.py"], "GPU 4 does not exist"),
        (["run", "script"], "which script"),
        (["logs", "nosuchjob"], "no job 'nosuchjob'"),
        (["cancel", "nosuchjob"], "no job"),
        (["metrics", "nosuchjob"], "no job"),
    ]
    for argv, message in cases:
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("rigpilot: error: ") and message in err and err.count("\n") == 1, err
    jobs_dir = paths.jobs_dir()
    assert list(jobs_dir.iterdir()) == []
    with engine.client() as c:
        assert c.request("jobs")["jobs"] == []

    # And the happy path through the CLI: run (following), jobs, metrics, logs.
    assert cli_main(["run", "script", "--gpus", "1", "--name", "quick", "--", "quick.py"]) == 0
    out = capsys.readouterr().out
    assert "submitted" in out and "step 3" in out and "completed" in out
    assert cli_main(["jobs"]) == 0
    assert "quick" in capsys.readouterr().out
    assert cli_main(["metrics", "quick", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in data["records"]] == [1, 2, 3] and data["job"]["progress"]["fraction"] == 1.0
    assert cli_main(["logs", "quick"]) == 0
    assert "quick rank 0 finished" in capsys.readouterr().out


TINY_LLAMA = REPO / "examples" / "models" / "tiny-llama" / "config.json"
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"


def test_check_prints_what_would_run_or_the_refusal_and_starts_nothing(engine, capsys, tmp_path):
    engine.start()
    # A model whose checkpoint (weights and optimizer state) fits the disk of any machine the tests run on.
    assert cli_main(["plan", "--model", "gpt2", "--task", "train", "--json"]) == 0
    (tmp_path / "plan.json").write_text(capsys.readouterr().out)
    base = ["run", "train", "--model", "gpt2", "--method", "scratch", "--data", str(SHAKESPEARE)]
    assert cli_main([*base, "--plan", str(tmp_path / "plan.json"), "--check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("would run: train (scratch) of gpt2") and "\nlayout: " in out and "\ntraining: " in out
    assert "\ndisk: about 1.9 GiB (a 1.4 GiB checkpoint of the weights and optimizer state, and the 474.7 MiB final model); " in out
    tiny = ["run", "train", "--model", str(TINY_LLAMA), "--data", str(SHAKESPEARE), "--gpus", "0,1"]
    assert cli_main([*tiny, "--method", "qlora", "--tp", "2", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rigpilot: error: QLoRA") and err.count("\n") == 1
    assert cli_main([*tiny, "--method", "scratch", "--pp", "2", "--check"]) == 0
    assert "pipeline 1F1B, 2 micro-batches" in capsys.readouterr().out
    # A plan's method and adapters are taken where the job leaves them open; a different method is refused.
    assert cli_main(["plan", "--model", "gpt2", "--method", "lora", "--lora-rank", "8", "--no-verify", "--json"]) == 0
    (tmp_path / "lora.json").write_text(capsys.readouterr().out)
    gpt2 = ["run", "train", "--model", "gpt2", "--data", str(SHAKESPEARE), "--plan", str(tmp_path / "lora.json")]
    assert cli_main([*gpt2, "--check"]) == 0
    assert capsys.readouterr().out.startswith("would run: train (lora) of gpt2")
    assert cli_main([*gpt2, "--method", "full", "--check"]) == 2
    assert capsys.readouterr().err == (
        "rigpilot: error: this plan was made for LoRA, and the job asks for Full fine-tune: plan again with "
        "--method full, or leave the method out to train as planned\n"
    )
    # A plan for other GPUs is refused, naming both machines.
    assert cli_main(["plan", "--simulate", "8x-h100-sxm", "--model", "gpt2", "--no-verify", "--json"]) == 0
    (tmp_path / "h100.json").write_text(capsys.readouterr().out)
    assert cli_main([*base, "--plan", str(tmp_path / "h100.json"), "--check"]) == 2
    assert capsys.readouterr().err.startswith("rigpilot: error: this plan was made for simulated: 8×H100")
    assert list(paths.jobs_dir().iterdir()) == []
    with engine.client() as c:
        assert c.request("jobs")["jobs"] == []


@pytest.mark.slow
@pytest.mark.skipif(
    not (REPO / "engine" / "workers" / "__main__.py").exists() or not TINY_LLAMA.exists(),
    reason="rigpilot.engine.workers (the train/infer worker entry point) or its tiny example model is not in this checkout",
)
def test_train_job_runs_under_the_service(engine):
    engine.start()
    spec = {
        "kind": "train", "model": str(TINY_LLAMA), "gpus": [0, 1], "env": {"HF_HUB_OFFLINE": "1"},
        "train": {"dataset": [str(SHAKESPEARE)], "method": "scratch", "max_steps": 4, "seq_len": 64,
                  "micro_batch": 2, "eval_every": 0, "checkpoint_every": 0, "warmup_steps": 0, "precision": "fp32"},
    }  # fmt: skip
    with engine.client() as c:
        job = c.request("submit", spec=spec)["job"]
        done = engine.wait_state(c, job["id"], "completed", "failed", "cancelled", timeout=300)
        assert done["state"] == "completed", (done["exit_reason"], done["last_log"])
        p = done["progress"]
        assert p["step"] == 4 and p["fraction"] == 1.0 and p["loss"] is not None and p["tokens_per_s"] > 0
        assert set(p["peak_memory_by_rank"]) == {"0", "1"}
        spec_written = json.loads((Path(done["job_dir"]) / "job.json").read_text())
        assert spec_written["parallelism"]["dp_replicate"] == 2  # no degrees given: data parallel over both ranks


def test_service_module_does_not_import_torch():
    code = "import sys, rigpilot.engine.service.server, rigpilot.engine.api.client, rigpilot.engine.cli.commands; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_gpus_and_watch_show_the_engines_telemetry_with_the_jobs_load(engine, capsys):
    engine.start()
    script = engine.script("gate.py", GATE_SCRIPT)
    with engine.client() as c:
        job = engine.submit(c, script, str(gate(engine, "g")), gpus=[2], name="load")
        engine.wait_state(c, job["id"], "running")

        # Only the engine knows what its jobs do to simulated GPUs: the CLI must ask it, not sample on its own.
        def gpu2_busy() -> bool:
            assert cli_main(["gpus", "--json"]) == 0
            g = {x["index"]: x for x in json.loads(capsys.readouterr().out)["telemetry"]["gpus"]}
            return g[2]["gpu_util"] > 60 and g[0]["gpu_util"] < 10

        wait_for(gpu2_busy, 20, 0.5, "rigpilot gpus to show the job's load on GPU 2")
        assert cli_main(["watch", "--count", "1", "--json"]) == 0
        sample = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert sample["simulated"] and sample["gpus"][2]["gpu_util"] > 60
        gate(engine, "g").touch()
        assert engine.wait_state(c, job["id"], "completed", "failed")["state"] == "completed"


def _offload_plan(gpus: list[int]) -> dict:
    """An FSDP2 CPU-offload plan as the planner writes it, for the tiny example model."""
    from rigpilot.engine.planner.plan import HostMemory, MemoryBreakdown, Parallelism, Plan, Timing, Workload

    mem = [MemoryBreakdown(gpu=g, stage=0, weights=0, gradients=0, optimizer=0, activations=1, kv_cache=0, buffers=0,
                           overhead=0, total=2**20, capacity=24 * 2**30, headroom=24 * 2**30 - 2**20) for g in gpus]  # fmt: skip
    plan = Plan(
        workload=Workload(model=str(TINY_LLAMA), task="train", seq_len=64, precision="fp32", global_batch=4),
        parallelism=Parallelism(gpu_indices=gpus, dp=len(gpus), zero_stage=3, shard_degree=len(gpus), backend="fsdp",
                                micro_batch=2, grad_accum=1, offload_params=True, offload_optimizer=True),
        memory=mem, host=HostMemory(needed=2**28, available=256 * 2**30, offloaded=2**24),
        timing=Timing(step_s=0.1, compute_s=0.1, exposed_comm_s=0.0, bubble_s=0.0, tokens_per_s=2560.0),
        machine="simulated: 4×RTX 4090", gpu_names=["RTX 4090"] * len(gpus), model_params=2 * 10**6, model_type="llama",
    )  # fmt: skip
    return json.loads(plan.to_json())


@pytest.mark.slow
def test_an_offload_plan_and_pipeline_stages_alone_run_to_completion_under_the_service(engine):
    """The whole chain: a plan (or bare --pp 2) → submission → torchrun ranks, each to a falling loss."""
    engine.start()
    train = {"dataset": [str(SHAKESPEARE)], "method": "scratch", "max_steps": 8, "learning_rate": 1e-2,
             "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0, "precision": "fp32"}  # fmt: skip
    runs = {
        "offload": ({"kind": "train", "model": str(TINY_LLAMA), "train": train}, _offload_plan([0, 1])),
        "pp": ({"kind": "train", "model": str(TINY_LLAMA), "gpus": [0, 1], "parallelism": {"pp": 2},
                "train": {**train, "seq_len": 64}}, None),
    }
    with engine.client() as c:
        for name, (spec, plan) in runs.items():
            job = c.request("submit", spec={**spec, "env": {"HF_HUB_OFFLINE": "1"}}, plan=plan)["job"]
            done = engine.wait_state(c, job["id"], "completed", "failed", "cancelled", timeout=300)
            assert done["state"] == "completed", (name, done["exit_reason"], done["last_log"])
            written = json.loads((Path(done["job_dir"]) / "job.json").read_text())["parallelism"]
            records, _ = c.all_metrics(job["id"])
            curve = [r["loss"] for r in sorted((r for r in records if r.get("loss") is not None and r.get("rank") == 0), key=lambda r: r["step"])]
            assert len(curve) == 8 and sum(curve[-3:]) / 3 < curve[0] - 0.3, (name, curve)
            if name == "offload":
                assert written["cpu_offload"] and written["dp_shard"] == 2
                notes = [r.get("message", "") for r in records if r.get("kind") == "note"]
                assert any("CPU offload (FSDP2 CPUOffloadPolicy" in n for n in notes), notes
            else:
                assert (written["pp"], written["pp_microbatches"], written["pp_schedule"]) == (2, 2, "1F1B")
