"""torch.compile of each block (`--compile`) and FP8 training (`--fp8`), on CPU ranks.

Compiled blocks train what eager ones train (loss and gradients within 1e-5 in fp32) on one rank, under DDP
and under FSDP2, with the engine's own wrapping; a compiled job shows its warm-up as the "compiling" phase,
keeps the compile step's time out of tokens/s, and writes checkpoints an eager run resumes. FP8 is tested in
torchao's emulation mode against a plain loop that converts the model itself; on CPU ranks it is refused, at
submission and on the rank, in the contract's words. One tiny model (hidden 64), few layouts: compiling on two
shared cores takes tens of seconds per graph.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from rigpilot.engine.accuracy.tp import free_port
from rigpilot.engine.capability import RecipeContext, recipe_why_not
from rigpilot.engine.errors import UserError
from rigpilot.engine.layout import Layout
from rigpilot.engine.recipe import Recipe

from support.paths import SHAKESPEARE, TINY_LLAMA_CONFIG
from support.worker_jobs import LLAMA_TRAIN, losses, records, resume_from, run_job, write_job

TOLERANCE = 1e-5  # compiled vs eager, fp32 (the bar)
STEPS = 3
Run = tuple[list[float], list[list[torch.Tensor]]]  # a short training run's losses and gradients


def tiny_llama(layers: int = 1) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_LLAMA_CONFIG.parent, num_hidden_layers=layers)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (2, 33), generator=torch.Generator().manual_seed(seed))


def mean_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def train(model: torch.nn.Module, called: torch.nn.Module, seed: int) -> Run:
    """STEPS AdamW steps; each step's loss and gradients (whole tensors)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out_losses, grads = [], []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = mean_loss(called, tokens(seed * 100 + step))
        loss.backward()
        out_losses.append(float(loss.detach()))
        grads.append([_whole(p.grad).clone() for p in model.parameters()])
        optimizer.step()
    return out_losses, grads


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def worst(a: Run, b: Run) -> float:
    """The largest difference between two runs' losses and gradients."""
    loss_gap = max(abs(x - y) for x, y in zip(a[0], b[0], strict=True))
    pairs = [(x, y) for sa, sb in zip(a[1], b[1], strict=True) for x, y in zip(sa, sb, strict=True)]
    grad_gap = max(float((x - y).abs().max()) for x, y in pairs)
    return max(loss_gap, grad_gap)


# --- in place: no `_orig_mod.`; the cache ----------------------------------------------------------------------


def test_blocks_compile_in_place_so_state_dict_keys_stay_those_of_eager() -> None:
    from rigpilot.engine.workers.compile import apply_compile
    from rigpilot.engine.workers.parallelize import apply_activation_checkpointing, blocks

    eager, compiled = tiny_llama(2), tiny_llama(2)
    apply_activation_checkpointing(compiled, "selective")
    notes = apply_compile(compiled, "llama")
    assert all(b._compiled_call_impl is not None for b in blocks(compiled))
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert not any("_orig_mod" in k for k in compiled.state_dict())
    assert "2 transformer blocks" in notes[0]


def test_a_starting_job_says_it_is_compiling() -> None:
    from rigpilot.engine.jobs.job_view import startup_phase

    assert startup_phase("compiling") == "compiling"


def test_the_compile_cache_is_the_users_own_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from rigpilot.engine.workers.compile import INDUCTOR_CACHE_ENV, private_inductor_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # Inductor writes its /tmp default into the variable itself: that is not the user's choice.
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, default_cache_dir())
    before = os.umask(0o022)  # a umask that would leave the folder readable by all
    try:
        path = private_inductor_cache()
    finally:
        os.umask(before)
    assert path == tmp_path / "cache" / "rigpilot" / "torchinductor"
    assert (path.stat().st_mode & 0o777) == 0o700
    assert os.environ[INDUCTOR_CACHE_ENV] == str(path)
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert private_inductor_cache() == tmp_path / "mine"

    # A cache folder that cannot be made (here: its parent is a file): one line saying what to do.
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    monkeypatch.delenv(INDUCTOR_CACHE_ENV)
    with pytest.raises(UserError) as e:
        private_inductor_cache()
    assert e.value.reason == "compile_cache_unwritable" and INDUCTOR_CACHE_ENV in str(e.value)


# --- compiled vs eager, fp32 -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_checkpointed_blocks_train_what_eager_ones_train_on_one_rank() -> None:
    """Selective checkpointing compiled with its block (the job test below covers blocks without it)."""
    from rigpilot.engine.workers.compile import apply_compile
    from rigpilot.engine.workers.parallelize import apply_activation_checkpointing

    runs = []
    for compiled in (False, True):
        model = tiny_llama()
        apply_activation_checkpointing(model, "selective")
        if compiled:
            apply_compile(model, "llama")
        runs.append(train(model, model, seed=1))
    assert worst(*runs) < TOLERANCE


