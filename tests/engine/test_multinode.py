"""Jobs across two Rigpilot engines on loopback, each with its own XDG folders and a simulated 2×RTX 3090.

Each engine runs 2 CPU ranks (this box's CPU count caps them), so a job over both is a real 4-rank,
2-node torchrun c10d rendezvous. Its per-step loss must equal the plain single-process loop's
(tests/workers/test_workers_reference.py), and a node that goes away (engine and ranks killed) must fail
the job on every node, naming the node, and the job must resume from its shared checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from rigpilot.engine.api import tls
from rigpilot.engine.api.client import EngineClient
from rigpilot.engine.cli.entry import main as cli_main

from support.engine import wait_job_state
from support.paths import CHAT, REPO, TINY_LLAMA_CONFIG
from support.reference_loop import GLOBAL_BATCH, RECIPE, reference_run
from support.waiting import wait_for
from support.worker_jobs import losses as plain_losses
from support.worker_jobs import run_job, write_job

PROFILE = "2x-rtx3090-nvlink"
TERMINAL = ("completed", "failed", "cancelled", "interrupted")


class Node:
    """One engine service with XDG folders of its own."""

    def __init__(
        self, base: Path, name: str, tcp: bool = False, host_id: str | None = None, extra: tuple[str, ...] = ()
    ):
        self.name = name
        self.base = base / name
        (self.base / "r").mkdir(mode=0o700, parents=True, exist_ok=True)
        self.env = {
            **os.environ, "XDG_RUNTIME_DIR": str(self.base / "r"), "XDG_STATE_HOME": str(self.base / "state"),
            "XDG_CONFIG_HOME": str(self.base / "config"), "RIGPILOT_SIMULATE": PROFILE,
        }  # fmt: skip
        if host_id:
            self.env["RIGPILOT_HOST_ID"] = host_id
        self.tcp = tcp
        # The engine picks a free port on its first start (port 0: no race with other tests for a probed one);
        # a restart binds the same one again, as the other nodes know it by that address.
        self.tcp_port: int | None = None
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "rigpilot.engine.service", "--grace", "3", "--failure-grace", "2"]
        if self.tcp:
            cmd += ["--tcp", f"127.0.0.1:{self.tcp_port or 0}"]
        cmd += list(self.extra)
        out = self.base / "engine.out"
        ready = self._ready_lines()
        log = out.open("ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=log, stderr=log)
        # A killed engine leaves its socket file behind: wait for this one's own "ready" line.
        wait_for(lambda: self._ready_lines() > ready or self.proc.poll() is not None, 30, what=f"engine {self.name}")
        assert self.proc.poll() is None, (self.base / "engine.out").read_text()
        if self.tcp and self.tcp_port is None:
            self.tcp_port = self._listening_port()

    def _listening_port(self) -> int:
        text = (self.base / "engine.out").read_text()
        found = re.findall(r"listening for remote clients on 127\.0\.0\.1:(\d+)", text)
        assert found, text
        return int(found[-1])

    def _ready_lines(self) -> int:
        try:
            return (self.base / "engine.out").read_text().count("engine service ready on")
        except FileNotFoundError:
            return 0

    @property
    def token(self) -> str:
        return (self.base / "config" / "rigpilot" / "engine-token").read_text().strip()

    @property
    def fingerprint(self) -> str:
        """Its TLS certificate's, read from its own files (what `rigpilot engine --fingerprint` prints there)."""
        cert = self.base / "state" / "rigpilot" / "tls" / tls.CERT_FILE
        return tls.fingerprint_of(ssl.PEM_cert_to_DER_cert(cert.read_text()))

    def client(self) -> EngineClient:
        assert self.tcp_port
        c = EngineClient(tcp=f"127.0.0.1:{self.tcp_port}", token=self.token, timeout=30)
        c.connect()
        return c

    def job_processes(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("RIGPILOT_JOB_DIR", "").startswith(str(self.base)):
                    out.append(p)
            except (psutil.Error, OSError):
                pass
        return out

    def go_away(self) -> None:
        """The machine drops off: its engine and every process of its jobs are SIGKILLed."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        for p in self.job_processes():
            p.send_signal(signal.SIGKILL)

    def stop_engine_only(self) -> None:
        """SIGTERM: the engine stops, its jobs keep running (the next engine re-adopts them)."""
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(15)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for p in self.job_processes():
            p.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("nodes")
    head = Node(base, "head")
    box2 = Node(base, "box2", tcp=True)
    # A third engine that calls itself another computer: a job with it needs --shared-dir.
    box3 = Node(base, "box3", tcp=True, host_id="box3-elsewhere")
    # One that runs fewer ranks per job than the head: refused, as torchrun needs the same count on every node.
    box4 = Node(base, "box4", tcp=True, extra=("--max-cpu-ranks", "1"))
    try:
        for n in (head, box2, box3, box4):
            n.start()
    except BaseException:
        for n in (head, box2, box3, box4):  # no engine outlives a set-up that failed half-way
            n.stop()
        raise
    saved = {k: os.environ.get(k) for k in ("XDG_RUNTIME_DIR", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "RIGPILOT_SIMULATE")}
    os.environ.update({k: head.env[k] for k in saved})  # this process's CLI and clients talk to the head
    yield head, box2, box3, base, box4
    for n in (head, box2, box3, box4):
        n.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def head_client() -> EngineClient:
    c = EngineClient(autostart=False, timeout=60)
    c.connect()
    return c


def cli(capsys, *argv: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        import io

        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = cli_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def train_spec(parallelism: dict[str, Any], **train: Any) -> dict[str, Any]:
    t = {**RECIPE, "dataset": [str(CHAT)], "eval_fraction": 0.02, "micro_batch": 1, "grad_accum": 1, **train}
    return {"kind": "train", "model": str(TINY_LLAMA_CONFIG), "gpus": [0, 1], "parallelism": parallelism,
            "env": {"HF_HUB_OFFLINE": "1"}, "train": t}  # fmt: skip


def step_of(c: EngineClient, job_id: str) -> int:
    return (c.request("job", job=job_id)["job"]["progress"] or {}).get("step") or 0


def step_losses(c: EngineClient, job_id: str) -> dict[int, float]:
    records, _ = c.all_metrics(job_id)
    return {r["step"]: r["loss"] for r in records if r.get("loss") is not None and r.get("rank") == 0}


def test_nodes_registry_keeps_tokens_private_and_refuses_bad_input_in_one_line(cluster, capsys, monkeypatch):
    head, box2, box3, _, box4 = cluster
    rc, out, err = cli(capsys, "nodes", "add", "box2", f"127.0.0.1:{box2.tcp_port}", stdin=box2.token + "\n",
                       monkeypatch=monkeypatch)  # fmt: skip
    assert rc == 0, err
    assert "reachable" in out and "2 GPUs, simulated" in out
    # Reached over TLS, its certificate pinned on that first login: the one box2's engine has.
    assert f"certificate {box2.fingerprint} pinned" in out and "rigpilot engine --fingerprint" in out
    token_file = box3.base / "token"
    token_file.write_text(box3.token)
    assert cli(capsys, "nodes", "add", "box3", f"127.0.0.1:{box3.tcp_port}", "--token-file", str(token_file))[0] == 0
    registry = head.base / "config" / "rigpilot" / "nodes.json"
    assert stat.S_IMODE(registry.stat().st_mode) == 0o600
    assert stat.S_IMODE(registry.parent.stat().st_mode) == 0o700
    assert json.loads(registry.read_text())["nodes"]["box2"]["token"] == box2.token
    assert json.loads(registry.read_text())["nodes"]["box3"]["fingerprint"] == box3.fingerprint

    rc, out, _ = cli(capsys, "nodes", "list")
    assert rc == 0 and out.count("reachable,") == 2
    # A wrong token: listed, and said to be unreachable with the engine's reason; one line, no traceback.
    assert cli(capsys, "nodes", "add", "bad", f"127.0.0.1:{box2.tcp_port}", stdin="x" * 40, monkeypatch=monkeypatch)[0] == 0
    rc, out, _ = cli(capsys, "nodes", "list")
    assert "bad" in out and "not reachable: refused" in out and "wrong token" in out
    assert cli(capsys, "nodes", "remove", "bad")[0] == 0
    # Another certificate than the one given: refused in one line that says what to do, and never pinned instead.
    wrong = "SHA256:" + "A" * 43
    rc, out, _ = cli(capsys, "nodes", "add", "twin", f"127.0.0.1:{box2.tcp_port}", "--fingerprint", wrong,
                     stdin=box2.token, monkeypatch=monkeypatch)  # fmt: skip
    assert rc == 0 and f"presents certificate {box2.fingerprint}, not {wrong}" in out, out
    assert f"rigpilot nodes add twin 127.0.0.1:{box2.tcp_port} --fingerprint {box2.fingerprint}" in out
    assert json.loads(registry.read_text())["nodes"]["twin"]["fingerprint"] == wrong
    assert cli(capsys, "nodes", "remove", "twin")[0] == 0
    for argv, words in [
        (("nodes", "add", "local", "127.0.0.1:1"), "means this engine itself"),
        (("nodes", "add", "b x", "127.0.0.1:1"), "a node name is"),
        (("nodes", "add", "box4", "nohost"), "HOST:PORT"),
        (("nodes", "add", "box4", "127.0.0.1:99999"), "must be from 1 to 65535"),
        (("nodes", "remove", "box9"), "no node 'box9'"),
    ]:
        rc, out, err = cli(capsys, *argv, stdin="", monkeypatch=monkeypatch)
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    rc, _, err = cli(capsys, "nodes", "add", "box4", "127.0.0.1:1", stdin="", monkeypatch=monkeypatch)
    assert rc == 2 and "needs its engine's token" in err and "rigpilot engine --tcp" in err

    # Multi-node refusals: one line each, nothing left behind.
    with head_client() as c:
        before = len(c.request("jobs")["jobs"])
    for nodes, words in [
        ("local,box9", "no node 'box9'"),
        ("box2", "must name 'local'"),
        ("local,box2,box2", "named twice"),
        ("local,box3", "needs a folder every node sees"),
    ]:
        rc, _, err = cli(capsys, "run", "train", "--nodes", nodes, "--model", str(TINY_LLAMA_CONFIG),
                         "--data", str(CHAT), "--steps", "2", "--detach")  # fmt: skip
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, (nodes, err)
    with head_client() as c:
        c.request("node_add", name="box4", address=f"127.0.0.1:{box4.tcp_port}", token=box4.token)
    rc, _, err = cli(capsys, "run", "train", "--nodes", "local,box4", "--model", str(TINY_LLAMA_CONFIG),
                     "--data", str(CHAT), "--steps", "2", "--detach")  # fmt: skip
    assert rc == 2 and "node box4 would run 1 ranks and the head 2" in err, err
    assert cli(capsys, "nodes", "remove", "box4")[0] == 0
    # --check goes through every node's own checks and creates nothing anywhere.
    rc, out, err = cli(capsys, "run", "train", "--nodes", "local,box2", "--model", str(TINY_LLAMA_CONFIG),
                       "--data", str(CHAT), "--steps", "2", "--check")  # fmt: skip
    assert rc == 0, err
    assert "node box2 (127.0.0.1:" in out and "2 nodes × 2 ranks" in out and "dp 4 × fsdp 1" in out
    with head_client() as c:
        assert len(c.request("jobs")["jobs"]) == before
    for n in (head, box2, box3, box4):
        jobs_dir = n.base / "state" / "rigpilot" / "jobs"
        assert not jobs_dir.exists() or not any(jobs_dir.iterdir()), n.name


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    assert GLOBAL_BATCH == 4  # 4 ranks × micro-batch 1: the reference's global batch
    return reference_run(CHAT, 0.02)


def plain_four_ranks(root: Path, layout: dict[str, Any]) -> dict[int, float]:
    """The same job on one node: a plain `torchrun --standalone --nproc-per-node 4`, no engine."""
    spec = train_spec(layout)
    job = write_job(root / ("plain-" + "-".join(layout)), kind="train", model=spec["model"], parallelism=layout,
                    train=spec["train"])  # fmt: skip
    run_job(job, 4)
    return plain_losses(job)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"dp_replicate": 4}, {"dp_shard": 4}], ids=["ddp", "fsdp"])
def test_a_job_across_two_engines_trains_what_the_plain_loop_trains(cluster, reference, layout):
    _, box2, _, base, _ = cluster
    with head_client() as c:
        if not any(n["name"] == "box2" for n in c.request("nodes", probe=False)["nodes"]):
            c.request("node_add", name="box2", address=f"127.0.0.1:{box2.tcp_port}", token=box2.token)
        job = c.request("submit", spec=train_spec(layout), nodes=["local", "box2"])["job"]
        assert job["ranks"] == 2 and job["nodes"]["count"] == 2 and job["nodes"]["endpoint"].startswith("127.0.0.1:")
        done = wait_job_state(c, job["id"], *TERMINAL, timeout=120)
        assert done["state"] == "completed", (done["exit_reason"], done["last_log"])
        losses = step_losses(c, job["id"])
        records, _ = c.all_metrics(job["id"])
        logs = {rank: c.request("logs", job=job["id"], rank=rank)["text"] for rank in range(4)}
    assert sorted(losses) == list(range(1, RECIPE["max_steps"] + 1))
    # The same 4 ranks on one node sum gradients in the same order: equal to 1e-6. The single-process loop
    # sums them in another order, so its losses agree to the float32 rounding of that (1e-5, as every layout).
    one_node = plain_four_ranks(base, layout)
    for step, loss in losses.items():
        assert loss == pytest.approx(one_node[step], abs=1e-6), (step, loss, one_node[step])
        assert loss == pytest.approx(reference["loss"][step], abs=1e-5), (step, loss, reference["loss"][step])
    # The head shows every rank of both nodes, the member's labelled with its node.
    assert {r["rank"] for r in records} == {0, 1, 2, 3}
    member_ranks = set(done["nodes"]["ranks"]["box2"])
    assert len(member_ranks) == 2 and {r["rank"] for r in records if r.get("node") == "box2"} == member_ranks
    # One checkpoint folder for both nodes (the member links to the head's), and the output sits with the head.
    head_dir = Path(done["job_dir"])
    # The head answers for every rank's log; its own ranks' as they wrote them (empty where a rank printed nothing:
    # one forked from a warm worker has no import warnings to show).
    for rank in {0, 1, 2, 3} - member_ranks:
        assert logs[rank] == (head_dir / "logs" / f"rank{rank}.log").read_text(errors="replace")
    member_dir = box2.base / "state" / "rigpilot" / "jobs" / job["id"]
    assert (member_dir / "checkpoints").resolve() == (head_dir / "checkpoints").resolve()
    assert (head_dir / "checkpoints" / f"step-{RECIPE['max_steps']}" / "COMPLETE").is_file()
    assert len(list((head_dir / "checkpoints" / f"step-{RECIPE['max_steps']}").glob("*.distcp"))) == 4
    assert (head_dir / "output" / "model.safetensors").is_file()
    with box2.client() as c2:
        assert c2.request("job", job=job["id"])["job"]["state"] == "completed"
    # The token reached no job folder and no log.
    for folder in (head_dir, member_dir):
        for f in folder.rglob("*"):
            if f.is_file() and not f.is_symlink():
                assert box2.token.encode() not in f.read_bytes(), f


@pytest.mark.slow
def test_a_node_that_goes_away_fails_the_job_on_every_node_and_it_resumes(cluster, capsys):
    head, _, box3, base, _ = cluster
    shared = base / "shared"
    shared.mkdir()
    with head_client() as c:
        if not any(n["name"] == "box3" for n in c.request("nodes", probe=False)["nodes"]):
            c.request("node_add", name="box3", address=f"127.0.0.1:{box3.tcp_port}", token=box3.token)
        spec = train_spec({"dp_replicate": 4}, max_steps=36, checkpoint_every=5, eval_every=0, keep_checkpoints=2)
        job = c.request("submit", spec=spec, nodes=["local", "box3"], shared_dir=str(shared))["job"]
        job_id = job["id"]
        wait_for(lambda: step_of(c, job_id) >= 12, 90, 0.1, "step 12")
        box3.go_away()
        failed = wait_job_state(c, job_id, *TERMINAL, timeout=60)
        assert failed["state"] == "failed" and failed["resumable"]
        assert failed["exit_reason"].startswith("node box3"), failed["exit_reason"]
        wait_for(lambda: not head.job_processes(), 30, what="the head's ranks to stop")
        assert not box3.job_processes()
        stopped_at = failed["progress"]["step"]
        assert stopped_at < spec["train"]["max_steps"]

        # Checkpoints went to the shared folder, one file per rank.
        ckpts = sorted((shared / f"rigpilot-{job_id}" / "checkpoints").glob("step-*/COMPLETE"))
        assert ckpts and len(list(ckpts[-1].parent.glob("*.distcp"))) == 4

        rc, _, err = cli(capsys, "resume", job_id, "--detach")
        assert rc == 2 and "node box3" in err and len(err.strip().splitlines()) == 1

        box3.start()  # the machine is back; its engine finds its part interrupted
        with box3.client() as c3:
            assert c3.request("job", job=job_id)["job"]["state"] == "interrupted"
            err = ""
            try:
                c3.request("resume", job=job_id)
            except Exception as e:  # a member's part resumes only through its head
                err = str(e)
            assert "resume it there" in err
        resumed = c.request("resume", job=job_id)["job"]
        assert resumed["run"] == 2 and resumed["resumes_from"]["step"] >= 10
        ended = wait_job_state(c, job_id, *TERMINAL, timeout=90)
        assert ended["state"] == "completed", (ended["exit_reason"], ended["last_log"])
        assert ended["progress"]["step"] == spec["train"]["max_steps"]
        with box3.client() as c3:
            assert wait_job_state(c3, job_id, *TERMINAL, timeout=30)["state"] == "completed"
        records, _ = c.all_metrics(job_id)
    runs = {r.get("run") for r in records if r.get("loss") is not None}
    assert runs == {1, 2}
    first_of_run2 = min(r["step"] for r in records if r.get("run") == 2 and r.get("loss") is not None)
    assert first_of_run2 == resumed["resumes_from"]["step"] + 1
    wait_for(lambda: not head.job_processes() and not box3.job_processes(), 30, what="every rank to stop")
    # One delete removes the job from every node, and its folder from the shared one.
    assert cli(capsys, "delete", job_id)[0] == 0
    with box3.client() as c3:
        assert not [j for j in c3.request("jobs")["jobs"] if j["id"] == job_id]
    assert not (shared / f"rigpilot-{job_id}").exists()


def test_members_part_cannot_be_submitted_without_the_facts_a_head_sends(cluster):
    _, box2, _, _, _ = cluster
    with box2.client() as c2:
        for nodes, words in [
            ({"role": "head"}, "role must be 'member'"),
            ({"role": "member", "count": 1}, "count must be from 2"),
            ({"role": "member", "count": 2, "endpoint": "x"}, "is missing"),
        ]:
            with pytest.raises(Exception, match=words):
                c2.request("submit_member", job="abc123", spec=train_spec({"dp_replicate": 4}), nodes=nodes)
    # A client without the token is refused before any request.
    bad = EngineClient(tcp=f"127.0.0.1:{box2.tcp_port}", token="y" * 40, timeout=10)
    with pytest.raises(Exception, match="token"):
        bad.connect()


@pytest.mark.slow
def test_the_head_restarts_mid_job_and_one_cancel_stops_the_job_on_every_node(cluster, capsys):
    head, box2, _, _, _ = cluster
    with head_client() as c:
        if not any(n["name"] == "box2" for n in c.request("nodes", probe=False)["nodes"]):
            c.request("node_add", name="box2", address=f"127.0.0.1:{box2.tcp_port}", token=box2.token)
        spec = train_spec({"dp_shard": 4}, max_steps=500, eval_every=0, checkpoint_every=0)
        job_id = c.request("submit", spec=spec, nodes=["local", "box2"])["job"]["id"]
        wait_for(lambda: step_of(c, job_id) >= 3, 90, 0.1, "step 3")
    # The head's engine restarts mid-job: the job goes on, and the new engine takes up the member's records
    # where the old one stopped.
    head.stop_engine_only()
    head.start()
    with head_client() as c:
        at = step_of(c, job_id)
        wait_for(lambda: max((r["step"] for r in c.all_metrics(job_id)[0]
                              if r.get("node") == "box2" and r.get("loss") is not None), default=0) > at + 2,
                 60, 0.2, "the member's newer steps on the restarted head")  # fmt: skip
        # The member's GPUs, as its engine samples them, are part of the head's view of the job.
        box2_gpus = wait_for(lambda: ((c.request("job", job=job_id)["job"]["nodes"].get("telemetry") or {})
                                      .get("box2") or {}).get("gpus"), 30, 0.2, "the member's telemetry")  # fmt: skip
        assert len(box2_gpus) == 2
        records, _ = c.all_metrics(job_id)
        seen = [(r["rank"], r["step"]) for r in records if r.get("node") == "box2" and r.get("loss") is not None]
        assert len(seen) == len(set(seen))  # each member record pulled once, across the restart
        rc, out, _ = cli(capsys, "cancel", job_id)
        assert rc == 0 and job_id in out
        assert wait_job_state(c, job_id, *TERMINAL, timeout=60)["state"] == "cancelled"
    with box2.client() as c2:
        assert wait_job_state(c2, job_id, *TERMINAL, timeout=30)["state"] == "cancelled"
    wait_for(lambda: not head.job_processes() and not box2.job_processes(), 30, what="every rank to stop")
