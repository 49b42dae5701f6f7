"""The machine check's report changes what the planner plans for (engine.planner.machine_check): a pair whose P2P
the engine turns off is planned as the host bounce jobs will take, a real check's measured figures replace the
priors (the newer of a check's and a calibration's winning per figure), and the explanation says why."""

from __future__ import annotations

import dataclasses
import json

from rigpilot.engine.hardware.machine import P2P, Machine
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.planner import machine_check
from rigpilot.engine.planner.calibration import MachineCalibration, apply_stored, newer_wins
from rigpilot.engine.service import planworker

from support.doctor_reports import clean_report, four_gpu_report

WORK = {"seq_len": 1024, "global_batch": 8}


def p2p_4090s() -> Machine:
    """The simulated 4×RTX 4090 with the driver reporting P2P between GPUs 0 and 1, as on the boxes whose copies
    then return wrong data (the profile itself has P2P off everywhere, so a check could change nothing there)."""
    m = load_profile("4x-rtx4090")
    m.pairs = [dataclasses.replace(p, p2p_read=P2P.OK, p2p_write=P2P.OK) if p.key == (0, 1) else p for p in m.pairs]
    return m


def plan(here: Machine, **request) -> dict:
    line = json.dumps({"model": "qwen2.5-0.5b", "workload": WORK, **request}).encode()
    answer = planworker._answer(here, line)
    assert "result" in answer, answer
    return answer["result"]


def bus(result: dict) -> dict[str, float]:
    return {f["name"]: f["value"] for f in result["best"]["timing"]["figures"] if f["name"].startswith("bus bandwidth")}


def test_a_corrupt_pair_is_planned_through_host_memory_and_the_explanation_says_why():
    here = p2p_4090s()
    before = plan(here, gpus=[0, 1], doctor=clean_report().to_dict())
    after = plan(here, gpus=[0, 1], doctor=four_gpu_report().to_dict())
    assert bus(before) == {"bus bandwidth, sharding group (PCIe P2P (NODE))": 17.138}
    assert bus(after) == {"bus bandwidth, sharding group (host memory (no P2P))": 10.081}
    assert after["best"]["timing"]["tokens_per_s"] < before["best"]["timing"]["tokens_per_s"]
    assert after["explanation"][-1] == (
        "Machine check of 2026-11-29 (simulated, on CPU ranks): Peer-to-peer copies between GPUs 0 and 1 over NODE "
        "returned wrong data: jobs on both run with NCCL_P2P_DISABLE=1 (traffic through host memory); this plan "
        "counts every link among GPUs 0, 1 through host memory."
    )
    assert not any("Machine check" in line for line in before["explanation"])
    # GPUs 2 and 3 hold no broken pair: their jobs keep P2P, and so does their plan.
    kept, plain = plan(here, gpus=[2, 3], doctor=four_gpu_report().to_dict()), plan(here, gpus=[2, 3])
    assert kept["best"] == plain["best"] and kept["explanation"] == plain["explanation"]


def test_the_variable_is_the_jobs_so_every_pair_of_a_job_holding_the_bad_pair_loses_p2p_and_nvlink():
    here = load_profile("4x-rtxa6000-bridged")  # NVLink bridges 0-1 and 2-3, P2P everywhere
    planned, why = machine_check.planned_machine(here, four_gpu_report(((2, 3),)), [0, 1, 2, 3])
    assert [f.code for f in why] == ["p2p_corrupt"]
    assert all(p.nvlink_count == 0 and p.p2p_read is P2P.UNSUPPORTED for p in planned.pairs)
    assert any(p.nvlink_count for p in here.pairs)  # the machine itself is left as it was
    # A job on GPUs 0 and 1 does not get the variable: their NVLink bridge stays in its plan.
    same, why = machine_check.planned_machine(here, four_gpu_report(((2, 3),)), [0, 1])
    assert same is here and why == []


