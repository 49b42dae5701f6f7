"""The planner's sentences name settings, not flags (engine.schema.Words): the command line words them by flag
as it always has, and the app by the label of the control that sets them, both from the one declaration of
each setting (engine.planner.settings.PLAN_SETTINGS)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import list_profiles, load_profile
from rigpilot.engine.models import describe_model
from rigpilot.engine.planner import cluster, links
from rigpilot.engine.planner.export import slurm_script
from rigpilot.engine.planner.plan import LoraSettings, Plan, Workload
from rigpilot.engine.planner.search import SearchOptions, search
from rigpilot.engine.planner.settings import PLAN_SETTINGS, say
from rigpilot.engine.recipe import PLAIN_RECIPE
from rigpilot.engine.schema import Ref, Style, terms_of, worded

PLANNER = Path(links.__file__).parent
PROFILES = [p["id"] for p in list_profiles()]


def work(**kw: Any) -> Workload:
    base: dict[str, Any] = {"model": "m", "task": "train", "method": "full", "precision": "bf16", "seq_len": 2048,
                            "global_batch": 16, **PLAIN_RECIPE}  # fmt: skip
    return Workload(**{**base, **kw})


def app(text: str, terms: Any) -> str:
    return worded(text, terms, PLAN_SETTINGS, Style.APP)


def _named_settings() -> set[str]:
    """Every setting the planner's code names in a sentence: the first argument of each `ref(...)` call."""
    names: set[str] = set()
    for path in PLANNER.glob("*.py"):
        if path.name == "settings.py":
            continue  # where `ref` is defined
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("ref", "Ref"):
                arg = node.args[0] if node.args else None
                assert isinstance(arg, ast.Constant), f"{path.name}:{node.lineno}: name the setting literally"
                names.add(arg.value)
    return names


def test_every_setting_the_planner_names_is_declared_with_a_flag_and_a_label() -> None:
    named = _named_settings()
    assert {"seq_len", "batch", "method", "quant", "precision", "gpus", "force_tp", "nodes", "export"} <= named
    for name in named:
        s = PLAN_SETTINGS.get(name)
        assert s is not None, f"the planner names {name!r}, which no declaration in PLAN_SETTINGS has"
        assert s.flags and s.label and s.help, f"{name} needs a flag, a label and a sentence of help"


def test_a_sentence_is_the_command_lines_words_and_carries_what_it_names() -> None:
    change = say("use sequences of {n} tokens ({seq})", n=1024, seq=Ref("seq_len", 1024))
    assert change == "use sequences of 1024 tokens (--seq 1024)" and isinstance(change, str)
    assert change.terms() == {"template": "use sequences of 1024 tokens ({seq})",
                              "refs": {"seq": {"setting": "seq_len", "value": 1024}}}  # fmt: skip
    assert app(change, change.terms()) == "use sequences of 1024 tokens (Sequence length 1024)"
    # A sentence within a sentence keeps what it names; two slots of one name stay apart.
    line = say("It fits if you {change}, or {other}: {share:.0%}.", change=change, share=0.25,
               other=say("use {seq}", seq=Ref("seq_len", 512)))  # fmt: skip
    assert line == "It fits if you use sequences of 1024 tokens (--seq 1024), or use --seq 512: 25%."
    assert app(line, json.loads(json.dumps(line.terms()))) == (
        "It fits if you use sequences of 1024 tokens (Sequence length 1024), or use Sequence length 512: 25%."
    )
    # Plain text keeps its braces; copies keep the parts (dataclasses.asdict deep-copies).
    import copy

    plain = say("a {{literal}} brace and {x}", x="{seq}")
    assert plain == "a {literal} brace and {seq}" and app(plain, plain.terms()) == plain
    assert copy.deepcopy(line).terms() == line.terms() and terms_of("plain {x}") == {"template": "plain {x}", "refs": {}}


@pytest.mark.parametrize(
    ("ref", "cli", "gui"),
    [
        (Ref("gpus", [0, 1, 2, 3]), "--gpus 0,1,2,3", "GPUs 0, 1, 2, 3"),
        (Ref("quant", "4bit"), "--quant 4bit", "Weights “4-bit (NF4)”"),
        (Ref("seq_len", 1024), "--seq 1024", "Sequence length 1024"),
        (Ref("precision", "bf16"), "--dtype bf16", "Precision “bf16”"),
        (Ref("force_tp"), "--force-tp", "“Allow tensor parallelism over slow links”"),
        (Ref("offload", "off"), "--offload off", "CPU offload “Off: never”"),
        (Ref("method", "qlora"), "--method qlora", "Method “QLoRA (4-bit base)”"),
        (Ref("batch", 4), "--batch 4", "Batch 4"),
        (Ref("nodes", 2), "--nodes 2", "Nodes 2"),
        (Ref("internode"), "--internode", "Link between nodes"),
        (Ref("export", "deepspeed"), "--export deepspeed", "Export “DeepSpeed”"),
        (Ref("new_tokens"), "--new-tokens", "New tokens"),
        (Ref("tokens"), "--tokens", "Train on"),
    ],
)
def test_each_setting_in_both_styles(ref: Ref, cli: str, gui: str) -> None:
    said = say("({x})", x=ref)
    assert said == f"({cli})" and app(said, said.terms()) == f"({gui})"


