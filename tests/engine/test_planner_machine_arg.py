"""The engine's `plan` request for another machine (`machine`: a simulated profile's id or a machine description).

The planner process checks the machine, plans for it without this machine's calibration, and answers bad
input in one line.
"""

from __future__ import annotations

import json

import pytest

from rigpilot.engine.api import protocol
from rigpilot.engine.api.client import EngineError
from rigpilot.engine.hardware.importers import import_machine
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.service import planworker

from support.planner_inputs import PLAIN_FLAGS, h100_calibration

SMI_Q = "case21_smiq_4xA100_sxm4_80gb_nvidia-smi-q.txt"
TOPO_ONLY = "case08_4xRTX6000Ada_dual_socket_genoa_4nics.txt"
WORK = {"method": "lora", "seq_len": 1024, "global_batch": 8}


def answer(here, **request) -> dict:
    """What the planner process writes back for one request line."""
    return planworker._answer(here, json.dumps({"model": "llama-2-7b", "workload": WORK, **request}).encode())


def test_a_profile_or_an_imported_machine_is_planned_for_instead_of_this_one(smi_data):
    here = load_profile("1x-rtx4090")
    other = answer(here, machine="8x-h100-sxm")["result"]
    assert other["gpu_indices"] == list(range(8)) and "H100" in other["explanation"][0]
    imported = import_machine(smi_data / SMI_Q).to_dict()
    result = answer(here, machine=imported)["result"]
    assert result["gpu_indices"] == [0, 1, 2, 3] and "A100" in result["explanation"][0]
    assert answer(here)["result"]["gpu_indices"] == [0]  # without it: this machine


def test_this_machines_calibration_applies_to_this_machine_only():
    here = load_profile("8x-h100-sxm")
    own = answer(here, calibration=h100_calibration())["result"]
    assert own["calibration"]["applied"] is True
    # The same GPUs as a profile chosen in the Planner: another machine, so nothing measured here applies.
    other = answer(here, calibration=h100_calibration(), machine="8x-h100-sxm")["result"]
    assert other["calibration"]["applied"] is False and other["calibration"]["state"] == "none"
    assert other["best"]["timing"]["tokens_per_s"] != own["best"]["timing"]["tokens_per_s"]


@pytest.mark.parametrize(
    ("machine", "code", "says"),
    [
        ("9x-imaginary", "user_error", "unknown simulated profile '9x-imaginary'; known profiles: 1x-rtx4090"),
        ("../../etc/passwd", "user_error", "unknown simulated profile '../../etc/passwd'"),
        (7, "invalid", "plan.machine: expected a simulated profile's id or a machine description"),
        ({}, "invalid", "plan.machine.source: expected one of nvml, simulated, imported"),
        ({"source": "imported", "gpus": []}, "invalid", "plan.machine.gpus: expected a list of at least one GPU"),
        ({"source": "imported", "gpus": [{"index": 0}]}, "invalid", "plan.machine.gpus[0]: missing 'name'"),
        ({"source": "imported", "gpus": [{"index": 0, "name": "A100", "memory_total": "80G"}]}, "invalid",
         "plan.machine.gpus[0].memory_total: expected an integer or null, got a string"),
        ({"source": "imported", "host": [], "gpus": [{"index": 0, "name": "A100", "memory_total": 2**36}]},
         "invalid", "plan.machine.host: expected an object, got a list"),
        ({"source": "imported", "gpus": [{"index": 0, "name": "A100", "memory_total": 2**36}] * 2}, "invalid",
         "plan.machine.gpus: GPU indices must be distinct and not negative"),
        ({"source": "imported", "gpus": [{"index": 0, "name": "A100", "memory_total": 2**36}],
          "pairs": [{"a": 0, "b": 1, "pcie": "WARP"}]}, "invalid", "plan.machine.pairs[0].pcie: unknown value 'WARP'"),
        ({"source": "imported", "gpus": [{"index": 0, "name": "A100", "memory_total": 2**36}], "gpu": 1},
         "invalid", "plan.machine: unknown field 'gpu'"),
    ],
)  # fmt: skip
def test_bad_machine_input_is_one_line(machine, code, says):
    error = answer(load_profile("4x-rtx4090"), machine=machine)["error"]
    assert error["code"] == code and error["message"].startswith(says) and "\n" not in error["message"]