def test_a_real_checks_measured_figures_are_the_calibration_shape_without_the_broken_pairs():
    report = four_gpu_report(simulated=False, pair_busbw={(0, 1): 9.0, (2, 3): 12.5}, group_busbw=7.0,
                             tflops={"bf16": 150.0, "tf32": 80.0})  # fmt: skip
    cal = machine_check.calibration_from_doctor(report)
    assert cal is not None and not cal.simulated and cal.measured_at == report.measured_at
    assert cal.matmul_tflops == {"bf16": {0: 150.0, 1: 150.0, 2: 150.0, 3: 150.0}}  # tf32 is no job's dtype
    # 0-1 and every group holding it were measured with P2P on; its jobs run with it off.
    assert cal.bus_bandwidth_gbs == {"0,2": 1.0, "0,3": 1.0, "1,2": 1.0, "1,3": 1.0, "2,3": 12.5}
    clean = machine_check.calibration_from_doctor(clean_report(simulated=False, group_busbw=7.0))
    assert clean is not None and clean.bus_bandwidth_gbs["0,1,2,3"] == 7.0
    assert machine_check.calibration_from_doctor(four_gpu_report()) is None  # simulated: the CPU's figures


def test_a_real_checks_bandwidth_replaces_the_prior_of_the_group_it_measured():
    here = load_profile("4x-rtx4090")
    report = clean_report(simulated=False, pair_busbw={(2, 3): 14.0}, measured_at="2026-11-29T04:00:00Z")
    result = plan(here, gpus=[2, 3], doctor=report.to_dict())
    assert bus(result) == {"bus bandwidth, sharding group (host memory (no P2P))": 14.0}
    assert result["calibration"]["applied"] is True
    assert result["calibration"]["line"].startswith("Machine check of 2026-11-29 (measured on this machine): ")
    assert "all-reduce 2,3: 14 GB/s" in result["calibration"]["line"]


def test_the_newer_of_a_calibration_and_a_check_wins_per_figure():
    here = load_profile("4x-rtx4090")
    stored = {
        "schema": "rigpilot.calibration/1", "measured_at": "2026-11-23T20:15:00Z", "simulated": False,
        "device_type": "cuda", "backend": "nccl", "precision": "bf16",
        "machine": {"gpus": {str(i): "NVIDIA GeForce RTX 4090" for i in range(4)}, "gpu_count": 4},
        "matmul_tflops": {"bf16": {str(i): 140.0 for i in range(4)}, "fp32": {"0": 60.0}},
        "bus_bandwidth_gbs": {"0,1,2,3": 5.0, "2,3": 11.0},
    }  # fmt: skip
    newer = machine_check.calibration_from_doctor(
        clean_report(simulated=False, pair_busbw={(2, 3): 12.5}, group_busbw=6.0, tflops={"bf16": 150.0})
    )
    assert newer is not None
    older = MachineCalibration.from_dict(stored)
    both = newer_wins(older, newer)
    assert both == newer_wins(newer, older)  # the order given does not matter, only when each was measured
    assert both.bus_bandwidth_gbs["2,3"] == 12.5 and both.bus_bandwidth_gbs["0,1,2,3"] == 6.0
    assert both.matmul_tflops == {"bf16": {0: 150.0, 1: 150.0, 2: 150.0, 3: 150.0}, "fp32": {0: 60.0}}
    # A calibration made after the check wins where it measured.
    later = MachineCalibration.from_dict({**stored, "measured_at": "2026-11-30T08:00:00Z"})
    assert newer_wins(later, newer).bus_bandwidth_gbs == {"0,1,2,3": 5.0, "2,3": 11.0, **{
        k: v for k, v in newer.bus_bandwidth_gbs.items() if k not in ("0,1,2,3", "2,3")}}  # fmt: skip
    numbers, status = apply_stored(stored, here, "bf16", checked=newer)
    assert numbers is not None and numbers.matmul_tflops[0] == 150.0 and status.applied
    assert status.line.startswith("Calibrated 2026-11-23 and machine check of 2026-11-29 (both measured on this "
                                  "machine; the newer figure of each wins): matmul 150 TFLOPS bf16")  # fmt: skip