def test_an_older_engines_reply_or_an_unknown_setting_falls_back_to_the_plain_sentence() -> None:
    assert app("use --seq 512", None) == "use --seq 512"
    assert app("use --seq 512", {"template": "use {x}", "refs": {"x": {"setting": "warp_drive", "value": 9}}}) == (
        "use --seq 512"
    )
    assert app("use --seq 512", {"template": "use {x}", "refs": {"x": "nonsense"}}) == "use --seq 512"


# -- the command line's words stay today's -------------------------------------------------------------------


def test_suggestions_read_as_before_on_the_command_line_and_name_controls_in_the_app() -> None:
    machine = load_profile("4x-rtx4090")
    r = search(describe_model("llama-2-13b"), machine, work(), gpus=[0, 1], options=SearchOptions(offload="off"))
    assert [s.change for s in r.suggestions if s.kind == "method"] == [
        "train LoRA adapters instead of every weight (--method lora)", "train LoRA on 4-bit weights (--method qlora)"
    ]
    gpus = search(describe_model("qwen2.5-1.5b"), machine, work(), gpus=[0], options=SearchOptions(offload="off"))
    gpus = gpus.suggestions[0]
    assert gpus.change == "use all 4 GPUs (--gpus 0,1,2,3)"
    d = gpus.to_dict()
    assert d["change"] == "use all 4 GPUs (--gpus 0,1,2,3)" and (d["setting"], d["value"]) == ("gpus", "0,1,2,3")
    assert app(d["change"], d["change_terms"]) == "use all 4 GPUs (GPUs 0, 1, 2, 3)"
    shown = r.to_dict()
    assert any(line.endswith("tensor parallelism was left out (--force-tp allows it).") for line in shown["explanation"])
    tp = next(x for x in shown["rejected"] if x["family"] == "tensor parallel")
    assert tp["reason"].endswith("; --force-tp considers it anyway")
    assert app(tp["reason"], tp["reason_terms"]).endswith("; “Allow tensor parallelism over slow links” considers it anyway")


def _refused(call: Any) -> UserError:
    with pytest.raises(UserError) as caught:
        call()
    return caught.value


REFUSALS = [
    (lambda: search(describe_model("llama-2-7b"), load_profile("1x-rtx4090"), work(task="infer", method="qlora")),
     "--method qlora is a way to train; for quantized inference use --quant int8 or --quant 4bit",
     "Method “QLoRA (4-bit base)” is a way to train; for quantized inference use Weights “8-bit (LLM.int8)” or "
     "Weights “4-bit (NF4)”"),
    (lambda: search(describe_model("llama-2-7b"), load_profile("1x-rtx4090"), work(weight_bits=4)),
     "--quant applies to inference; to train on 4-bit weights use --method qlora",
     "Weights applies to inference; to train on 4-bit weights use Method “QLoRA (4-bit base)”"),
    (lambda: search(describe_model("llama-2-7b"), load_profile("1x-rtx4090"),
                    work(method="qlora", precision="fp32", lora=LoraSettings())),
     "QLoRA computes in bf16 or fp16; use --dtype bf16", "QLoRA computes in bf16 or fp16; use Precision “bf16”"),
    (lambda: search(describe_model("llama-2-7b"), load_profile("1x-rtx4090"), work(global_batch=0)),
     "the batch (--batch) must be between 1 and 1,048,576, not 0",
     "the batch (Batch) must be between 1 and 1,048,576, not 0"),
    (lambda: search(describe_model("llama-2-7b"), load_profile("4x-rtx4090"), work(), gpus=[]),
     "no GPUs selected: give at least one index to --gpus", "no GPUs selected: give at least one index to GPUs"),
    (lambda: search(describe_model("llama-2-7b"), load_profile("4x-rtx4090"), work(), gpus=[1, 1]),
     "GPU 1 is listed twice in --gpus", "GPU 1 is listed twice in GPUs"),
    (lambda: cluster.check_nodes(0), "--nodes must be a whole number from 1 to 64 (got '0')",
     "Nodes must be a whole number from 1 to 64 (got '0')"),
    (lambda: links.GpuPerf.peak_tflops(_no_bf16_gpu(), "bf16"),
     "GPU 0 (RTX 2080 Ti) has no bf16 support; use --dtype fp16",
     "GPU 0 (RTX 2080 Ti) has no bf16 support; use Precision “fp16”"),
    (lambda: slurm_script(_two_node_plan(), nodes=3),
     "this plan spans 2 nodes; plan again with --nodes 3 to run it on 3",
     "this plan spans 2 nodes; plan again with Nodes 3 to run it on 3"),
]  # fmt: skip