def test_a_model_inside_the_workload_is_refused_in_one_line():
    # Found by the fuzz test: it reached Workload(model=..., **workload) twice and logged a traceback.
    error = answer(load_profile("4x-rtx4090"), workload={**WORK, "model": "gpt2"})["error"]
    assert error["code"] == "invalid" and error["message"].startswith("plan.workload.model: ")


def test_gpus_without_a_known_memory_are_refused_with_what_to_import(smi_data):
    error = answer(load_profile("4x-rtx4090"), machine=import_machine(smi_data / TOPO_ONLY).to_dict())["error"]
    assert error["code"] == "user_error" and "\n" not in error["message"]
    assert error["message"].startswith("the memory of GPU 0, 1, 2, 3 on imported: ")
    assert "import that machine's `nvidia-smi -q` output too" in error["message"]


def test_the_engine_plans_for_the_machine_a_request_names(engine, smi_data):
    engine.start()
    with engine.client() as c:
        result = c.request("plan", model="qwen2.5-0.5b", workload=WORK, machine="8x-a100-pcie")["result"]
        assert result["gpu_indices"] == list(range(8))
        imported = import_machine(smi_data / SMI_Q).to_dict()
        assert c.request("plan", model="qwen2.5-0.5b", workload=WORK, machine=imported)["result"]["gpu_indices"] == [
            0, 1, 2, 3,
        ]  # fmt: skip
        with pytest.raises(EngineError) as e:
            c.request("plan", model="qwen2.5-0.5b", machine={"source": "imported", "gpus": []})
        assert (
            e.value.code == protocol.INVALID
            and str(e.value) == "plan.machine.gpus: expected a list of at least one GPU"
        )
        with pytest.raises(EngineError) as e:
            c.request("plan", model="qwen2.5-0.5b", machine="x" * 2000)
        assert e.value.code == protocol.INVALID and str(e.value).startswith("plan.machine: expected")
        # The service and its planner go on: this machine, as before.
        assert c.request("plan", model="qwen2.5-0.5b", workload=WORK)["result"]["gpu_indices"] == [0, 1, 2, 3]


def test_cpu_offload_on_off_auto_from_the_command_line(capsys):
    """The Planner's CPU offload choice is SearchOptions.offload; `rigpilot plan --offload` is the same knob."""
    from rigpilot.engine.cli.entry import main

    # The plain recipe pinned: with the recipe left to it the planner fits 7B in pure bf16 without offload.
    base = ["plan", "--simulate", "4x-rtx4090", "--model", "llama-2-7b", "--task", "train", "--json", *PLAIN_FLAGS]
    assert main([*base]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["best"]["parallelism"]["offload_params"]  # full 7B in mixed precision on 24 GB cards: only offloaded
    assert main([*base, "--offload", "off"]) == 1  # nothing fits: the exit status says so
    off = json.loads(capsys.readouterr().out)
    assert (
        off["best"] is None
        and {"family": "offload", "reason": "CPU offload is turned off"}.items()
        <= next(r for r in off["rejected"] if r["family"] == "offload").items()
    )
    assert main(["plan", "--simulate", "8x-h100-sxm", "--model", "qwen2.5-0.5b", "--json", "--offload", "on"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["best"]["parallelism"]["offload_params"]  # fits without, offloads because asked
    assert main(["plan", "--simulate", "8x-h100-sxm", "--model", "qwen2.5-0.5b", "--json"]) == 0
    assert not json.loads(capsys.readouterr().out)["best"]["parallelism"]["offload_params"]