def _data_parallel(rank: int, world: int, port: int, shape: dict[str, int], queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rigpilot.engine.workers.compile import apply_compile
    from rigpilot.engine.workers.parallel_dims import MESH_DIMS, ParallelDims, Runtime
    from rigpilot.engine.workers.parallelize import apply_data_parallel, precision_plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dims = ParallelDims(pp=1, tp=1, world_size=world, **shape)
        mesh = init_device_mesh("cpu", dims.shape, mesh_dim_names=MESH_DIMS)
        runtime = Runtime(rank, rank, world, torch.device("cpu"), "gloo", dims, mesh)
        runs = []
        for compiled in (False, True):
            model = tiny_llama()
            if compiled:
                apply_compile(model, "llama")  # before the wrapping, as train.py does
            wrapped = apply_data_parallel(model, runtime, precision_plan("fp32", runtime))
            runs.append(train(model, wrapped, seed=rank + 1))
        keys = list(model.state_dict())
        queue.put((rank, worst(*runs), any("_orig_mod" in k for k in keys)))
    except BaseException as e:
        queue.put((rank, repr(e), None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [{"dp_replicate": 2, "dp_shard": 1}, {"dp_replicate": 1, "dp_shard": 2}],
                         ids=["ddp", "fsdp2"])  # fmt: skip
def test_compiled_blocks_train_what_eager_blocks_train_under_data_parallel(shape: dict[str, int]) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_data_parallel, args=(r, 2, port, shape, queue)) for r in range(2)]
    for p in procs:
        p.start()
    answers = {rank: (gap, prefixed) for rank, gap, prefixed in (queue.get(timeout=600) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    for rank, (gap, prefixed) in answers.items():
        assert not isinstance(gap, str), (rank, gap)
        assert gap < TOLERANCE, (rank, gap)
        assert prefixed is False, rank


# --- a compiled job ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_compiled_job_shows_its_warm_up_trains_as_eager_and_its_checkpoints_resume_eagerly(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(TINY_LLAMA_CONFIG.parent, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    train_settings = {**LLAMA_TRAIN, "max_steps": 4, "eval_every": 0, "checkpoint_every": 2}
    jobs = {}
    for compiled in (False, True):
        job = write_job(
            tmp_path / f"compile-{compiled}", kind="train", model=str(model / "config.json"),
            train={**train_settings, "compile": compiled},
        )  # fmt: skip
        run_job(job, 1)
        jobs[compiled] = job
    eager, compiled_curve = losses(jobs[False]), losses(jobs[True])
    assert eager.keys() == compiled_curve.keys() == {1, 2, 3, 4}
    assert max(abs(eager[s] - compiled_curve[s]) for s in eager) < TOLERANCE

    recs = records(jobs[True])
    phases = [(r["phase"], r.get("step")) for r in recs if r.get("kind") == "status"]
    assert phases.index(("compiling", None)) < phases.index(("training", 1)), phases
    steps = {r["step"]: r for r in recs if r.get("kind") is None and "step" in r}
    assert steps[1].get("tokens_per_s") is None and steps[1]["compile_time"] > 0
    assert all(steps[s]["tokens_per_s"] > 0 and "compile_time" not in steps[s] for s in (2, 3, 4))
    notes = [r["message"] for r in recs if r.get("kind") == "note"]
    assert any("torch.compile" in n for n in notes), notes

    # The compiled job's checkpoint and model carry eager keys: an eager run resumes it and trains on alike.
    from safetensors.torch import load_file

    from rigpilot.engine.workers.checkpoint import SafeReader

    meta = SafeReader(str(jobs[True] / "checkpoints" / "step-2")).read_metadata()
    assert not any("_orig_mod" in k for k in meta.state_dict_metadata)
    assert not any("_orig_mod" in k for k in load_file(jobs[True] / "output" / "model.safetensors"))
    spec = json.loads((jobs[True] / "job.json").read_text())
    spec["train"]["compile"] = False
    (jobs[True] / "job.json").write_text(json.dumps(spec))
    resumed = losses(resume_from(jobs[True], 2))
    assert max(abs(resumed[s] - compiled_curve[s]) for s in (3, 4)) < TOLERANCE


# --- FP8 -------------------------------------------------------------------------------------------------------


def fp8_plain_loop(emulated: bool) -> tuple[list[float], int]:
    """torch and torchao only: the tiny model, its block linears converted by torchao (emulated FP8), AdamW."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_llama()
    if emulated:

        def block_linear(module: torch.nn.Module, fqn: str) -> bool:
            dims_ok = module.in_features % 16 == 0 and module.out_features % 16 == 0
            return isinstance(module, torch.nn.Linear) and fqn != "lm_head" and dims_ok

        convert_to_float8_training(model, module_filter_fn=block_linear, config=Float8LinearConfig(emulate=True))
    converted = sum(isinstance(m, Float8Linear) for m in model.modules())
    return train(model, model, seed=3)[0], converted


def test_fp8_emulated_trains_what_a_plain_torchao_loop_trains() -> None:
    from torchao.float8.float8_linear import Float8Linear

    from rigpilot.engine.workers.compile import apply_float8

    model = tiny_llama()
    notes = apply_float8(model, torch.device("cpu"), emulate=True)
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 7 and "lm_head" not in converted  # q, k, v, o, gate, up, down
    worker = train(model, model, seed=3)[0]
    plain, plain_converted = fp8_plain_loop(emulated=True)
    assert plain_converted == 7
    # The same library calls on the same model: equal to float rounding.
    assert worker == pytest.approx(plain, rel=1e-6, abs=1e-6)
    # ...and FP8's rounding shows: not the high-precision run.
    high = fp8_plain_loop(emulated=False)[0]
    assert worker != pytest.approx(high, rel=1e-7, abs=0)
    assert worker == pytest.approx(high, rel=5e-2)
    assert "7 linear layers" in notes[0]


def _fp8_fsdp(rank: int, world: int, port: int, queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rigpilot.engine.workers.compile import apply_float8
    from rigpilot.engine.workers.parallel_dims import MESH_DIMS, ParallelDims, Runtime
    from rigpilot.engine.workers.parallelize import apply_data_parallel, precision_plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dims = ParallelDims(pp=1, tp=1, world_size=world, dp_replicate=1, dp_shard=world)
        mesh = init_device_mesh("cpu", dims.shape, mesh_dim_names=MESH_DIMS)
        runtime = Runtime(rank, rank, world, torch.device("cpu"), "gloo", dims, mesh)
        runs = []
        for gather in (False, True):
            model = tiny_llama()
            apply_float8(model, runtime.device, emulate=True, fsdp_all_gather=gather)
            wrapped = apply_data_parallel(model, runtime, precision_plan("fp32", runtime))
            runs.append(train(model, wrapped, seed=rank + 1))
        queue.put((rank, worst(*runs)))
    except BaseException as e:
        queue.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_gathers_fp8_weights_and_trains_the_same_model() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_fp8_fsdp, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    answers = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, gap in answers.items():
        assert not isinstance(gap, str), (rank, gap)
        assert gap < 1e-6, (rank, gap)


def test_fp8_leaves_the_head_and_odd_sized_linears_in_high_precision() -> None:
    from rigpilot.engine.workers.compile import fp8_linear

    assert fp8_linear(torch.nn.Linear(64, 128), "model.layers.0.mlp.up_proj")
    assert not fp8_linear(torch.nn.Linear(64, 512), "lm_head")
    assert not fp8_linear(torch.nn.Linear(64, 40), "model.layers.0.mlp.up_proj")
    assert not fp8_linear(torch.nn.Conv1d(64, 64, 1), "model.layers.0.conv")


def test_fp8_is_refused_on_a_cpu_rank_in_the_contracts_words() -> None:
    from rigpilot.engine.workers.compile import apply_float8

    expected = recipe_why_not(Recipe(fp8=True), Layout(), RecipeContext(cpu_ranks=True))
    assert expected == "FP8 matmuls need a GPU of compute capability 8.9 or newer; this job runs as CPU ranks"
    with pytest.raises(UserError) as e:
        apply_float8(tiny_llama(), torch.device("cpu"))
    assert str(e.value) == expected and e.value.reason == "recipe_refused"


def test_the_fp8_contract() -> None:
    fp8 = Recipe(fp8=True)
    lt = Layout()
    assert recipe_why_not(fp8, lt, RecipeContext(gpu_capability=(9, 0))) is None
    assert recipe_why_not(fp8, lt, RecipeContext(gpu_capability=(8, 9))) is None
    assert recipe_why_not(fp8, lt, RecipeContext(gpu_capability=None)) is None  # the rank checks its device
    assert "these GPUs are 8.6" in (recipe_why_not(fp8, lt, RecipeContext(gpu_capability=(8, 6))) or "")
    assert "not lora's adapters" in (recipe_why_not(fp8, lt, RecipeContext(method="lora", gpu_capability=(9, 0))) or "")
    assert "bf16 precision" in (recipe_why_not(fp8, lt, RecipeContext(precision="fp32", gpu_capability=(9, 0))) or "")
    assert recipe_why_not(Recipe(compile=True), lt, RecipeContext(cpu_ranks=True)) is None


def test_run_train_fp8_on_a_simulated_machine_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rigpilot.engine.cli.entry import main as cli_main

    from support.engine import Engine, engine_home, leftover_job_processes

    engine_home(tmp_path, monkeypatch)
    engine = Engine(tmp_path)
    engine.start()
    try:
        argv = ["run", "train", "--model", str(TINY_LLAMA_CONFIG), "--method", "scratch", "--data", str(SHAKESPEARE)]
        assert cli_main([*argv, "--fp8", "--check"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            "rigpilot: error: FP8 matmuls need a GPU of compute capability 8.9 or newer; this job runs as CPU ranks"
        ]
        assert cli_main([*argv, "--compile", "--check"]) == 0
        assert capsys.readouterr().out.startswith("would run:")
    finally:
        engine.stop()
        for p in leftover_job_processes(tmp_path):
            p.kill()
