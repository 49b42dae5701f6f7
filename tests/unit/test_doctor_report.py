"""The machine check's report (engine/hardware/doctor.py) and its host half (doctor_host.py), without a job:
findings from figures, the NCCL action, the wording of every code, refusals of a bad file, and NVML against a
real `nvidia-smi -q` text read through the importer a user's file goes through."""

import copy
import dataclasses

import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware import doctor as d
from rigpilot.engine.hardware.doctor_host import compare_gpus, complete, health_check, identity, smi_check
from rigpilot.engine.hardware.importers.smi_query import parse_query_text
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.hardware.telemetry import GpuSample

from support.paths import SMI_DATA


def check(name, status="ok", **figures):
    return d.Check(name, status, 0.1, figures)


def report(**kw) -> d.DoctorReport:
    r = d.DoctorReport(measured_at="2026-11-29T05:00:00Z", simulated=False, device_type="cuda", backend="nccl")
    for k, v in kw.items():
        setattr(r, k, v)
    r.findings = d.findings_of(r)
    r.actions = d.actions_of(r.findings)
    return r


def test_figures_become_findings_and_the_broken_pairs_lose_p2p():
    r = report(
        gpus=[d.GpuResult(0, "NVIDIA GeForce RTX 4090", [
            check("matmul", tflops={"bf16": 60.0, "fp32": 80.0}, peak_tflops={"bf16": 165.2, "fp32": 82.6}),
            check("memory_bandwidth", gbs=900.0, peak_gbs=1008.0),
            check("health", "fail", ecc_uncorrected=2, xid=None, throttle=["hw_thermal_slowdown"]),
        ])],
        pairs=[
            d.PairResult((0, 1), "PHB", "ok", [check("p2p_copy", "fail", correct=False, mismatched=12, bytes=1024)]),
            d.PairResult((0, 2), "PIX", "ok", [check("p2p_copy", correct=True, gbs=6.0, host_gbs=11.0)]),
            d.PairResult((1, 2), "SYS", "unsupported", [check("all_reduce", "timeout", deadline_s=30)]),
        ],
    )
    found = {(f.code, tuple(f.gpus)): f for f in r.findings}
    assert set(found) == {("matmul_slow", (0,)), ("ecc_errors", (0,)), ("throttled", (0,)), ("p2p_corrupt", (0, 1)),
                          ("p2p_slower_than_host", (0, 2)), ("all_reduce_hung", (1, 2)),
                          ("p2p_not_supported", (1, 2))}  # fmt: skip
    assert found[("matmul_slow", (0,))].fields["dtype"] == "bf16"  # fp32 at 97% of its peak is fine
    assert [f.severity for f in r.findings] == sorted((f.severity for f in r.findings), key=d.SEVERITIES.index)
    assert r.worst == "fail"
    assert r.actions["pairs"] == [[0, 1], [0, 2], [1, 2]]
    assert d.p2p_off_pairs(r) == {(0, 1), (0, 2), (1, 2)}
    env, why = d.nccl_env_for(r, [0, 1])
    assert env == {"NCCL_P2P_DISABLE": "1"} and [f.code for f in why] == ["p2p_corrupt"]
    assert d.nccl_env_for(r, [3]) == ({}, []) and d.nccl_env_for(None, [0, 1]) == ({}, [])


def test_a_simulated_report_never_calls_the_cpu_slow():
    r = report(simulated=True, gpus=[d.GpuResult(0, "RTX 4090", [
        check("matmul", tflops={"fp32": 0.01}, peak_tflops={"fp32": 82.6}), check("memory_bandwidth", gbs=5, peak_gbs=1008),
    ])])  # fmt: skip
    assert r.findings == [] and r.worst == "ok" and r.actions == {}


def test_every_code_is_worded_without_gaps():
    fields = {"link": "PHB", "gbs": 5.0, "host_gbs": 11.0, "deadline_s": 30, "pairs": [[0, 1]], "dtype": "bf16",
              "tflops": 60.0, "peak_tflops": 165.0, "peak_gbs": 1008.0, "field": "power_limit_w", "nvml": 450,
              "smi": 400, "count": 2, "xid": 79, "reasons": ["hw_slowdown"], "cuda_torch": "12.8",
              "cuda_driver": "12.4", "driver": "550.90", "check": "all_reduce", "error": "gone"}  # fmt: skip
    codes = ["p2p_corrupt", "p2p_slower_than_host", "all_reduce_hung", "p2p_copy_hung", "p2p_not_supported", "matmul_slow",
             "memory_slow", "nvml_smi_disagree", "ecc_errors", "xid", "throttled", "cuda_too_new", "check_failed"]
    for code in codes:
        words = d.describe(d.Finding(code, "warn", [0, 1], fields))
        assert words and "None" not in words and "?" not in words and not words.startswith(code), (code, words)
    everywhere = d.Finding("p2p_not_supported", "info", [0, 1, 2], {"pairs": [[0, 1], [0, 2], [1, 2]], "all": True})
    assert "between any of the GPUs" in d.describe(everywhere)


