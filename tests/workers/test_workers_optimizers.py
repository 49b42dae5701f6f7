"""The recipe's optimizer side: 8-bit AdamW (torchao), pure bf16 with stochastic rounding (torchao), the optimizer
step in backward. Each job trains what a plain single-process loop written here trains with the same library calls
(torchao's AdamW8bit or _AdamW(bf16_stochastic_round=True) in a plain loop; one optimizer per weight stepped in its
post-accumulate-grad hook), on one rank and on DDP, FSDP2 and tensor-parallel gloo ranks; a stop and a resume
equals the unbroken run bit for bit, the 8-bit moments going through the checkpointer (DCP).

One tiny model for every job, with as few weight shapes as a Llama can have (tests/support/tiny_models.py): torchao
compiles its step once per parameter shape in every rank. Every layout takes the same global batch of 2 sequences
a step, so one plain loop serves them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rigpilot.engine.capability import RecipeContext
from rigpilot.engine.errors import UserError
from rigpilot.engine.layout import Layout
from rigpilot.engine.recipe import Recipe
from rigpilot.engine.recipe_refusal import check_recipe
from rigpilot.engine.workers.optimizers import GradNormSquares, rounding_seed

from support.paths import SHAKESPEARE
from support.reference_loop import inputs_and_labels, reference_lr
from support.tiny_models import square_tiny_llama
from support.worker_jobs import losses, notes_of, records, resume_from, run_job, write_job

STEPS = 4
TRAIN: dict[str, Any] = {
    "dataset": [str(SHAKESPEARE)],
    "method": "scratch",
    "precision": "fp32",
    "seq_len": 32,
    "grad_accum": 1,
    "max_steps": STEPS,
    "learning_rate": 3e-3,
    "warmup_steps": 1,
    "weight_decay": 0.1,
    "grad_clip": 0.0,  # the step in backward cannot clip: every case runs without, so one loop serves all
    "eval_every": 0,
    "checkpoint_every": 2,
    "eval_fraction": 0.01,
    "seed": 1234,
}
GLOBAL_BATCH = 2
PURE_BF16 = {"precision": "bf16", "master_weights": "bf16"}


def plain_loop(folder: Path, recipe: dict[str, Any]) -> dict[str, dict[int, float]]:
    """torch, transformers and torchao only: per-step loss and grad norm of `recipe` (TRAIN plus the case's)."""
    import torch.nn.functional as F
    from torchao.optim import AdamW8bit, _AdamW
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rigpilot.engine.workers.data import ShardedBatches, build_dataset, read_dataset

    r = {**TRAIN, **recipe}
    bf16 = r.get("master_weights") == "bf16"
    files, docs = read_dataset([str(SHAKESPEARE)], "text")
    data = build_dataset(
        files, docs, AutoTokenizer.from_pretrained(folder), r["seq_len"] + 1, r["eval_fraction"], r["seed"],
        train_on_prompts=False,
    )  # fmt: skip
    order = ShardedBatches(len(data.train), GLOBAL_BATCH, 0, 1, r["seed"])
    torch.manual_seed(r["seed"])
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    model.train()
    params = list(model.parameters())
    kwargs = dict(lr=r["learning_rate"], weight_decay=r["weight_decay"], betas=(0.9, 0.95))

    def optimizer(group: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if r.get("optimizer") == "adamw8bit":
            return AdamW8bit(group, **kwargs, bf16_stochastic_round=bf16)
        if bf16:
            return _AdamW(group, **kwargs, bf16_stochastic_round=True)
        return torch.optim.AdamW(group, **kwargs)

    in_backward = r.get("optimizer_in_backward", False)
    optimizers = [optimizer([p]) for p in params] if in_backward else [optimizer(params)]
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda s: reference_lr(s, r["warmup_steps"], STEPS)) for o in optimizers
    ]
    step = 0
    squares: list[torch.Tensor] = []

    def seeded(index: int) -> Any:  # the engine's seeding of the rounding bits: alike on every rank
        return rounding_seed(r["seed"], step, index, torch.device("cpu"))

    if in_backward:
        for i, (p, o) in enumerate(zip(params, optimizers, strict=True)):

            def hook(param: torch.Tensor, i: int = i, o: torch.optim.Optimizer = o) -> None:
                squares.append(param.grad.float().pow(2).sum())
                with seeded(i):
                    o.step()
                param.grad = None

            p.register_post_accumulate_grad_hook(hook)
    out: dict[str, dict[int, float]] = {"loss": {}, "grad_norm": {}}
    for step in range(STEPS):
        inputs, labels = inputs_and_labels(data.train[order.next_indices()], None)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=r["precision"] == "bf16"):
            logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
        loss.backward()
        if not in_backward:
            squares = [p.grad.float().pow(2).sum() for p in params]
            with seeded(0):
                optimizers[0].step()
            optimizers[0].zero_grad(set_to_none=True)
        out["grad_norm"][step + 1] = float(torch.stack(squares).sum().sqrt())
        squares = []
        for s in schedules:
            s.step()
        out["loss"][step + 1] = float(loss.detach())
    return out


