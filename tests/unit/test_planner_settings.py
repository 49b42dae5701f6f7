"""`rigpilot plan`'s workload settings made from the job settings' declarations (engine.schema), so a range
or a list of choices is written once and the planner and `rigpilot run` refuse a value in one sentence."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rigpilot.engine import capability, schema
from rigpilot.engine.cli.entry import build_parser
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS
from rigpilot.engine.layout import Layout
from rigpilot.engine.planner.search import search

from support.planner_inputs import llama, train

# `rigpilot plan` options made from a job setting's declaration, and the setting each is.
DECLARED = {"--seq": "train.seq_len", "--dtype": "train.precision", "--precision": "train.precision"}


def _plan_parser() -> argparse.ArgumentParser:
    for action in build_parser()._actions:  # a test may read argparse's insides; the product does not
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["plan"]
    raise AssertionError("no plan subcommand")


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


def test_the_shared_plan_options_take_the_declarations_range_and_choices() -> None:
    by_flag = {f: a for a in _plan_parser()._actions for f in a.option_strings}
    for flag, key in DECLARED.items():
        s = TRAIN_SETTINGS[key.partition(".")[2]]
        action = by_flag[flag]
        assert action.dest == s.name, f"{flag} is not read as {key}"
        if s.choices is not None:
            assert tuple(action.choices) == s.choices


@pytest.mark.parametrize("value", ["0", str(2**21 + 1)])
def test_plan_refuses_an_out_of_range_seq_with_the_sentence_run_train_uses(capsys, value: str) -> None:
    plan_err = _refusal(capsys, ["plan", "--model", "tiny", "--seq", value])
    run_err = _refusal(capsys, ["run", "train", "--model", "tiny", "--seq", value])
    sentence = str(TRAIN_SETTINGS["seq_len"].refusal(int(value)))
    assert sentence in plan_err and sentence in run_err


def test_plan_keeps_its_flag_spellings_and_defaults() -> None:
    args = build_parser().parse_args(["plan", "--model", "tiny"])
    assert args.seq_len is None and args.precision is None  # left out: the planner's defaults apply
    args = build_parser().parse_args(["plan", "--model", "tiny", "--seq", "2048", "--dtype", "fp16"])
    assert (args.seq_len, args.precision) == (2048, "fp16")
    assert build_parser().parse_args(["plan", "--model", "tiny", "--precision", "fp32"]).precision == "fp32"


def test_the_chosen_backend_no_longer_shares_the_settings_enums_name() -> None:
    """engine.schema.InferBackend is the setting's values; capability's chosen backend is BackendChoice."""
    assert not hasattr(capability, "InferBackend")
    chosen = capability.choose_infer_backend("transformers", Layout(), simulated=True, worker_vllm=_never_asked)
    assert chosen == capability.BackendChoice("transformers", "transformers", "asked for")
    assert tuple(schema.InferBackend) == capability.INFER_BACKENDS


def _never_asked() -> capability.WorkerVllm:
    raise AssertionError("a backend asked for by name needs no look at the worker environment")


def test_a_suggestion_carries_the_setting_and_value_it_changes() -> None:
    """A client words a suggestion from these facts (a flag, a control's label), not by parsing `change`."""
    machine = load_profile("4x-rtx4090")
    machine = dataclasses.replace(machine, host=dataclasses.replace(machine.host, memory_total=32 * 2**30))
    spec = llama(3200, 8640, 26, 32, 32, 32000, 3_426_473_600, "open-llama-3b", ctx=2048)
    r = search(spec, machine, train(global_batch=16), gpus=[0, 1])
    first = r.suggestions[0]
    assert (first.kind, first.setting, first.value) == ("gpus", "gpus", "0,1,2,3")
    shown = first.to_dict()
    assert (shown["setting"], shown["value"]) == ("gpus", "0,1,2,3") and "--gpus 0,1,2,3" in shown["change"]
    by_dest = {a.dest: a.option_strings[0] for a in _plan_parser()._actions if a.option_strings}
    for s in r.suggestions:
        assert s.setting is None or s.setting in by_dest, f"{s.setting} is not a `rigpilot plan` option"


@pytest.mark.parametrize(("profile", "batch"), [("2x-rtx3090-nvlink", 4100), ("4x-rtx4090", 10000)])
def test_a_batch_past_the_pipelines_micro_batch_limit_still_gets_a_plan(profile: str, batch: int) -> None:
    # Pipeline candidates needing more micro-batches per step than a job may run are skipped, with the reason,
    # rather than ending the whole search (they used to raise out of the layout's range check).
    spec = llama(288, 768, 6, 6, 6, 32000, 15_000_000, "tiny", ctx=256)
    r = search(spec, load_profile(profile), train(global_batch=batch, seq_len=128))
    assert r.best is not None
    assert all(p.parallelism.pp == 1 or p.parallelism.grad_accum <= 4096 for p in [r.best, *r.runners_up])