def _no_bf16_gpu() -> Any:
    class Turing:
        index, short_name, peak = 0, "RTX 2080 Ti", {"fp16": 100.0}

    return Turing()


def _two_node_plan() -> Plan:
    r = search(describe_model("llama-2-7b"), load_profile("8x-h100-sxm"), work(global_batch=64),
               options=SearchOptions(nodes=2, internode="ndr", runners_up=0))  # fmt: skip
    best = next(p for p in [r.best, *r.runners_up] if p is not None and p.parallelism.nodes == 2)
    return best


@pytest.mark.parametrize(("call", "cli", "gui"), REFUSALS)
def test_a_refusal_reads_as_before_and_carries_its_terms_through_json(call: Any, cli: str, gui: str) -> None:
    e = _refused(call)
    assert str(e) == cli
    terms = json.loads(json.dumps(e.fields["terms"]))  # as the engine's error reply carries it
    assert app(str(e), terms) == gui
    assert worded(str(e), terms, PLAN_SETTINGS, Style.CLI) == cli


def test_an_unknown_internode_link_names_the_setting() -> None:
    e = _refused(lambda: cluster.node_link("fast"))
    assert str(e).startswith("--internode takes one of 10gbe")
    assert app(str(e), e.fields["terms"]).startswith("Link between nodes takes one of 10gbe")


# -- a sweep: no flag in any sentence the app shows -----------------------------------------------------------

SWEEP = [
    ("llama-2-7b", {}, {}),
    ("llama-2-13b", {}, {"offload": "off"}),
    ("qwen2.5-14b", {"task": "infer", "seq_len": 8192, "new_tokens": 256, "global_batch": 32}, {}),
    ("llama-2-7b", {"method": "lora", "lora": LoraSettings()}, {"force_tp": True}),
]


def _app_sentences(d: dict[str, Any]) -> list[tuple[str, str]]:
    """(command line, app) for every sentence of a search's JSON that may name a setting."""
    out = list(zip(d["explanation"], [app(t, terms) for t, terms in zip(d["explanation"], d["explanation_terms"],
                                                                         strict=True)], strict=True))  # fmt: skip
    out += [(x["reason"], app(x["reason"], x["reason_terms"])) for x in d["rejected"]]
    out += [(s["change"], app(s["change"], s["change_terms"])) for s in d["suggestions"]]
    return out


@pytest.mark.parametrize("profile", PROFILES)
def test_no_sentence_the_app_shows_names_a_flag(profile: str) -> None:
    machine = load_profile(profile)
    flagged = 0
    for model, kw, opts in SWEEP:
        gpus = [g.index for g in machine.gpus][:1] if len(machine.gpus) > 1 and not kw else None
        d = json.loads(json.dumps(search(describe_model(model), machine, work(**kw), gpus=gpus,
                                         options=SearchOptions(**opts)).to_dict()))  # fmt: skip
        for cli, shown in _app_sentences(d):
            assert "--" not in shown, f"{profile}, {model}: {shown}"
            # The terms say the same as the command line's sentence, flag for flag.
            flagged += "--" in cli
        lines = d["explanation"]
        assert [worded(t, x, PLAN_SETTINGS, Style.CLI) for t, x in zip(lines, d["explanation_terms"], strict=True)] == lines
    assert flagged, f"the sweep on {profile} never named a setting: it tests nothing"


def test_each_setting_the_planner_names_is_the_plan_option_of_its_flag() -> None:
    """The flag a sentence shows is the `rigpilot plan` option that sets it, read into the setting's name."""
    import argparse

    from rigpilot.engine.cli.entry import build_parser

    plan = next(a.choices["plan"] for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    by_flag = {f: a for a in plan._actions for f in a.option_strings}  # a test may read argparse's insides
    for name, s in PLAN_SETTINGS.items():
        for flag in s.flags:
            assert flag in by_flag and by_flag[flag].dest == name, f"{flag} does not set {name} in `rigpilot plan`"
        if s.choices is not None and by_flag[s.flags[0]].choices is not None:
            assert tuple(by_flag[s.flags[0]].choices) == s.choices
