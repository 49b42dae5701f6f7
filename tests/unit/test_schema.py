"""The settings schema (engine.schema, declared on engine.jobspec.spec's fields): one declaration per setting,
and the command line, the engine's check, the socket's bounds and the wizard's preview all made from it."""

from __future__ import annotations

import argparse
import dataclasses
import shlex

import pytest

from rigpilot.engine import schema
from rigpilot.engine.api.protocol import ProtocolError
from rigpilot.engine.cli import commands
from rigpilot.engine.cli.entry import build_parser
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs import limits
from rigpilot.engine.jobspec.spec import (
    INFER_SETTINGS,
    JOB_SETTINGS,
    TRAIN_SETTINGS,
    InferSettings,
    JobSpec,
    TrainSettings,
)
from rigpilot.engine.schema import Choice, Range, declared, setting
from rigpilot.engine.service.requests import parse_request

# Fields that are not the user's to set: the engine writes them.
ENGINE_WRITTEN = {"infer.backend_reason"}
# `rigpilot run` options that are not job settings of TrainSettings/InferSettings/JobSpec: how to run the
# job (detach, SLURM, nodes), the model and plan, and the Layout's degrees (engine.layout owns those).
NOT_SETTINGS = {
    "-h", "--help", "--detach", "--json", "--env", "--nodes", "--shared-dir", "--slurm", "--partition", "--account",
    "--time", "--login", "--model", "--trust-remote-code", "--plan", "--check", "--dp", "--fsdp", "--tp", "--pp",
    "--pp-microbatches", "--pp-schedule", "--sequence-parallel", "--cpu-offload",
}  # fmt: skip


def _kind_parser(kind: str) -> argparse.ArgumentParser:
    return _sub(_sub(build_parser(), "run"), kind)


def _sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # a test may read argparse's insides; the product does not
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError(name)


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


def test_every_user_setting_of_a_job_is_declared() -> None:
    for cls, section, settings in ((TrainSettings, "train", TRAIN_SETTINGS), (InferSettings, "infer", INFER_SETTINGS)):
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            assert f.name in settings or key in ENGINE_WRITTEN, f"{key} has no declaration (engine.schema.setting)"
    for s in schema.iter_settings(TRAIN_SETTINGS, INFER_SETTINGS, JOB_SETTINGS):
        assert s.label and s.help, f"{s.key} needs a label and a sentence of help"
        if s.default is not None and s.bound is not None and not isinstance(s.default, list):
            assert s.bound.holds(s.default), f"{s.key}'s default {s.default!r} is outside {s.bound.text()}"


@pytest.mark.parametrize("kind, sections", [("train", (TRAIN_SETTINGS, JOB_SETTINGS)),
                                            ("infer", (INFER_SETTINGS, JOB_SETTINGS))])  # fmt: skip
def test_every_setting_flag_of_run_comes_from_a_declaration(kind: str, sections: tuple) -> None:
    declared_flags = {f for group in sections for s in group.values() for f in s.flags}
    parser_flags = {f for a in _kind_parser(kind)._actions for f in a.option_strings}
    assert parser_flags - NOT_SETTINGS == declared_flags


def test_a_micro_batch_past_its_range_is_refused_by_the_cli_in_the_engines_words(capsys) -> None:
    """The drift issue 27 found: argparse took --micro-batch 100000 and only the engine refused it."""
    err = _refusal(capsys, ["run", "train", "--model", "tiny", "--micro-batch", "100000"])
    spec = JobSpec(id="x", kind="train", train=TrainSettings(micro_batch=100000))
    with pytest.raises(UserError) as caught:
        limits.check_job_settings(spec)
    assert str(caught.value) in err and "--micro-batch" in err
    assert caught.value.reason == "out_of_range"
    assert caught.value.fields == {"setting": "train.micro_batch", "value": 100000, "lo": 1, "hi": 65536}
    # And the shared workload options of `scaling` take the same declaration.
    assert str(caught.value) in _refusal(capsys, ["scaling", "--model", "tiny", "--micro-batch", "100000"])


def test_scaling_start_takes_the_jobs_own_micro_batch_range() -> None:
    """The other drift: the socket's scaling_start accepted micro-batches up to 1,048,576."""
    hi = int(TRAIN_SETTINGS["micro_batch"].bound.hi)
    ok = {"v": 1, "id": 1, "type": "scaling_start", "args": {"gpus": [1], "model": "tiny", "micro_batch": hi}}
    parse_request(ok)
    for bad in (hi + 1, 1 << 20, 0):
        with pytest.raises(ProtocolError, match=r"micro_batch: expected an integer in \[1, 65536\]"):
            parse_request({**ok, "args": {**ok["args"], "micro_batch": bad}})
    with pytest.raises(ProtocolError, match="one of fp32, bf16, fp16"):
        parse_request({**ok, "args": {**ok["args"], "precision": "fp8"}})


def test_refusals_carry_a_reason_and_the_facts() -> None:
    with pytest.raises(UserError) as caught:
        limits.check_job_settings(JobSpec(id="x", kind="train", train=TrainSettings(precision="fp8")))
    assert caught.value.reason == "not_a_choice"
    assert caught.value.fields == {"setting": "train.precision", "value": "fp8", "choices": ["fp32", "bf16", "fp16"]}
    with pytest.raises(UserError) as caught:
        limits.check_job_settings(JobSpec(id="x", kind="infer", infer=InferSettings(top_p=0.0)))
    assert caught.value.reason == "out_of_range" and caught.value.fields["setting"] == "infer.top_p"
    with pytest.raises(UserError) as caught:
        limits.check_job_settings(JobSpec(id="x", kind="train", max_restarts=101))
    assert caught.value.fields == {"setting": "max_restarts", "value": 101, "lo": 0, "hi": 100}