_jobs: dict[str, Path] = {}


def job_of(root: Path, name: str, parallelism: dict[str, Any], nproc: int, **train: Any) -> Path:
    """One job per case for the module."""
    if name not in _jobs:
        model = root / "model" / "config.json"
        micro_batch = GLOBAL_BATCH // max(parallelism.get("dp_replicate", 1) * parallelism.get("dp_shard", 1), 1)
        job = write_job(
            root / name, kind="train", model=str(model), parallelism=parallelism,
            train={**TRAIN, "micro_batch": micro_batch, **train},
        )  # fmt: skip
        run_job(job, nproc)
        _jobs[name] = job
    return _jobs[name]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("optimizers")
    square_tiny_llama(folder / "model")
    return folder


def assert_follows(job: Path, reference: dict[str, dict[int, float]], rel: float) -> None:
    steps = {r["step"]: r for r in records(job) if r.get("loss") is not None}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for s, r in steps.items():
        assert r["loss"] == pytest.approx(reference["loss"][s], rel=rel), (s, r["loss"], reference["loss"])
        assert r["grad_norm"] == pytest.approx(reference["grad_norm"][s], rel=max(rel, 1e-4) * 10), (s, r, reference)


def assert_resumes_bit_exactly(job: Path) -> None:
    resumed = resume_from(job, 2)
    after, unbroken = losses(resumed), losses(job)
    assert sorted(after) == [3, 4] and after == {s: unbroken[s] for s in after}  # bit for bit


# -- one rank -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_8bit_adamw_trains_what_a_plain_torchao_loop_trains_and_its_8bit_moments_resume_bit_exactly(
    root: Path,
) -> None:
    job = job_of(root, "8bit", {}, 1, optimizer="adamw8bit")
    assert_follows(job, plain_loop(root / "model", {"optimizer": "adamw8bit"}), rel=1e-6)
    assert any("8-bit AdamW (torchao)" in n for n in notes_of(job))
    # The checkpoint holds torchao's 8-bit codes, not fp32 moments: a quarter of their bytes, through DCP.
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from rigpilot.engine.workers.checkpoint import SafeReader

    meta = SafeReader(str(job / "checkpoints" / "step-2")).read_metadata().state_dict_metadata
    moments = {k: m for k, m in meta.items() if ".exp_avg" in k and isinstance(m, TensorStorageMetadata)}
    assert moments
    assert_resumes_bit_exactly(job)


@pytest.mark.slow
def test_pure_bf16_with_the_step_in_backward_trains_what_a_plain_loop_with_per_weight_hooks_trains(
    root: Path,
) -> None:
    case = {**PURE_BF16, "optimizer_in_backward": True}
    job = job_of(root, "bf16-in-backward", {}, 1, **case)
    assert_follows(job, plain_loop(root / "model", case), rel=1e-6)  # the same rounding bits: bit for bit here
    notes = " ".join(notes_of(job))
    assert "stochastic rounding (torchao)" in notes and "stepped in backward" in notes
    assert_resumes_bit_exactly(job)


# -- data and tensor parallel ranks -------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_replicas_step_8bit_adamw_as_the_plain_loop_does(root: Path) -> None:
    """8-bit moments on DDP replicas (the step in backward is refused there: DDP's buckets hold every gradient)."""
    case = {"optimizer": "adamw8bit"}
    job = job_of(root, "ddp", {"dp_replicate": 2}, 2, **case)
    assert_follows(job, plain_loop(root / "model", case), rel=1e-4)
    assert_resumes_bit_exactly(job)


@pytest.mark.slow
def test_fsdp2_steps_each_sharded_weight_after_its_reduce_scatter(root: Path) -> None:
    """8-bit moments of shards (a shard under 4096 values keeps plain moments, the whole weight would not) and
    pure bf16: within the 8-bit moments' effect of the plain loop; resumed bit for bit."""
    case = {"optimizer": "adamw8bit", "optimizer_in_backward": True, **PURE_BF16}
    job = job_of(root, "fsdp", {"dp_shard": 2}, 2, **case)
    assert_follows(job, plain_loop(root / "model", case), rel=2e-3)
    assert_resumes_bit_exactly(job)


@pytest.mark.slow
def test_tensor_parallel_steps_each_split_weight_in_backward_with_8bit_adamw_as_the_plain_loop_does(
    root: Path,
) -> None:
    """The hooks fire on the tensor-parallel DTensor weights; a split weight's shard under 4096 values keeps plain
    moments where the whole one has 8-bit ones, hence the tolerance."""
    case = {"optimizer": "adamw8bit", "optimizer_in_backward": True}
    job = job_of(root, "tp", {"tp": 2}, 2, **case)
    assert_follows(job, plain_loop(root / "model", case), rel=1e-2)


