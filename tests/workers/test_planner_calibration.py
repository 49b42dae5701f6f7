"""Calibration: what `rigpilot run calibrate` writes is what `rigpilot plan --calibration` and the engine's planner read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from rigpilot.engine.cli.entry import main
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.planner.calibration import MachineCalibration, apply

from support.paths import REPO
from support.planner_inputs import H100, h100_calibration


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def best_of(out: str) -> dict[str, Any]:
    return json.loads(out)["best"]


def test_a_gpu_calibration_changes_the_plan_and_says_what_was_measured(capsys, tmp_path):
    base = ["--simulate", "8x-h100-sxm", "--model", "llama-2-7b", "--task", "train"]
    rc, out, _ = plan(capsys, *base, "--json")
    assert rc == 0
    prior = json.loads(out)
    assert prior["calibration"]["state"] == "none" and prior["calibration"]["applied"] is False
    assert prior["explanation"][-1] == "Not calibrated: speeds come from spec-sheet peaks and priors (see 'Numbers used')."

    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps(h100_calibration()))
    rc, out, _ = plan(capsys, *base, "--calibration", str(cal), "--json")
    assert rc == 0
    measured = json.loads(out)
    assert measured["calibration"]["applied"] is True
    line = measured["calibration"]["line"]
    assert line == "Calibrated 2026-11-23 (measured on this machine): matmul 312 TFLOPS bf16, all-reduce 0,1,2,3,4,5,6,7: 180 GB/s."
    assert line in measured["explanation"]
    # Both measured numbers are below the priors: the same workload runs slower, and the figures say measured.
    assert measured["best"]["timing"]["tokens_per_s"] < 0.8 * prior["best"]["timing"]["tokens_per_s"]
    sources = {f["name"]: f["source"] for f in measured["best"]["timing"]["figures"]}
    assert sources.get("matmul TFLOP/s, GPU 0 (H100 80GB HBM3)") == "measured"
    assert "measured" in {f["source"] for f in measured["best"]["timing"]["figures"] if "GB/s" in f["unit"]}

    rc, out, _ = plan(capsys, *base, "--calibration", str(cal))
    assert rc == 0 and "Calibrated 2026-11-23 (measured on this machine): matmul 312 TFLOPS bf16" in out


def test_a_calibration_in_another_dtype_keeps_the_compute_prior(capsys, tmp_path):
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps(h100_calibration()))
    rc, out, _ = plan(capsys, "--simulate", "8x-h100-sxm", "--model", "llama-2-7b", "--dtype", "fp16",
                      "--calibration", str(cal), "--json")  # fmt: skip
    assert rc == 0
    d = json.loads(out)
    assert "matmul measured in bf16 only (the fp16 prior stays)" in d["calibration"]["line"]
    assert not any(f["name"].startswith("matmul TFLOP/s") for f in d["best"]["timing"]["figures"])


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{not json", "cannot read calibration"),
        ("[1, 2]", "must hold a JSON object"),
        (json.dumps({"matmul_tflops": {"0": 140}, "bus_bandwidth_gbs": {"0,1": 40}}), "not a Rigpilot calibration (no schema"),
        (json.dumps(h100_calibration(schema="rigpilot.calibration/9")), "not a Rigpilot calibration (schema"),
        (json.dumps({k: v for k, v in h100_calibration().items() if k != "machine"}), "lacks 'machine'"),
        (json.dumps(h100_calibration(matmul_tflops={"bf16": {"0": -1}})), "must be positive"),
        (json.dumps(h100_calibration(measured_at="yesterday")), "not an ISO 8601 time"),
        (json.dumps(h100_calibration(bus_bandwidth_gbs={"3": 10.0})), "needs two GPUs or more"),
    ],
)
def test_a_bad_calibration_file_is_one_line_and_exit_2(capsys, tmp_path, content, says):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    rc, out, err = plan(capsys, "--simulate", "8x-h100-sxm", "--model", "llama-2-7b", "--calibration", str(bad))
    assert rc == 2 and out == ""
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_calibration_of_other_gpus_is_refused(capsys, tmp_path):
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps(h100_calibration()))
    rc, _, err = plan(capsys, "--simulate", "4x-rtx4090", "--model", "llama-2-7b", "--calibration", str(cal))
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "not of this machine: it was measured on a machine with 8 GPUs; this one has 4" in err
    four = h100_calibration(machine={"gpus": {str(i): H100 for i in range(4)}, "gpu_count": 4})
    cal.write_text(json.dumps(four))
    rc, _, err = plan(capsys, "--simulate", "4x-rtx4090", "--model", "llama-2-7b", "--calibration", str(cal))
    assert rc == 2 and "it measured GPU 0 as H100 80GB HBM3; here GPU 0 is RTX 4090" in err


def test_the_engine_keeps_a_stale_calibration_out_instead_of_failing():
    cal = MachineCalibration.from_dict(h100_calibration())
    numbers, status = apply(cal, load_profile("4x-rtx4090"), "bf16", strict=False)
    assert numbers is None and status.state == "other-machine" and "calibrate again" in status.line
    with pytest.raises(UserError):
        apply(cal, load_profile("4x-rtx4090"), "bf16")
    assert MachineCalibration.from_dict(cal.to_dict()) == cal


@pytest.mark.slow
def test_a_real_calibrate_job_on_the_simulated_machine_is_read_labelled_and_not_applied(capsys, tmp_path):
    """The calibrate job's own output file, on CPU ranks over gloo, goes straight into `rigpilot plan`."""
    job = tmp_path / "calibrate"
    JobSpec.from_dict({"id": job.name, "kind": "calibrate", "parallelism": {"dp_replicate": 2}}).write(job)
    env = dict(os.environ, PYTHONUNBUFFERED="1", RIGPILOT_METRICS_DIR=str(job / "metrics"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "rigpilot.engine.workers", str(job)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cal = job / "output" / "calibration.json"
    assert json.loads(cal.read_text())["simulated"] is True

    base = ["--simulate", "2x-rtx3090-nvlink", "--model", "qwen2.5-1.5b", "--json"]
    rc, out, _ = plan(capsys, *base)
    prior = json.loads(out)
    rc, out, _ = plan(capsys, *base, "--calibration", str(cal))
    assert rc == 0
    d = json.loads(out)
    assert d["calibration"]["state"] == "simulated" and d["calibration"]["applied"] is False
    assert "on CPU ranks (gloo, a simulated machine): not applied to GPU predictions" in d["calibration"]["line"]
    assert d["calibration"]["line"] in d["explanation"]
    assert d["best"]["timing"] == prior["best"]["timing"]


@pytest.mark.slow
def test_the_engine_keeps_its_machines_latest_calibration_for_its_planner(tmp_path, monkeypatch):
    """A stored GPU calibration counts in the engine's plans; a finished calibrate job replaces it, labelled."""
    from rigpilot.engine import paths

    from support.engine import Engine, engine_home

    engine_home(tmp_path, monkeypatch)  # the simulated 4×RTX 4090
    gpu = h100_calibration(
        machine={"gpus": {str(i): "NVIDIA GeForce RTX 4090" for i in range(4)}, "gpu_count": 4},
        matmul_tflops={"bf16": {str(i): 90.0 for i in range(4)}}, bus_bandwidth_gbs={"0,1,2,3": 9.0},
    )  # fmt: skip
    paths.calibration_path().write_text(json.dumps(gpu))
    e = Engine(tmp_path)
    e.start()
    try:
        with e.client() as c:
            workload = {"global_batch": 8, "seq_len": 1024}
            first = c.request("plan", model="qwen2.5-0.5b", workload=workload)["result"]
            assert first["calibration"]["state"] == "applied"
            assert first["calibration"]["line"].startswith("Calibrated 2026-11-23 (measured on this machine): matmul 90 TFLOPS bf16")
            job = c.request("submit", spec={"kind": "calibrate", "gpus": [0, 1]}, cwd=str(tmp_path))["job"]
            e.wait_state(c, job["id"], "completed", "failed", timeout=120)
            assert e.job(c, job["id"])["state"] == "completed"
            stored = json.loads(paths.calibration_path().read_text())
            assert stored["simulated"] is True and set(stored["machine"]["gpus"]) == {"0", "1"}
            after = c.request("plan", model="qwen2.5-0.5b", workload=workload)["result"]
            assert after["calibration"]["state"] == "simulated" and not after["calibration"]["applied"]
            assert "not applied to GPU predictions" in after["explanation"][-1]
            assert after["best"]["timing"] != first["best"]["timing"]  # the priors again
    finally:
        e.stop()


@pytest.mark.parametrize(
    ("stored", "says"),
    [
        (None, "Not calibrated: speeds come from spec-sheet peaks and priors (see 'Numbers used')."),
        ({**h100_calibration(), "simulated": True, "device_type": "cpu", "backend": "gloo"},
         "Calibrated 2026-11-23 on CPU ranks (gloo, a simulated machine): not applied to GPU predictions."),
        (h100_calibration(),
         "Calibrated 2026-11-23 (measured on this machine): matmul 312 TFLOPS bf16, all-reduce 0,1,2,3,4,5,6,7: 180 GB/s."),
    ],
)  # fmt: skip
def test_the_planner_page_says_whether_and_when_the_machine_was_calibrated(qtbot, stored, says):
    from rigpilot.app.planner.page import PlannerPage
    from rigpilot.engine.service import planworker

    from support.gui_fakes import FakeLink

    link = FakeLink("8x-h100-sxm")
    # The engine's planner process, handed the stored calibration as the service hands it.
    link.replies["plan"] = lambda **args: planworker.plan(link.machine_obj, **args, calibration=stored)
    page = PlannerPage(link)
    qtbot.addWidget(page)
    page.show()
    link.connect_engine()
    assert page.calibration.isHidden()
    page.picker.set_model("llama-2-7b", chosen=False)
    with qtbot.waitSignal(page.sig_plan_ready, timeout=20000):
        page.plan_button.click()
    assert page.calibration.text() == says and page.calibration.isVisible()
    assert says in page.explanation.toPlainText()


def test_plan_on_the_engines_machine_reads_the_engines_stored_calibration(capsys, tmp_path, monkeypatch):
    from rigpilot.engine import paths

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    base = ["--model", "llama-2-7b", "--task", "train", "--json"]
    rc, out, _ = plan(capsys, *base)
    assert rc == 0 and json.loads(out)["calibration"]["state"] == "none"

    # What a finished calibrate job on the (simulated) machine leaves for the engine's planner.
    simulated = h100_calibration(simulated=True, device_type="cpu", backend="gloo")
    paths.calibration_path().write_text(json.dumps(simulated))
    rc, out, _ = plan(capsys, *base)
    cal = json.loads(out)["calibration"]
    assert rc == 0 and cal["state"] == "simulated" and cal["measured_at"] == "2026-11-23T20:15:00Z"

    # A machine the user names is not the engine's: its calibration is not read for it.
    rc, out, _ = plan(capsys, *base, "--simulate", "8x-h100-sxm")
    assert rc == 0 and json.loads(out)["calibration"]["state"] == "none"

    paths.calibration_path().write_text("{not json")
    rc, out, _ = plan(capsys, *base)
    cal = json.loads(out)["calibration"]
    assert rc == 0 and cal["state"] == "unreadable" and cal["line"].endswith("calibrate again.")