def test_a_simulated_calibration_stays_out_while_a_real_check_counts():
    here = load_profile("4x-rtx4090")
    checked = machine_check.calibration_from_doctor(clean_report(simulated=False, tflops={"bf16": 150.0}))
    stored = {"schema": "rigpilot.calibration/1", "measured_at": "2026-11-23T20:15:00Z", "simulated": True,
              "device_type": "cpu", "backend": "gloo", "machine": {"gpus": {"0": "cpu"}},
              "matmul_tflops": {"bf16": {"0": 0.1}}}  # fmt: skip
    numbers, status = apply_stored(stored, here, "bf16", checked=checked)
    assert numbers is not None and numbers.matmul_tflops == {0: 150.0, 1: 150.0, 2: 150.0, 3: 150.0}
    assert status.applied and "on CPU ranks" in status.line and status.line.startswith("Machine check of 2026-11-29")
    _, unreadable = apply_stored({"unreadable": "calibration.json: bad JSON"}, here, "bf16", checked=checked)
    assert unreadable.applied and unreadable.line.endswith("Calibration not applied: calibration.json: bad JSON; "
                                                           "calibrate again.")  # fmt: skip


def test_a_check_of_other_gpus_or_one_that_cannot_be_read_is_said_and_left_out():
    here = load_profile("4x-rtx4090")
    other = clean_report(simulated=False, tflops={"bf16": 300.0})
    for g in other.gpus:
        g.name = "NVIDIA H100 80GB HBM3"
    used = machine_check.use(other.to_dict(), here)
    assert used.calibration is None and used.machine is here
    assert used.lines == ["Machine check of 2026-11-29 not used for speeds: it measured GPU 0 as H100 80GB HBM3; "
                          "here GPU 0 is RTX 4090; check the machine again."]  # fmt: skip
    bad = machine_check.use({"schema": "rigpilot.doctor/1"}, here)
    assert bad.machine is here and bad.lines == [
        "Machine check not used: the engine's stored machine check lacks 'simulated'; check the machine again."
    ]
    result = plan(here, doctor={"schema": "rigpilot.doctor/9"})
    assert result["explanation"][-1].startswith("Machine check not used: the engine's stored machine check is not a "
                                                "Rigpilot machine check (schema 'rigpilot.doctor/9'")  # fmt: skip


def test_another_machine_is_planned_without_this_machines_check():
    here = p2p_4090s()
    other = plan(here, machine="4x-rtx4090", doctor=four_gpu_report().to_dict())
    assert not any("Machine check" in line for line in other["explanation"])


def test_rigpilot_plan_reads_the_stored_check_it_is_handed(capsys):
    from rigpilot.engine.cli.entry import build_parser
    from rigpilot.engine.cli.plan import run_plan

    args = build_parser().parse_args(["plan", "--model", "qwen2.5-0.5b", "--gpus", "0,1", "--seq", "1024", "--json"])
    args.machine_factory = p2p_4090s
    args.stored_doctor = lambda machine: four_gpu_report().to_dict()  # what the engine's doctor_store.latest gives
    assert run_plan(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert bus(result) == {"bus bandwidth, sharding group (host memory (no P2P))": 10.081}
    assert result["explanation"][-1].startswith("Machine check of 2026-11-29 (simulated, on CPU ranks): Peer-to-peer")


def test_a_change_in_the_wizard_is_rechecked_on_the_links_the_plan_was_searched_on():
    here, report = p2p_4090s(), four_gpu_report().to_dict()
    best = plan(here, gpus=[0, 1], doctor=report)["best"]
    again = plan(here, gpus=[0, 1], doctor=report, recheck={"plan": best, "overrides": {}})["plan"]
    assert bus({"best": again}) == {"bus bandwidth, sharding group (host memory (no P2P))": 10.081}
    unchecked = plan(here, gpus=[0, 1], recheck={"plan": best, "overrides": {}})["plan"]
    assert bus({"best": unchecked}) == {"bus bandwidth, sharding group (PCIe P2P (NODE))": 17.138}