# -- the parts ----------------------------------------------------------------------------------------------------


def test_the_norm_of_gradients_stepped_one_by_one_is_the_whole_gradients_norm() -> None:
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    norms = GradNormSquares(torch.device("cpu"))
    for g in grads:
        norms.add(g)
    assert float(norms.total()) == pytest.approx(float(torch.nn.utils.get_total_norm(grads)), rel=1e-6)
    assert float(norms.total()) == 0.0  # each step starts its own sum


def test_the_rounding_bits_are_seeded_per_step_and_weight_and_leave_the_jobs_generator_alone() -> None:
    torch.manual_seed(7)
    before = torch.get_rng_state()
    draws = {}
    for key in ((1, 2, 0), (1, 2, 0), (1, 3, 0), (1, 2, 1)):
        with rounding_seed(*key, torch.device("cpu")):
            draws.setdefault(key, []).append(torch.randint(0, 1 << 16, (8,)))
    assert torch.equal(draws[(1, 2, 0)][0], draws[(1, 2, 0)][1])
    assert not torch.equal(draws[(1, 2, 0)][0], draws[(1, 3, 0)][0])
    assert not torch.equal(draws[(1, 2, 0)][0], draws[(1, 2, 1)][0])
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("recipe", "layout", "ctx", "setting"),
    [
        (Recipe(optimizer_in_backward=True), Layout(), RecipeContext(grad_accum=2), "train.optimizer_in_backward"),
        (Recipe(optimizer_in_backward=True), Layout(), RecipeContext(grad_clip=1.0), "train.optimizer_in_backward"),
        (Recipe(optimizer_in_backward=True), Layout(pp=2), RecipeContext(), "train.optimizer_in_backward"),
        (Recipe(optimizer_in_backward=True), Layout(dp_replicate=2), RecipeContext(), "train.optimizer_in_backward"),
        (Recipe(optimizer="adamw8bit"), Layout(dp_shard=2, cpu_offload=True), RecipeContext(), "train.optimizer"),
        (Recipe(master_weights="bf16"), Layout(), RecipeContext(precision="fp32"), "train.master_weights"),
    ],
)
def test_a_refused_recipe_is_one_coded_line_naming_its_setting(
    recipe: Recipe, layout: Layout, ctx: RecipeContext, setting: str
) -> None:
    with pytest.raises(UserError) as e:
        check_recipe(recipe, layout, ctx)
    assert e.value.reason == "recipe_refused" and "\n" not in str(e.value)
    assert e.value.fields == {"setting": setting, "value": getattr(recipe, setting.removeprefix("train."))}


def test_every_combination_of_the_optimizer_settings_runs_on_data_and_tensor_parallel_layouts() -> None:
    layouts = (Layout(), Layout(dp_replicate=2), Layout(dp_shard=2), Layout(dp_replicate=2, dp_shard=2), Layout(tp=2),
               Layout(dp_replicate=2, tp=2), Layout(dp_shard=2, tp=2), Layout(pp=2))  # fmt: skip
    for layout in layouts:
        for optimizer in ("adamw", "adamw8bit"):
            for master in ("fp32", "bf16"):
                # Pipeline stages step after backward only (their micro-batches accumulate); DDP's buckets keep
                # every gradient, so a step in backward would free none.
                ddp = layout.dp_replicate > 1 and layout.dp_shard == 1 and layout.tp == 1
                for in_backward in (False,) if layout.pp > 1 or ddp else (False, True):
                    recipe = Recipe(master_weights=master, optimizer=optimizer, optimizer_in_backward=in_backward)
                    check_recipe(recipe, layout, RecipeContext(cpu_ranks=True))


def test_a_job_json_asking_for_the_step_in_backward_under_ddp_stops_on_the_rank_in_one_line() -> None:
    """A job written before the contract refused it (queued, or resumed) meets the same refusal on its rank,
    before a step runs, not the special DDP path it once took."""
    from rigpilot.engine.jobspec.spec import JobSpec
    from rigpilot.engine.workers.train import validate_recipe

    spec = JobSpec.from_dict({"id": "old", "kind": "train", "model": "tiny", "parallelism": {"dp_replicate": 2},
                              "train": {"optimizer_in_backward": True, "grad_clip": 0.0}})  # fmt: skip
    with pytest.raises(UserError) as e:
        validate_recipe(spec, torch.device("cpu"))
    assert "saves no memory under DDP" in str(e.value) and "\n" not in str(e.value)
    assert e.value.fields == {"setting": "train.optimizer_in_backward", "value": True}