def test_a_switch_in_a_conflict_reads_as_its_flag_not_as_true_or_false() -> None:
    """`--fp8 needs --precision bf16`, never `--fp8 True needs …`: the CLI words the code and fields."""
    from rigpilot.engine.cli import refusals

    error = TRAIN_SETTINGS["fp8"].conflict(TrainSettings(fp8=True, precision="fp16"))
    assert error is not None and error.reason == "conflicting_settings"
    assert str(error) == "fp8 needs precision=bf16 (it is fp16)"  # the engine's own sentence, for other clients
    assert refusals.words(error) == "--fp8 needs --precision bf16 (it is fp16)"
    assert TRAIN_SETTINGS["fp8"].conflict(TrainSettings(fp8=False, precision="fp16")) is None
    # A switch that is off, and a switch on the other side, in the words the flag declaration allows (no --no- form).
    assert schema.flag_phrase(TRAIN_SETTINGS["fp8"], False) == "without --fp8"
    assert schema.flag_phrase(TRAIN_SETTINGS["fp8"], "True") == "--fp8"  # `requires` declares values as strings
    off = UserError("x", reason="conflicting_settings", setting="train.precision", value="fp16", other="train.fp8",
                    needs="False", found=True)  # fmt: skip
    assert refusals.words(off) == "--precision fp16 needs without --fp8 (it is on)"
    # Settings with values keep their flag and value.
    mw = TRAIN_SETTINGS["master_weights"].conflict(TrainSettings(master_weights="bf16", precision="fp32"))
    assert mw is not None and refusals.words(mw) == "--master-weights bf16 needs --precision bf16 (it is fp32)"


def test_the_cli_gives_the_spec_the_settings_it_was_given_and_no_others() -> None:
    args = build_parser().parse_args(shlex.split(
        "run train --model tiny --data a.txt --data b.txt --seq 64 --micro-batch 2 --lr 1e-3 --checkpointing full "
        "--train-on-prompts --gpus 0,1 --name run1 --max-restarts 2"
    ))  # fmt: skip
    spec = commands.build_spec(args)
    assert spec == {
        "kind": "train", "name": "run1", "gpus": [0, 1], "max_restarts": 2, "model": "tiny",
        "train": {"dataset": ["a.txt", "b.txt"], "seq_len": 64, "micro_batch": 2, "learning_rate": 1e-3,
                  "activation_checkpointing": "full", "train_on_prompts": True},
    }  # fmt: skip
    JobSpec.from_dict({"id": "x", **spec})  # job.json reads what the CLI sends
    args = build_parser().parse_args(["run", "infer", "--model", "tiny", "--prompt", "hi", "--backend", "vllm"])
    assert commands.build_spec(args)["infer"] == {"prompts": ["hi"], "backend": "vllm"}


def test_the_value_lists_are_the_enums() -> None:
    """job.json and the wire carry the enums' strings: the spec's defaults are plain strings equal to them."""
    assert TrainSettings().precision == "bf16" and type(TrainSettings().precision) is str
    assert tuple(schema.Precision) == ("fp32", "bf16", "fp16")
    assert [str(s) for s in schema.JobState] == [
        "queued", "starting", "running", "completed", "failed", "cancelled", "interrupted"
    ]
    assert TRAIN_SETTINGS["method"].bound == Choice(("full", "lora", "qlora", "scratch"))


@dataclasses.dataclass
class _WithOptimizer(TrainSettings):
    """A training setting added by its declaration alone (issue 27's test of the schema)."""

    optimizer: str = setting("adamw", flags="--optimizer", choices=("adamw", "sgd"), label="Optimizer",
                             help="the optimizer")  # fmt: skip
    beta2: float = setting(0.95, range=Range(0, 1, hi_open=True), label="Adam beta2", help="second-moment decay")


def test_a_new_setting_needs_only_its_declaration(monkeypatch, capsys) -> None:
    from rigpilot.app.wizard import state as wizard_state

    extended = declared(_WithOptimizer, "train")
    # The tables the CLI, the engine's check and the wizard read are made from the declarations at import;
    # here they are made again from the extended class, as a new field on TrainSettings would make them.
    monkeypatch.setattr(commands, "TRAIN_SETTINGS", extended)
    monkeypatch.setattr(wizard_state, "TRAIN_SETTINGS", extended)
    monkeypatch.setattr(limits, "TRAIN_SETTINGS", extended)

    args = build_parser().parse_args(["run", "train", "--model", "tiny", "--optimizer", "sgd"])
    assert commands.build_spec(args)["train"] == {"optimizer": "sgd"}
    assert "--optimizer: train setting optimizer='lion': must be one of adamw, sgd" in _refusal(
        capsys, ["run", "train", "--optimizer", "lion"]
    )

    spec = JobSpec(id="x", kind="train", train=_WithOptimizer(beta2=1.5))
    with pytest.raises(UserError) as caught:
        limits.check_job_settings(spec)
    assert caught.value.fields["setting"] == "train.beta2" and caught.value.reason == "out_of_range"

    assert schema.flag_words(extended["optimizer"], "sgd") == ["--optimizer", "sgd"]
    assert schema.flag_words(extended["beta2"], 0.9) is None  # no flag: the wizard names it in words
    assert schema.setting_words(extended["beta2"], 0.9) == "Adam beta2: 0.9"
    words: list[str] = []
    notes: list[str] = []
    wizard_state._setting_words(extended, _WithOptimizer(optimizer="sgd", beta2=0.9), words, notes)
    assert " ".join(words).count("--optimizer sgd") == 1
    assert notes == ["Adam beta2: 0.9"]
