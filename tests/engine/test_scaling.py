"""Scaling studies (engine.jobs.scaling, `rigpilot scaling`): the arithmetic, bad input, and a real study.

The real study runs the tiny example Llama on 1 and 2 simulated GPUs (CPU ranks) through a real engine and
checks the table against the jobs' own metric files, read here without the study's code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rigpilot.engine import paths
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs import scaling, scaling_table

from support.engine import Engine, engine_home, leftover_job_processes
from support.paths import REPO
from support.waiting import wait_for

TINY = REPO / "examples" / "models" / "tiny-llama" / "config.json"
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"


def step(rank: int, n: int, tps: float, dt: float) -> dict:
    return {"rank": rank, "step": n, "tokens_per_s": tps, "step_time": dt, "loss": 1.0, "time": n + rank / 10}


def test_without_seq_a_study_trains_at_the_model_context_where_that_is_shorter_as_run_train_does(tmp_path):
    # The README's `rigpilot scaling --model examples/models/tiny-llama …` gives no --seq: its context is 256.
    from rigpilot.engine.jobs.submission import default_seq_len

    assert default_seq_len(str(TINY.parent), None) == 256
    assert default_seq_len("tiny-llama", str(TINY.parents[1])) == 256  # a folder where the user stands
    assert default_seq_len("llama-2-7b", None) == 512  # a preset with a longer context: the default
    assert default_seq_len("Qwen/Qwen2.5-7B", None) == 512  # a hub id: nothing to read here
    with pytest.raises(UserError, match="does not exist"):
        default_seq_len(str(tmp_path / "nowhere"), None)


def test_measure_skips_warmup_and_adds_the_ranks_shares():
    records = [step(0, 1, 10.0, 9.0), step(1, 1, 10.0, 9.0)]  # warm-up: slow, left out
    records += [step(0, 2, 100.0, 1.0), step(1, 2, 50.0, 2.0), step(0, 3, 100.0, 1.0), step(1, 3, 100.0, 1.0)]
    records += [{"rank": 0, "step": 3, "kind": "eval", "eval_loss": 2.0}, {"rank": 0, "kind": "status"}]
    m = scaling.measure(records, warmup=1)
    # step 2: 100 + 100 tokens in 2 s (the slower rank); step 3: 200 tokens in 1 s
    assert (m["steps"], m["tokens"], m["seconds"]) == (2, 400.0, 3.0)
    assert m["tokens_per_s"] == pytest.approx(400 / 3) and m["steps_per_s"] == pytest.approx(2 / 3)
    assert m["step_time_spread"] == pytest.approx(0.5 / 1.5)  # step times 2 s and 1 s
    assert scaling.measure(records, warmup=3) is None


def test_a_noisy_point_and_more_cpu_ranks_than_cores_are_said():
    def point(n, ranks, spread):
        m = {"tokens_per_s": 100.0 * n, "steps": 5, "step_time_spread": spread}
        return {"gpus": n, "state": "completed", "ranks": ranks, "measured": m, "predicted": {}}

    settings = {"global_batch": 8, "seq_len": 32, "micro_batch": 2, "precision": "fp32", "method": "full", "steps": 9,
                "warmup": 2}  # fmt: skip
    study = {"settings": settings, "simulated": True, "cpu_cores": 2, "machine": "sim",
             "points": [point(1, 1, 0.05), point(4, 4, 0.4)]}  # fmt: skip
    said = scaling.summarize(study)["notes"]
    assert study["table"][1]["noise"] == "step times varied by 40% (more than 25%)"  # said by its row, once
    assert any(n.startswith("4 CPU ranks on 2 cores cannot run faster than 2") for n in said)
    assert study["state"] == "completed" and study["table"][1]["efficiency"] == 1.0


def test_table_speedup_efficiency_and_prediction():
    study = {"points": [
        {"gpus": 1, "measured": {"tokens_per_s": 1000.0}, "predicted": {"tokens_per_s": 4000.0}},
        {"gpus": 2, "measured": {"tokens_per_s": 1500.0}, "predicted": {"tokens_per_s": 7000.0}},
        {"gpus": 4, "measured": None, "predicted": {"tokens_per_s": 12000.0}},
    ]}  # fmt: skip
    one, two, four = scaling.table(study)
    assert (one["speedup"], one["efficiency"], one["measured_vs_predicted"]) == (1.0, 1.0, 0.25)
    assert (two["speedup"], two["efficiency"], two["predicted_speedup"]) == (1.5, 0.75, 1.75)
    assert two["measured_vs_predicted"] == pytest.approx(1500 / 7000)
    assert four["speedup"] is None and four["predicted_speedup"] == 3.0


def test_noise_rows_are_marked_with_the_reason_and_not_shown_as_a_speedup():
    def point(n, tps, steps=7, spread=0.05):
        return {"gpus": n, "measured": {"tokens_per_s": tps, "steps": steps, "step_time_spread": spread},
                "predicted": {}}  # fmt: skip

    # 2 GPUs at 36.7× the 1-GPU point: 1836% of linear (the figure a busy machine once showed)
    one, two, four = scaling.table({"points": [point(1, 100.0), point(2, 3672.0), point(4, 380.0, spread=0.3)]})
    assert one["noise"] is None and two["efficiency"] == pytest.approx(18.36)
    assert two["noise"] == "18.4× linear is not scaling: a point was slowed by something else"
    assert four["noise"] == "step times varied by 30% (more than 25%)"
    cells = [scaling_table.cells(r) for r in (one, two, four)]
    assert [c[6:8] for c in cells] == [["1.00×", "100%"], ["noise", "noise"], ["noise", "noise"]]
    # a base point that is noise makes every ratio against it noise; too few steps is noise
    base, other = scaling.table({"points": [point(1, 100.0, steps=2), point(2, 190.0)]})
    assert base["noise"] == "only 2 steps measured (at least 3 needed)"
    assert other["noise"] == "measured against the 1-GPU point, which is noise: only 2 steps measured (at least 3 needed)"
    assert scaling.table({"points": [point(1, 100.0), point(2, 190.0)]})[1]["noise"] is None  # 95%: a result


class _Supervisor:
    """The supervisor's side a study uses, with jobs as plain records: the study's threading is under test."""

    def __init__(self, tmp_path: Path):
        from types import SimpleNamespace

        self.machine = load_profile("2x-rtx3090-nvlink")
        self.stored_check = lambda machine: None  # no machine check: the study's words use the planner's priors
        self.jobs: dict[str, SimpleNamespace] = {
            "t": SimpleNamespace(id="t", state="completed", ranks=1, exit_reason=None),
        }
        self.store = SimpleNamespace(get=self.jobs.get)
        self.tmp = tmp_path
        self.cancelled: list[str] = []

    def detail(self, job):
        settings = {"kind": "train", "model": "tiny", "train": {"micro_batch": 2, "grad_accum": 2, "seq_len": 32}}
        return {"id": job, "kind": "train", "settings": settings}

    def check(self, spec, result, cwd):
        pass

    def submit(self, spec, result, cwd):
        from types import SimpleNamespace

        job = f"p{len(self.jobs)}"
        self.jobs[job] = SimpleNamespace(id=job, state="queued", ranks=len(spec["gpus"]), exit_reason=None)
        return {"id": job}

    def tag_study(self, job, study):
        pass

    def job_dir(self, job):
        return self.tmp / job

    def cancel(self, job):
        self.cancelled.append(job)
        self.jobs[job].state = "cancelled"


def test_a_study_answers_at_once_while_its_points_are_planned_and_a_second_is_refused(tmp_path):
    import threading

    gate, asked = threading.Event(), []

    def plan(request):  # as slow as the gate: the planner on a busy machine
        asked.append(request["gpus"])
        assert gate.wait(30)
        best = {"parallelism": {"micro_batch": 2, "grad_accum": 1, "dp": len(request["gpus"])},
                "timing": {"tokens_per_s": 1000.0 * len(request["gpus"])}}  # fmt: skip
        return {"best": best}

    sup = _Supervisor(tmp_path)
    studies = scaling.Studies(tmp_path / "scaling", sup, plan, paths.write_private)
    study = studies.start({"job": "t", "gpus": [1, 2]}, None)
    assert (study["state"], study["points"], study["counts"], study["planned"]) == ("planning", [], [1, 2], 0)
    assert study["table"] == [] and study["notes"] == []
    with pytest.raises(UserError) as refused:
        studies.start({"job": "t", "gpus": [1]}, None)
    assert refused.value.reason == "study_running" and refused.value.fields == {"study": study["id"], "job": "t"}
    gate.set()
    shown = wait_for(lambda: (s := studies.get(study["id"]))["state"] == "running" and s, 30, what="the jobs")
    assert [(p["gpus"], p["job"], p["state"]) for p in shown["points"]] == [(1, "p1", "queued"), (2, "p2", "queued")]
    assert shown["settings"]["micro_batch"] == 2 and "planned" not in shown
    # cancelled while it plans: no job is ever submitted
    for job in ("p1", "p2"):
        sup.jobs[job].state = "completed"
    gate.clear()
    again = studies.start({"job": "t", "gpus": [1, 2]}, None)
    assert studies.cancel(again["id"])["state"] == "cancelled"
    assert studies.get(again["id"])["state"] == "cancelled"  # at once, while its planner still runs
    studies.start({"job": "t", "gpus": [1]}, None)["id"]  # a cancelled study does not hold the job
    gate.set()
    wait_for(lambda: again["id"] not in studies._live, 30, what="the planning thread to end")
    assert studies.get(again["id"])["state"] == "cancelled" and "error" not in studies.get(again["id"])


def test_a_study_read_or_cancelled_while_its_jobs_are_submitted_is_never_taken_for_lost(tmp_path):
    import threading

    sup = _Supervisor(tmp_path)
    submitting, release = threading.Event(), threading.Event()
    submit = sup.submit

    def slow_submit(spec, result, cwd):  # the supervisor's check and queue on a busy machine
        submitting.set()
        assert release.wait(30)
        return submit(spec, result, cwd)

    sup.submit = slow_submit
    plan = lambda request: {"best": {"parallelism": {"micro_batch": 2}, "timing": {}}}  # noqa: E731
    studies = scaling.Studies(tmp_path / "scaling", sup, plan, paths.write_private)
    sid = studies.start({"job": "t", "gpus": [1, 2]}, None)["id"]
    assert submitting.wait(30)
    seen = []
    reader = threading.Thread(target=lambda: seen.append(studies.get(sid)["state"]))
    canceller = threading.Thread(target=lambda: seen.append(studies.cancel(sid)["state"]))
    reader.start()
    canceller.start()
    release.set()
    reader.join(30)
    canceller.join(30)
    # Both waited for the submission: the reader saw the jobs, the cancel cancelled them.
    assert sorted(seen) == ["cancelled", "running"] or seen == ["cancelled", "cancelled"], (seen, studies.get(sid))
    assert set(sup.cancelled) == {"p1", "p2"} and studies.get(sid)["state"] == "cancelled"


def test_a_study_refused_while_planned_fails_in_one_line_and_one_the_engine_lost_says_so(tmp_path):
    sup = _Supervisor(tmp_path)

    def plan(request):
        return {"best": None, "rejected": [{"reason": "needs 90 GiB per GPU; has 24 GiB"}]}

    studies = scaling.Studies(tmp_path / "scaling", sup, plan, paths.write_private)
    sid = studies.start({"job": "t", "gpus": [1, 2]}, None)["id"]
    failed = wait_for(lambda: (s := studies.get(sid))["state"] == "failed" and s, 30, what="the study to fail")
    assert failed["error"]["message"] == "no plan fits on 2 GPUs: needs 90 GiB per GPU; has 24 GiB"
    assert failed["points"] == [] and set(sup.jobs) == {"t"}
    # A study stored as planning by an engine that then stopped is not planning for ever.
    stored = json.loads((tmp_path / "scaling" / f"{sid}.json").read_text())
    (tmp_path / "scaling" / "slost00.json").write_text(json.dumps({**stored, "id": "slost00", "phase": "planning"}))
    lost = scaling.Studies(tmp_path / "scaling", sup, plan, paths.write_private).get("slost00")
    assert lost["state"] == "failed" and lost["error"]["code"] == "study_interrupted"


@pytest.mark.parametrize(
    ("text", "words"),
    [("0", "start at 1"), ("1,1", "twice"), ("a", "like 1,2,4"), ("", "which GPU counts")],
)
def test_bad_gpu_counts_are_one_line(text, words):
    with pytest.raises(UserError, match=words):
        scaling_table.parse_counts(text)


def test_cli_refuses_gpus_zero_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["scaling", "--model", "x", "--gpus", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GPU counts start at 1" in err


@pytest.fixture
def engine(tmp_path, monkeypatch):
    engine_home(tmp_path, monkeypatch)
    e = Engine(tmp_path)
    yield e
    e.stop()
    for p in leftover_job_processes(tmp_path):
        p.kill()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_bad_study_input_is_refused_in_one_line_and_submits_nothing(engine, capsys, monkeypatch):
    engine.start()
    monkeypatch.chdir(engine.tmp)
    base = ["scaling", "--data", str(SHAKESPEARE), "--method", "scratch"]
    code, _, err = run_cli(capsys, *base, "--model", str(TINY), "--gpus", "1,8")
    assert code == 2 and err == "rigpilot: error: this machine has 4 GPUs, not 8\n"
    code, _, err = run_cli(capsys, *base, "--model", "no-such-model-here", "--gpus", "1")
    assert code == 2 and err.count("\n") == 1 and "no-such-model-here" in err
    code, _, err = run_cli(capsys, *base, "--model", str(TINY), "--gpus", "1", "--steps", "2")
    assert code == 2 and "nothing to measure" in err and err.count("\n") == 1
    with engine.client() as c:
        assert c.request("jobs")["jobs"] == []
        # the model is found missing while the study is planned: it stays listed as failed, with no job
        [study] = c.request("scaling_studies")["studies"]
    assert (study["model"], study["state"], study["points"]) == ("no-such-model-here", "failed", [])


def own_tokens_per_s(job_dir: Path, warmup: int, tokens_per_step: int) -> float:
    """From the metric files, without the study's code: each step's time is its slowest rank's."""
    times: dict[int, float] = {}
    for f in (job_dir / "metrics").glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if "step_time" in r and r["step"] > warmup:
                times[r["step"]] = max(times.get(r["step"], 0.0), r["step_time"])
    return tokens_per_step * len(times) / sum(times.values())