def test_round_trip_and_refusals_of_a_bad_report():
    r = report(pairs=[d.PairResult((0, 1), "NV4", "ok", [check("all_reduce", busbw_gbs=150.0)])], complete=False,
               stopped=d.Finding("all_reduce_hung", "fail", [0, 1], {"deadline_s": 30}))  # fmt: skip
    again = d.DoctorReport.from_dict(r.to_dict())
    assert again.to_dict() == r.to_dict()
    good = r.to_dict()
    for mutate, words in [
        (lambda x: x.update(schema="rigpilot.calibration/1"), "is not a Rigpilot machine check"),
        (lambda x: x.pop("measured_at"), "lacks 'measured_at'"),
        (lambda x: x.update(simulated="yes"), "simulated must be true or false"),
        (lambda x: x["pairs"][0].update(gpus=[1, 1]), "a pair names two GPUs"),
        (lambda x: x["pairs"][0]["checks"][0].update(status="great"), "has status 'great'"),
        (lambda x: x["findings"].append({"code": "x", "severity": "loud"}), "severity 'loud'"),
        (lambda x: x.update(gpus="all"), "malformed"),
    ]:
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(UserError, match=words):
            d.DoctorReport.from_dict(bad, "the file")
    with pytest.raises(UserError, match="must hold a JSON object"):
        d.DoctorReport.from_dict([1, 2], "the file")


def test_nvml_against_nvidia_smi_field_by_field():
    text = (SMI_DATA / "case22_smiq_8xH100_sxm_80gb_nvidia-smi-q.txt").read_text()
    smi = parse_query_text(text, origin="nvidia-smi -q")
    nvml = copy.deepcopy(smi.gpus[3])
    assert compare_gpus(nvml, smi.gpus[3]) == []
    ok = smi_check(nvml, smi, None)
    assert ok.status == "ok" and "memory_total" in ok.figures["compared"]
    nvml.power_limit_w = (nvml.power_limit_w or 700) + 50
    differs = smi_check(nvml, smi, None)
    assert differs.status == "warn" and [x["field"] for x in differs.figures["disagree"]] == ["power_limit_w"]
    assert smi_check(nvml, None, "no_nvidia_smi").status == "skipped"


def test_health_and_the_host_half_on_a_simulated_machine():
    machine = load_profile("4x-rtx4090")
    assert identity(machine) == ("simulated:4x-rtx4090", None)
    assert health_check(GpuSample(index=0, health="ok", throttle_reasons=["idle"])).status == "ok"
    assert health_check(GpuSample(index=0, health="ok", ecc_uncorrected=3)).status == "fail"
    assert health_check(None).status == "skipped"
    ranks = d.DoctorReport(measured_at="2026-11-29T05:00:00Z", simulated=True, device_type="cpu", backend="gloo",
                           gpus=[d.GpuResult(i, "x86_64", [check("matmul", tflops={"fp32": 0.1})]) for i in range(2)],
                           pairs=[d.PairResult((0, 1), None, "unknown", [check("p2p_copy", correct=True)])])  # fmt: skip
    done = complete(ranks, machine, [GpuSample(index=1, health="ok", ecc_uncorrected=1)], (None, "simulated"))
    assert [g.name for g in done.gpus] == [machine.gpus[0].name, machine.gpus[1].name]
    assert done.pairs[0].link == machine.pair(0, 1).topo_code and done.pairs[0].p2p_reported == "unsupported"
    assert done.machine["identity"] == "simulated:4x-rtx4090" and "simulated" in done.machine["label"]
    assert [(f.code, f.gpus) for f in done.findings if f.severity == "fail"] == [("ecc_errors", [1])]
    assert d.store_key("a", "550") != d.store_key("a", "555") != d.store_key("b", "555")
    assert dataclasses.asdict(done.gpus[0].checks[-1])["check"] == "health"


def test_the_command_line_table_of_a_gpu_report():
    from rigpilot.engine.cli.doctor import text_lines

    r = report(
        machine={"label": "lab: 2×RTX 4090"}, duration_s=41.0,
        gpus=[d.GpuResult(i, "NVIDIA GeForce RTX 4090", [
            check("matmul", tflops={"bf16": 150.0, "fp32": 80.0}, peak_tflops={"bf16": 165.2, "fp32": 82.6}),
            check("memory_bandwidth", gbs=900.0, peak_gbs=1008.0), check("nvml_vs_smi"), check("health"),
        ]) for i in range(2)],
        pairs=[d.PairResult((0, 1), "PHB", "ok", [check("p2p_copy", "fail", correct=False, mismatched=3, bytes=8,
                                                       gbs=20.0, host_gbs=12.0), check("all_reduce", busbw_gbs=18.5)])],
    )  # fmt: skip
    text = "\n".join(text_lines(r))
    assert "Machine check of lab: 2×RTX 4090" in text and "simulated" not in text
    assert "bf16 150 (91%)" in text and "900 (1,008)" in text
    assert "0–1   PHB   ok            WRONG DATA     20 (12)           18.5 GB/s" in text
    assert "Jobs on GPU pairs 0–1 run with NCCL_P2P_DISABLE=1" in text
