"""The capability contract: one function decides what the engine runs, for the planner and the submission alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigpilot.engine.capability import PIPELINE_TYPES, TENSOR_PARALLEL_TYPES, why_not
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import list_profiles, load_profile
from rigpilot.engine.jobs.submission import describe, prepare
from rigpilot.engine.layout import Layout
from rigpilot.engine.models import describe_model
from rigpilot.engine.planner.plan import LoraSettings, Parallelism, Plan, Workload
from rigpilot.engine.planner.search import SearchOptions, search

from support.paths import REPO

SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"
PRESETS = ("llama-2-7b", "llama-2-13b", "llama-3-70b", "mixtral-8x7b")


def test_every_refusal_is_one_line_naming_what_to_change() -> None:
    cases = [
        (Layout(tp=2), dict(method="qlora"), "QLoRA"),
        (Layout(tp=2, cpu_offload=True), {}, "CPU offload"),
        (Layout(pp=2), dict(model_type="gpt2"), "pipeline parallel"),
        (Layout(tp=2), dict(model_type="bert"), "tensor parallel"),
        (Layout(), dict(method="dpo"), "unknown training method"),
        (Layout(), dict(kind="infer", weight_bits=4), "4-bit inference"),
    ]
    for layout, job, words in cases:
        reason = why_not(layout, **job)
        assert reason is not None and words in reason and "\n" not in reason, (layout, reason)
    for layout, job in (
        (Layout(tp=2), dict(method="lora", model_type="llama")),
        (Layout(dp_shard=4, cpu_offload=True), {}),
        (Layout(dp_replicate=2), dict(method="qlora", model_type="llama")),
        (Layout(pp=2), dict(method="scratch", model_type=PIPELINE_TYPES[0])),
        (Layout(tp=2), dict(kind="infer", model_type=TENSOR_PARALLEL_TYPES[0])),
    ):
        assert why_not(layout, **job) is None, (layout, job)
    # A degree below 1 is no layout at all: refused where it is made, before any contract is asked.
    with pytest.raises(UserError, match=r"dp_shard=0: must be in \[1, 4096\]") as e:
        Layout(dp_shard=0)
    assert e.value.reason == "out_of_range" and e.value.fields["setting"] == "parallelism.dp_shard"


def test_a_plans_layout_is_what_the_submission_maps_it_to() -> None:
    plan = Parallelism(gpu_indices=list(range(8)), dp=4, tp=2, zero_stage=3, shard_degree=2, sequence_parallel=True)
    lt = Layout.from_plan(plan)
    assert (lt.dp_replicate, lt.dp_shard, lt.tp, lt.sequence_parallel) == (2, 2, 2, True)
    offload = Layout.from_plan(Parallelism(gpu_indices=[0, 1], dp=2, zero_stage=3, shard_degree=2, offload_params=True))
    assert offload.cpu_offload and offload.dp_shard == 2
    zero2 = Layout.from_plan(Parallelism(gpu_indices=[0, 1, 2, 3], dp=4, zero_stage=2, shard_degree=4, backend="fsdp"))
    assert (zero2.dp_replicate, zero2.dp_shard, zero2.reshard_after_forward) == (1, 4, False)


# (workload, the job spec `rigpilot run … --plan FILE --check` sends for it)
TASKS = {
    "full": (dict(task="train"), {"kind": "train", "train": {"method": "scratch", "dataset": [str(SHAKESPEARE)]}}),
    "lora": (dict(task="train", method="lora", lora=LoraSettings()),
             {"kind": "train", "train": {"method": "lora", "dataset": [str(SHAKESPEARE)]}}),
    "qlora": (dict(task="train", method="qlora", lora=LoraSettings()),
              {"kind": "train", "train": {"method": "qlora", "dataset": [str(SHAKESPEARE)]}}),
    "infer": (dict(task="infer", seq_len=2048, global_batch=1, new_tokens=256),
              {"kind": "infer", "infer": {"prompts": ["Once upon a time"]}}),
}  # fmt: skip


@pytest.mark.parametrize("profile", [p["id"] for p in list_profiles()])
def test_every_best_plan_passes_the_submission_check_on_its_machine(profile: str, tmp_path: Path) -> None:
    """`rigpilot run KIND --model PRESET … --plan FILE --check`, in-process, for every task on every profile."""
    machine = load_profile(profile)
    for preset in PRESETS:
        spec_model = describe_model(preset)
        for task, (work, job) in TASKS.items():
            result = search(spec_model, machine, Workload(model=preset, **work), options=SearchOptions())
            if result.best is None:
                continue  # nothing fits at all: the planner's suggestions take over
            plan = result.to_dict()
            where = (profile, preset, task)
            assert plan["best"]["runs_here"], (*where, plan["best"]["runs_here_reason"])
            sub = prepare({**job, "model": preset}, plan, str(tmp_path), job_id="check", machine=machine, max_cpu_ranks=2)
            lines = describe(sub)
            assert lines[0].startswith(f"would run: {job['kind']}"), (*where, lines)
            p, best = sub.spec.parallelism, result.best.parallelism
            assert p.cpu_offload == (best.offload_params or best.offload_optimizer), where
            assert (p.tp, p.pp) == (best.tp, best.pp), where
            if job["kind"] == "train":
                assert sub.spec.train.seq_len == result.best.workload.seq_len, where


def test_pure_bf16_with_cpu_offload_runs_on_one_rank_only() -> None:
    """torchao's stochastically rounded step crashes on FSDP2's offloaded shards split over ranks (found by a
    2-rank job): the contract refuses that pair, so the planner never picks it; one rank still runs it."""
    from rigpilot.engine.capability import RecipeContext, recipe_why_not
    from rigpilot.engine.recipe import Recipe

    pure = Recipe(master_weights="bf16")
    two = Layout.from_dict({"dp_shard": 2, "cpu_offload": True})
    one = Layout.from_dict({"dp_shard": 1, "cpu_offload": True})
    why = recipe_why_not(pure, two, RecipeContext())
    assert why is not None and "use fp32 master weights with CPU offload" in why and "\n" not in why
    assert recipe_why_not(pure, one, RecipeContext()) is None
    assert recipe_why_not(Recipe(), two, RecipeContext()) is None


def test_the_optimizer_step_in_backward_is_refused_under_ddp_only() -> None:
    """DDP's all-reduce buckets keep every gradient to the end of backward, so stepping each weight early frees
    nothing there: the contract refuses it, while one GPU and FSDP2 (and HSDP, tensor parallel: FSDP2's) run it."""
    from rigpilot.engine.capability import RecipeContext, recipe_why_not
    from rigpilot.engine.recipe import Recipe

    oib = Recipe(optimizer_in_backward=True)
    why = recipe_why_not(oib, Layout(dp_replicate=2), RecipeContext())
    assert why is not None and "saves no memory under DDP" in why and "--fsdp" in why and "\n" not in why
    for runs in (Layout(), Layout(dp_shard=2), Layout(dp_replicate=2, dp_shard=2), Layout(tp=2),
                 Layout(dp_replicate=2, tp=2)):  # fmt: skip
        assert recipe_why_not(oib, runs, RecipeContext()) is None, runs
    assert recipe_why_not(Recipe(), Layout(dp_replicate=2), RecipeContext()) is None


def test_an_old_job_json_asking_for_the_step_in_backward_under_ddp_is_refused_at_submission(tmp_path: Path) -> None:
    """A job.json written before the refusal (DDP with the step in backward) gets the contract's one coded line."""
    spec = {
        "kind": "train", "model": "llama-2-7b", "parallelism": {"dp_replicate": 2},
        "train": {"method": "scratch", "dataset": [str(SHAKESPEARE)], "optimizer_in_backward": True, "grad_clip": 0.0},
    }  # fmt: skip
    with pytest.raises(UserError) as e:
        prepare(spec, None, str(tmp_path), job_id="old", machine=load_profile("4x-rtx4090"), max_cpu_ranks=2)
    assert e.value.reason == "recipe_refused" and "saves no memory under DDP" in str(e.value)
    assert e.value.fields == {"setting": "train.optimizer_in_backward", "value": True}
    spec["parallelism"] = {"dp_shard": 2}  # FSDP2 frees each gradient as its weight steps: it runs
    prepare(spec, None, str(tmp_path), job_id="new", machine=load_profile("4x-rtx4090"), max_cpu_ranks=2)
    del spec["parallelism"]  # no degrees given: FSDP2 over every rank rather than the refused DDP, and it says so
    sub = prepare(spec, None, str(tmp_path), job_id="auto", machine=load_profile("4x-rtx4090"), max_cpu_ranks=2)
    assert (sub.spec.parallelism.dp_replicate, sub.spec.parallelism.dp_shard) == (1, 2)
    assert any("FSDP2 over the 2 ranks" in n for n in sub.notes), sub.notes
    spec["train"]["optimizer_in_backward"] = False  # without it, the default stays plain DDP
    sub = prepare(spec, None, str(tmp_path), job_id="ddp", machine=load_profile("4x-rtx4090"), max_cpu_ranks=2)
    assert (sub.spec.parallelism.dp_replicate, sub.spec.parallelism.dp_shard) == (2, 1)


def test_the_planner_never_proposes_the_step_in_backward_under_ddp() -> None:
    """The search asks the same contract: left open, it adds the step in backward on FSDP2 or one GPU only; pinned,
    a DDP plan with it is shown as one the engine refuses, never as the best."""
    machine = load_profile("4x-rtx4090")
    for w in (Workload(model="llama-2-7b"), Workload(model="llama-2-7b", optimizer_in_backward=True)):
        d = search(describe_model("llama-2-7b"), machine, w, options=SearchOptions()).to_dict()
        assert d["best"] is not None and d["best"]["runs_here"]
        for plan in [d["best"], *d["runners_up"]]:
            lt = Layout.from_plan(Plan.from_dict(plan))
            ddp = lt.dp_replicate > 1 and lt.dp_shard == 1 and lt.tp == 1 and lt.pp == 1
            if plan["workload"]["optimizer_in_backward"] and ddp:
                assert not plan["runs_here"] and "under DDP" in plan["runs_here_reason"], plan["parallelism"]
    # What the search asks of each layout (engine.planner.plan.refusal_of): a DDP plan with it does not run, so the
    # ladder skips the technique there; an FSDP2 plan of the same GPUs runs it.
    from rigpilot.engine.planner.plan import refusal_of

    oib = Workload(model="llama-2-7b", optimizer_in_backward=True)
    ddp = Parallelism(gpu_indices=[0, 1], dp=2, zero_stage=0, backend="ddp", micro_batch=1, grad_accum=1)
    fsdp = Parallelism(gpu_indices=[0, 1], dp=2, zero_stage=3, shard_degree=2, backend="fsdp", micro_batch=1, grad_accum=1)
    assert "saves no memory under DDP" in refusal_of(ddp, oib, "llama")
    assert refusal_of(fsdp, oib, "llama") == "" and refusal_of(ddp, Workload(model="llama-2-7b"), "llama") == ""


def test_loss_chunks_of_a_model_without_an_output_head_are_refused_at_submission(tmp_path: Path) -> None:
    """The submission reads the model's config.json as the planner does (engine.models.formulas.is_decoder) and
    asks the contract, so an encoder's chunked loss is refused before a rank loads it."""
    from rigpilot.engine.capability import RecipeContext, recipe_why_not
    from rigpilot.engine.models.formulas import is_decoder
    from rigpilot.engine.recipe import Recipe

    from support.paths import minilm_folder

    chunked = Recipe(loss_chunks=4)
    why = recipe_why_not(chunked, Layout(), RecipeContext(decoder=False))
    assert why == "loss chunks apply a decoder's output head a chunk at a time; this model has none: use loss chunks 1"
    assert recipe_why_not(chunked, Layout(), RecipeContext()) is None
    assert recipe_why_not(Recipe(), Layout(), RecipeContext(decoder=False)) is None
    assert not is_decoder({"model_type": "bert", "architectures": ["BertForMaskedLM"]})
    assert is_decoder({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert not is_decoder({"model_type": "t5-like", "architectures": ["SomeEncoderModel"]})
    assert describe_model("llama-2-7b").is_decoder
    spec = {"kind": "train", "model": str(minilm_folder()),
            "train": {"dataset": [str(SHAKESPEARE)], "seq_len": 32, "loss_chunks": 4}}  # fmt: skip
    with pytest.raises(UserError) as e:
        prepare(spec, None, str(tmp_path), job_id="enc", machine=load_profile("4x-rtx4090"), max_cpu_ranks=1)
    assert str(e.value) == why and e.value.reason == "recipe_refused"
    assert e.value.fields == {"setting": "train.loss_chunks", "value": 4}
    spec["train"]["loss_chunks"] = 1
    prepare(spec, None, str(tmp_path), job_id="enc1", machine=load_profile("4x-rtx4090"), max_cpu_ranks=1)


def test_a_stored_job_json_from_before_the_refusal_runs_its_replicas_as_fsdp2(tmp_path: Path) -> None:
    """A job queued or interrupted under the engine that still ran the step in backward under DDP (spec version 1)
    resumes on the same ranks as FSDP2, which the contract runs, with a note; the file read back says version 2."""
    from rigpilot.engine.capability import RecipeContext, recipe_why_not
    from rigpilot.engine.jobspec.spec import JobSpec
    from rigpilot.engine.recipe import Recipe

    old = JobSpec.from_dict({"id": "j1", "kind": "train", "model": "llama-2-7b", "parallelism": {"dp_replicate": 4},
                             "train": {"method": "full", "dataset": [str(SHAKESPEARE)], "optimizer_in_backward": True,
                                       "grad_clip": 0.0}}).to_dict()  # fmt: skip
    old["spec_version"] = 1  # as the old engine wrote it: every field, version 1
    (tmp_path / "job.json").write_text(__import__("json").dumps(old))
    spec = JobSpec.read(tmp_path)
    assert (spec.parallelism.dp_replicate, spec.parallelism.dp_shard) == (1, 4)
    assert spec.upgrade_notes and "FSDP2 over the 4 ranks" in spec.upgrade_notes[0]
    assert recipe_why_not(Recipe.of(spec.train), spec.parallelism, RecipeContext()) is None
    assert spec.to_dict()["spec_version"] == 2 and spec.to_dict()["upgrade_notes"] == spec.upgrade_notes
    # A resume or a restart writes the job.json back: the note stays, said by every later run of the job.
    spec.resume = True
    spec.write(tmp_path)
    again = JobSpec.read(tmp_path)
    assert again.parallelism == spec.parallelism and again.upgrade_notes == spec.upgrade_notes
    assert "upgrade_notes" not in JobSpec.from_dict({**old, "spec_version": 2}).to_dict()  # unless it changed
    # The engine's own fields in a submission are ignored, not taken.
    mine = {"kind": "train", "model": "llama-2-7b", "train": {"method": "full", "dataset": [str(SHAKESPEARE)]}}
    sub = prepare({**mine, "id": "x", "spec_version": 1, "simulated": False, "upgrade_notes": ["made up"]}, None,
                  str(tmp_path), job_id="again", machine=load_profile("4x-rtx4090"), max_cpu_ranks=2)  # fmt: skip
    assert (sub.spec.upgrade_notes, sub.spec.id, sub.spec.spec_version, sub.spec.simulated) == ([], "again", 2, True)
    # Only the step in backward under DDP changes: a version-1 DDP job without it, or sharded already, reads as is.
    for train, par in ((False, {"dp_replicate": 4}), (True, {"dp_shard": 4}), (True, {"dp_replicate": 2, "tp": 2})):
        d = {**old, "parallelism": {**par}, "train": {**old["train"], "optimizer_in_backward": train}}
        kept = JobSpec.from_dict(d)
        assert kept.parallelism == Layout.from_dict(par) and not kept.upgrade_notes, par


def test_an_old_plan_with_the_step_in_backward_under_ddp_runs_as_fsdp2_with_a_note(tmp_path: Path) -> None:
    """A plan file saved when the planner could still pick DDP with the step in backward is run, not refused: the
    plan's replicas become FSDP2 shards of the same GPUs; degrees the submission gives itself stay refused."""
    machine = load_profile("4x-rtx4090")
    w = Workload(model="llama-2-7b", optimizer_in_backward=True)
    plan = search(describe_model("llama-2-7b"), machine, w, options=SearchOptions()).to_dict()["best"]
    plan["parallelism"].update(gpu_indices=[0, 1], dp=2, zero_stage=0, shard_degree=1, backend="ddp", tp=1, pp=1,
                               grad_accum=1, cpu_offload=False)  # fmt: skip
    spec = {"kind": "train", "model": "llama-2-7b", "train": {"method": "full", "dataset": [str(SHAKESPEARE)]}}
    sub = prepare(spec, plan, str(tmp_path), job_id="old-plan", machine=machine, max_cpu_ranks=2)
    assert (sub.spec.parallelism.dp_replicate, sub.spec.parallelism.dp_shard) == (1, 2)
    assert sub.spec.train is not None and sub.spec.train.optimizer_in_backward
    assert any("FSDP2 over the 2 ranks" in n for n in sub.notes), sub.notes
    with pytest.raises(UserError) as e:
        prepare({**spec, "parallelism": {"dp_replicate": 2}}, plan, str(tmp_path), job_id="own", machine=machine,
                max_cpu_ranks=2)  # fmt: skip
    assert e.value.reason == "recipe_refused"
