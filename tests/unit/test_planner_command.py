"""`rigpilot plan`: argparse wiring, output, exports, one-line user errors; and no torch import."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from rigpilot.engine.cli.entry import main
from rigpilot.engine.cli.plan import parse_gpus, register, run_plan
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import Host, Machine, Source

from support.planner_inputs import PLAIN_FLAGS


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_plan_for_four_4090s(capsys):
    rc, out, _ = run(capsys, "--simulate", "4x-rtx4090", "--model", "llama-2-7b", "--task", "train", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["schema"] == "rigpilot.plan-search/1"
    best = d["best"]
    assert best["parallelism"]["tp"] == 1
    assert best["workload"]["model"] == "llama-2-7b" and best["workload"]["seq_len"] == 2048
    assert d["rejected"] and d["explanation"]


def test_text_output(capsys):
    rc, out, _ = run(capsys, "--simulate", "2x-rtx3090-nvlink", "--model", "qwen2.5-0.5b", "--method", "lora", "--seq", "1024", "--batch", "8")
    assert rc == 0
    assert "Best plan for LoRA fine-tuning" in out and "Plans, best first" in out and "Memory per GPU" in out


def test_nothing_fits_exits_1_with_suggestions(capsys):
    rc, out, _ = run(capsys, "--simulate", "1x-rtx4090", "--model", "llama-2-7b", *PLAIN_FLAGS)
    assert rc == 1
    assert "Nothing fits" in out and "--method lora" in out


def test_export_goes_to_stdout_and_explanation_to_stderr(capsys):
    rc, out, err = run(capsys, "--simulate", "4x-rtx4090", "--model", "llama-2-7b", "--export", "deepspeed")
    assert rc == 0
    cfg = json.loads(out)
    assert cfg["zero_optimization"]["stage"] >= 1
    assert "Best plan" in err
    rc, out, _ = run(capsys, "--simulate", "8x-h100-sxm", "--model", "llama-2-7b", "--export", "torchrun")
    assert rc == 0 and "torchrun --standalone" in out
    rc, out, _ = run(capsys, "--simulate", "8x-h100-sxm", "--model", "llama-2-7b", "--export", "slurm", "--nodes", "2", "--json")
    assert rc == 0 and "#SBATCH --nodes=2" in json.loads(out)["export"]["text"]


def test_inference_with_quantization(capsys):
    rc, out, _ = run(capsys, "--simulate", "1x-rtx4090", "--model", "qwen2.5-7b", "--task", "infer", "--quant", "4bit",
                     "--seq", "8192", "--json")
    assert rc == 0
    w = json.loads(out)["best"]["workload"]
    assert w["weight_bits"] == 4 and w["task"] == "infer" and w["new_tokens"] == 256


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "./no/such/model"], "no such folder"),
        (["--model", "llama-2-7b", "--gpus", "0,9"], "GPU 9 does not exist"),
        (["--model", "llama-2-7b", "--gpus", "a,b"], "--gpus takes GPU indices"),
        (["--model", "llama-2-7b", "--seq", "100000"], "longer than llama-2-7b's context of 4096"),
        (["--model", "llama-2-7b", "--method", "qlora", "--task", "infer"], "--method qlora is a way to train"),
        (["--model", "llama-2-7b", "--quant", "4bit"], "--quant applies to inference"),
        (["--model", "llama-2-7b", "--batch", "0"], "--batch must be at least 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    rc, out, err = run(capsys, "--simulate", "4x-rtx4090", *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_zero_gpus_is_a_user_error():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["plan", "--model", "llama-2-7b"])
    args.machine_factory = lambda: Machine(source=Source.IMPORTED, host=Host(), gpus=[])
    with pytest.raises(UserError, match="no GPUs"):
        run_plan(args)
    assert args.json is False  # registered without parents, the subcommand brings its own --json


def test_parse_gpus():
    assert parse_gpus(None) is None and parse_gpus("all") is None
    assert parse_gpus("3, 1") == [3, 1]


def test_planner_never_imports_torch():
    code = (
        "import sys, rigpilot.engine.planner, rigpilot.engine.cli.plan, rigpilot.engine.planner.search, rigpilot.engine.planner.export;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