@pytest.mark.slow
def test_a_study_on_one_and_two_cpu_ranks_matches_the_jobs_own_records(engine, capsys, monkeypatch):
    engine.start()
    monkeypatch.chdir(engine.tmp)
    seq, batch, steps, warmup = 32, 8, 5, 2
    code, out, err = run_cli(
        capsys, "scaling", "--model", str(TINY), "--data", str(SHAKESPEARE), "--method", "scratch",
        "--precision", "fp32", "--seq", str(seq), "--global-batch", str(batch), "--gpus", "1,2",
        "--steps", str(steps), "--warmup", str(warmup), "--json", "--csv", str(engine.tmp / "study.csv"),
    )  # fmt: skip
    assert code == 0, err
    study = json.loads(out)
    assert study["schema"] == "rigpilot.scaling/1" and study["state"] == "completed" and study["simulated"]
    assert [p["gpus"] for p in study["points"]] == [1, 2] and [r["ranks"] for r in study["table"]] == [1, 2]
    with engine.client() as c:
        jobs = {j["id"]: j for j in c.request("jobs")["jobs"]}
        details = {p["job"]: c.request("job", job=p["job"])["job"] for p in study["points"]}
    rows = study["table"]
    for row in rows:
        job = details[row["job"]]
        assert jobs[row["job"]]["study"] == study["id"] and job["state"] == "completed"
        train, par = job["settings"]["train"], job["settings"]["parallelism"]
        assert train["seq_len"] == seq and train["micro_batch"] == study["settings"]["micro_batch"]
        replicas = par["dp_replicate"] * par["dp_shard"]
        assert train["micro_batch"] * train["grad_accum"] * replicas == batch  # the same global batch everywhere
        mine = own_tokens_per_s(Path(job["job_dir"]), warmup, batch * seq)
        assert row["tokens_per_s"] == pytest.approx(mine, rel=1e-9)
        assert row["measured_steps"] == steps - warmup
        assert row["steps_per_s"] == pytest.approx(mine / (batch * seq), rel=1e-9)
        # the prediction is the one the job itself carries from its plan
        assert row["predicted_tokens_per_s"] == job["predicted"]["tokens_per_s"]
        assert row["measured_vs_predicted"] == pytest.approx(row["tokens_per_s"] / job["predicted"]["tokens_per_s"])
    assert rows[1]["speedup"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["speedup"] / 2)
    assert any("CPU ranks" in n for n in study["notes"]) and any("for real GPUs" in n for n in study["notes"])
    csv_lines = (engine.tmp / "study.csv").read_text().splitlines()
    assert csv_lines[0].split(",") == list(scaling_table.CSV_COLUMNS) and len(csv_lines) == 3
    # kept by the engine: the stored study, shown again, and listed
    assert (paths.engine_state_dir() / "scaling" / f"{study['id']}.json").is_file()
    code, out, _ = run_cli(capsys, "scaling", "--show", study["id"])
    assert code == 0 and "CPU ranks" in out and "predicted tok/s (real GPUs)" in out
    assert f"{rows[1]['tokens_per_s']:,.0f}" in out
    code, out, _ = run_cli(capsys, "jobs")
    assert out.count(f"scaling study {study['id']}") == 2
    # what the app's button does: repeat a finished training job's settings (its global batch: 2 replicas × …)
    code, out, err = run_cli(
        capsys, "scaling", "--job", rows[1]["job"], "--gpus", "1", "--steps", "3", "--detach", "--json"
    )
    assert code == 0, err
    again = json.loads(out)
    # The start answers at once, before any point is planned; a second study of the job is refused meanwhile.
    assert again["from_job"] == rows[1]["job"] and again["state"] == "planning" and again["points"] == []
    code, _, err = run_cli(capsys, "scaling", "--job", rows[1]["job"], "--gpus", "1", "--steps", "3", "--detach")
    assert code == 2 and err.startswith(f"rigpilot: error: scaling study {again['id']} of job {rows[1]['job']} is still")
    with engine.client() as c:
        again = wait_for(lambda: (s := c.request("scaling_study", study=again["id"])["study"])["state"] == "running" and s,
                         60, what="the study's job to be submitted")  # fmt: skip
    assert {k: again["settings"][k] for k in ("global_batch", "seq_len", "method", "precision")} == {
        "global_batch": batch,
        "seq_len": seq,
        "method": "scratch",
        "precision": "fp32",
    }
    code, out, err = run_cli(capsys, "scaling", "--cancel", again["id"])
    assert code == 0, err
    assert re.search(rf"^scaling study {again['id']}: .*\(cancelled\)$", out, re.M), out
    assert re.search(r"^1 GPU \(job \w+\): cancelled$", out, re.M), out
    with engine.client() as c:
        assert c.request("job", job=again["points"][0]["job"])["job"]["state"] == "cancelled"
        listed = c.request("scaling_studies", job=rows[1]["job"])["studies"]
    assert [(s["id"], s["state"]) for s in listed] == [(again["id"], "cancelled")]
    code, _, err = run_cli(capsys, "scaling", "--cancel", "snosuch")
    assert code == 2 and err == "rigpilot: error: no scaling study 'snosuch' (see 'rigpilot scaling --list')\n"
