"""Exports: torchrun line, Accelerate YAML, DeepSpeed JSON, SLURM script."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import subprocess

import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.spec import Linear, ModelSpec
from rigpilot.engine.planner.export import (
    accelerate_config,
    deepspeed_config,
    export,
    export_best,
    script_args,
    slurm_script,
    to_yaml,
    torchrun_command,
)
from rigpilot.engine.planner.plan import Workload
from rigpilot.engine.planner.search import SearchOptions, search
from rigpilot.engine.recipe import PLAIN_RECIPE

from support.planner_inputs import PLAIN_FLAGS

yaml = pytest.importorskip("yaml")


def llama_7b() -> ModelSpec:
    h, inter = 4096, 11008
    lin = [
        Linear("q_proj", h, h), Linear("k_proj", h, h), Linear("v_proj", h, h), Linear("o_proj", h, h),
        Linear("gate_proj", h, inter), Linear("up_proj", h, inter), Linear("down_proj", inter, h),
    ]
    return ModelSpec(
        id="llama-2-7b", architecture="LlamaForCausalLM", model_type="llama", params_total=6_738_415_616,
        params_active=6_738_415_616, params_embedding=32000 * h, hidden_size=h, num_layers=32, num_heads=32,
        num_kv_heads=32, head_dim=128, intermediate_size=inter, vocab_size=32000, max_position_embeddings=4096,
        tied_embeddings=False, layer_linears=lin,
    )


def result(profile: str, **work):
    w = Workload(model="meta-llama/Llama-2-7b-hf", **{"seq_len": 2048, "global_batch": 16, **PLAIN_RECIPE, **work})
    return search(llama_7b(), load_profile(profile), w, options=SearchOptions(runners_up=8))


def best(profile: str, **work):
    return result(profile, **work).best


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_torchrun_line():
    plan = best("8x-h100-sxm")
    argv = shlex.split(torchrun_command(plan))
    env = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["CUDA_VISIBLE_DEVICES"].split(",") == [str(i) for i in plan.parallelism.gpu_indices]
    assert "torchrun" in argv and "--standalone" in argv and "--nnodes=1" in argv
    assert f"--nproc-per-node={plan.parallelism.world_size}" in argv
    i = argv.index("train.py")
    assert argv[i : i + 3] == ["train.py", "--plan", "plan.json"]
    par = plan.parallelism
    # What the plan's memory depends on is on the script's command line, as `rigpilot run train` names it.
    assert flag(argv, "--precision") == "bf16"
    assert flag(argv, "--micro-batch") == str(par.micro_batch) and flag(argv, "--grad-accum") == str(par.grad_accum)
    assert flag(argv, "--activation-checkpointing") == par.checkpointing
    if par.tp > 1:
        assert flag(argv, "--tp") == str(par.tp)
    if par.backend == "fsdp":
        assert flag(argv, "--fsdp") == str(par.dp // par.replicate_degree)


def test_the_4090_offload_plan_carries_every_memory_setting_into_every_export(tmp_path):
    """The 4×4090 7B plan, followed literally from each export, is the plan: checkpointing, batch, offload, precision."""
    plan = best("4x-rtx4090")
    par = plan.parallelism
    assert par.backend == "fsdp" and par.offload and par.checkpointing == "full"
    argv = shlex.split(torchrun_command(plan))
    assert flag(argv, "--activation-checkpointing") == "full" and "--cpu-offload" in argv
    assert flag(argv, "--micro-batch") == str(par.micro_batch) and flag(argv, "--fsdp") == "4"
    slurm = slurm_script(plan)
    assert "--activation-checkpointing full" in slurm and "--cpu-offload" in slurm
    acc = yaml.safe_load(accelerate_config(plan))
    assert acc["fsdp_config"]["fsdp_activation_checkpointing"] is True
    assert acc["fsdp_config"]["fsdp_offload_params"] is True and acc["mixed_precision"] == "bf16"
    ds = deepspeed_config(plan)
    assert ds["activation_checkpointing"]["partition_activations"] is False
    assert ds["rigpilot"]["activation_checkpointing"] == "full"
    assert ds["train_micro_batch_size_per_gpu"] == par.micro_batch and ds["gradient_accumulation_steps"] == par.grad_accum
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] is True
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    no_ckpt = dataclasses.replace(plan, parallelism=dataclasses.replace(par, checkpointing="none"))
    assert "activation_checkpointing" not in deepspeed_config(no_ckpt)
    assert yaml.safe_load(accelerate_config(no_ckpt))["fsdp_config"]["fsdp_activation_checkpointing"] is False


def ddp_with_checkpointing():
    plan = best("8x-h100-sxm")
    return dataclasses.replace(plan, parallelism=dataclasses.replace(
        plan.parallelism, backend="ddp", zero_stage=0, shard_degree=1, tp=1, pp=1, dp=8, sequence_parallel=False,
        checkpointing="full", offload_params=False, offload_optimizer=False, stage_layers=[]))


def test_accelerate_checkpoints_a_ddp_plan_through_unsharded_fsdp():
    cfg = yaml.safe_load(accelerate_config(ddp_with_checkpointing()))
    assert cfg["distributed_type"] == "FSDP" and cfg["num_processes"] == 8
    assert cfg["fsdp_config"]["fsdp_sharding_strategy"] == "NO_SHARD"
    assert cfg["fsdp_config"]["fsdp_activation_checkpointing"] is True


def test_accelerate_yaml_for_fsdp_and_deepspeed():
    fsdp = next(p for p in [result("8x-h100-sxm").best, *result("8x-h100-sxm").runners_up] if p.parallelism.pp == 1)
    cfg = yaml.safe_load(accelerate_config(fsdp))
    assert cfg["num_processes"] == 8 and cfg["mixed_precision"] == "bf16" and cfg["num_machines"] == 1
    assert cfg["distributed_type"] in ("FSDP", "DEEPSPEED", "MULTI_GPU")
    if cfg["distributed_type"] == "FSDP":
        assert cfg["fsdp_config"]["fsdp_version"] == 2
    off = best("4x-rtx4090")
    cfg = yaml.safe_load(accelerate_config(off))
    # FSDP2's CPU offload is what the engine runs: Accelerate's FSDP config with fsdp_offload_params.
    assert off.parallelism.backend == "fsdp" and off.parallelism.offload_params and off.parallelism.offload_optimizer
    assert cfg["distributed_type"] == "FSDP"
    assert cfg["fsdp_config"]["fsdp_offload_params"] is True and cfg["fsdp_config"]["fsdp_version"] == 2
    assert cfg["gpu_ids"] == ",".join(map(str, off.parallelism.gpu_indices))


def test_accelerate_reads_its_config(tmp_path):
    """Accelerate's own loader takes the YAML: FSDP2 offload and the ZeRO-2 form (no resharding after forward)."""
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    off = best("4x-rtx4090")
    zero2 = dataclasses.replace(off, parallelism=dataclasses.replace(
        off.parallelism, zero_stage=2, offload_params=False, offload_optimizer=False))
    for plan, reshard, offload in ((off, True, True), (zero2, False, False)):
        path = tmp_path / "accelerate.yaml"
        path.write_text(accelerate_config(plan))
        cfg = config_args.load_config_from_file(str(path))
        assert cfg.distributed_type == "FSDP" and cfg.num_processes == 4
        assert cfg.fsdp_config["fsdp_reshard_after_forward"] is reshard
        assert cfg.fsdp_config["fsdp_offload_params"] is offload
        assert cfg.fsdp_config["fsdp_activation_checkpointing"] is True
    path.write_text(accelerate_config(ddp_with_checkpointing()))
    cfg = config_args.load_config_from_file(str(path))
    assert cfg.distributed_type == "FSDP" and cfg.fsdp_config["fsdp_activation_checkpointing"] is True
    assert cfg.fsdp_config["fsdp_sharding_strategy"] == "NO_SHARD"


def test_deepspeed_reads_its_config(monkeypatch):
    """DeepSpeed's own config loader takes the JSON, its activation-checkpointing section and Rigpilot's note."""
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    # The loader checks the batch against the data-parallel world, which it asks of a process group; give it
    # the plan's instead of starting one rank per GPU.
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    h100 = result("8x-h100-sxm")
    hsdp = next(p for p in [h100.best, *h100.runners_up] if p.parallelism.hsdp)
    hsdp = dataclasses.replace(hsdp, parallelism=dataclasses.replace(hsdp.parallelism, checkpointing="full"))
    for plan in (best("4x-rtx4090"), ddp_with_checkpointing(), hsdp):
        text = export(plan, "deepspeed")
        mpu = type("Mpu", (), {"get_data_parallel_world_size": lambda self, dp=plan.parallelism.dp: dp})()
        cfg = ds_config.DeepSpeedConfig(json.loads(text), mpu=mpu)
        assert cfg.train_micro_batch_size_per_gpu == plan.parallelism.micro_batch
        assert cfg.gradient_accumulation_steps == plan.parallelism.grad_accum
        assert cfg.zero_optimization_stage == plan.parallelism.zero_stage and cfg.bfloat16_config.enabled
        ckpt = cfg.activation_checkpointing_config
        assert ckpt.partition_activations is False and ckpt.cpu_checkpointing is False
        assert json.loads(text)["rigpilot"]["activation_checkpointing"] == "full"
        if plan.parallelism.offload:
            assert cfg.zero_config.offload_param.device == "cpu" and cfg.zero_config.offload_optimizer.device == "cpu"
        if plan.parallelism.hsdp:  # sharded within groups of shard_degree GPUs, as the plan is
            assert cfg.zero_config.zero_hpz_partition_size == plan.parallelism.shard_degree


def test_fsdp_offload_exports_to_deepspeed_zero3_offload():
    off = best("4x-rtx4090")
    assert off.parallelism.backend == "fsdp" and off.parallelism.offload
    zero = deepspeed_config(off)["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"]["device"] == "cpu" and zero["offload_optimizer"]["device"] == "cpu"


def test_deepspeed_json():
    plan = best("4x-rtx4090")
    par = plan.parallelism
    cfg = json.loads(export(plan, "deepspeed"))
    assert cfg == deepspeed_config(plan)
    assert cfg["zero_optimization"]["stage"] == par.zero_stage
    assert cfg["train_batch_size"] == par.micro_batch * par.grad_accum * par.dp == 16
    assert cfg["train_micro_batch_size_per_gpu"] == par.micro_batch
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    if par.offload_optimizer:
        assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
        assert cfg["optimizer"]["type"] == "AdamW"
    r = result("8x-h100-sxm", precision="fp16")
    text, _, _ = export_best([r.best, *r.runners_up], "deepspeed")
    fp16 = json.loads(text)
    assert fp16["fp16"]["enabled"] is True and fp16["fp16"]["loss_scale"] == 0


def test_slurm_script():
    plan = best("8x-h100-sxm")
    text = slurm_script(plan, nodes=4)
    assert text.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text
    # One SLURM task per rank; torch.distributed meets at the first node on a port of this job's own.
    assert "#SBATCH --ntasks-per-node=8" in text and "\nsrun --kill-on-bad-exit=1 bash -c " in text
    assert "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS" in text
    assert 'export MASTER_ADDR="$head"' in text and "export MASTER_PORT=$((29500 + SLURM_JOB_ID % 20000))" in text
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert text.rstrip().endswith("train.py --plan plan.json " + " ".join(shlex.quote(a) for a in script_args(plan)))
    assert "#SBATCH --partition" not in text and "#SBATCH --time" not in text
    if shutil.which("bash"):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    with pytest.raises(UserError):
        slurm_script(plan, nodes=0)
    limited = slurm_script(plan, partition="gpu", account="lab-1", time_limit="1-12:00:00")
    assert "#SBATCH --partition=gpu\n#SBATCH --account=lab-1\n#SBATCH --time=1-12:00:00\n" in limited
    for bad, message in (({"partition": "gpu\n#SBATCH --uid=0"}, "not a SLURM name"), ({"time_limit": "2h"}, "time limit")):
        with pytest.raises(UserError, match=message):
            slurm_script(plan, **bad)


def test_slurm_script_runs_a_given_command_with_its_environment_and_ranks():
    plan = best("8x-h100-sxm")
    text = slurm_script(plan, command=["/venv/bin/python", "-m", "job", "/jobs/a b"], env={"RIGPILOT_JOB_ID": "abc"},
                        ranks_per_node=2, gpus_per_node=0, output="/jobs/a b/logs/launcher.log")  # fmt: skip
    assert "#SBATCH --ntasks-per-node=2" in text and "--gpus-per-node" not in text and "--exclusive" not in text
    assert "#SBATCH --output=/jobs/a b/logs/launcher.log\n#SBATCH --open-mode=append" in text
    assert "export RIGPILOT_JOB_ID=abc" in text and "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in text
    assert text.rstrip().endswith("rank \\\n    /venv/bin/python -m job '/jobs/a b'")
    with pytest.raises(UserError, match="needs the job's command"):
        slurm_script(None)


def test_exports_refuse_what_they_cannot_run():
    infer = search(llama_7b(), load_profile("1x-rtx4090"), Workload(model="x", task="infer", seq_len=2048, global_batch=1, new_tokens=128)).best
    with pytest.raises(UserError, match="for training"):
        deepspeed_config(infer)
    assert shlex.split(torchrun_command(infer))[3] == "python"  # one process, no torch.distributed
    pipeline = search(llama_7b(), load_profile("8x-a100-pcie"), Workload(model="x", seq_len=2048, global_batch=16),
                      options=SearchOptions(runners_up=30))
    pp = next((p for p in [pipeline.best, *pipeline.runners_up] if p.parallelism.pp > 1), None)
    if pp is not None:
        with pytest.raises(UserError, match="pipeline"):
            accelerate_config(pp)
    with pytest.raises(UserError, match="unknown export"):
        export(infer, "mpirun")


def test_yaml_writer_quotes_what_needs_quoting():
    text = to_yaml({"a": "no", "b": "0,1", "c": True, "d": {"e": 1, "f": "x y"}, "g": [], "h": "bf16"})
    assert yaml.safe_load(text) == {"a": "no", "b": "0,1", "c": True, "d": {"e": 1, "f": "x y"}, "g": [], "h": "bf16"}


def test_an_export_that_cannot_express_the_best_plan_takes_the_next_and_says_so():
    fsdp = best("8x-h100-sxm")
    tp = dataclasses.replace(fsdp, parallelism=dataclasses.replace(fsdp.parallelism, tp=2, dp=4, sequence_parallel=True))
    text, index, note = export_best([tp, fsdp], "deepspeed")
    assert index == 1 and json.loads(text) == deepspeed_config(fsdp)
    assert note.startswith("exported plan #2") and "tensor or pipeline parallelism" in note
    assert export_best([fsdp, tp], "deepspeed")[1:] == (0, None)
    with pytest.raises(UserError, match="tensor or pipeline"):
        export_best([tp], "deepspeed")


@pytest.mark.parametrize("target", ["torchrun", "accelerate", "deepspeed", "slurm"])
def test_plan_and_plan_export_are_one_search(capsys, target):
    """`plan --export X` searches as `plan` does: the same result, rejection figures included, plus the export."""
    from rigpilot.engine.cli.entry import main

    def run(*extra: str) -> dict:
        assert main(["plan", "--simulate", "4x-rtx4090", "--model", "llama-2-7b", "--json", *PLAIN_FLAGS, *extra]) == 0
        d = json.loads(capsys.readouterr().out)
        d.pop("elapsed_s")
        return d

    plain, exported = run(), run("--export", target)
    export_part = exported.pop("export")
    assert exported == plain
    assert export_part["target"] == target and export_part["plan"] == 0 and export_part["text"]
    ddp = next(r for r in plain["rejected"] if r["family"] == "DDP")
    assert "133 GiB" in ddp["reason"]


def test_the_gui_export_bar_writes_what_the_cli_exports(tmp_path):
    """The Planner page's exports go through the same functions, from the plan JSON the engine sends."""
    from rigpilot.app.planner.exports import write_export

    plan = best("4x-rtx4090")
    for target in ("deepspeed", "accelerate", "torchrun"):
        path = tmp_path / f"out.{target}"
        write_export(json.loads(plan.to_json()), target, path)
        text = path.read_text()
        if target == "torchrun":
            assert export(plan, target, plan_path="out.plan.json") in text
        else:
            assert text.rstrip("\n") == export(plan, target).rstrip("\n")
    assert json.loads((tmp_path / "out.deepspeed").read_text())["rigpilot"]["activation_checkpointing"] == "full"


@pytest.mark.parametrize("profile", ["4x-rtx4090", "8x-h100-sxm"])
def test_the_exported_script_flags_are_rigpilot_run_trains_own(profile):
    """The flags exports spell out parse with `rigpilot run train`'s own parser, to the plan's settings."""
    from rigpilot.engine.cli.entry import build_parser
    from rigpilot.engine.planner.export import script_args

    for plan in [r for r in [result(profile).best, *result(profile).runners_up] if r is not None]:
        par = plan.parallelism
        args = build_parser().parse_args(["run", "train", "--model", "llama-2-7b", *script_args(plan)])
        assert (args.micro_batch, args.grad_accum, args.activation_checkpointing) == (par.micro_batch, par.grad_accum, par.checkpointing)
        assert args.precision == plan.workload.precision and bool(args.cpu_offload) == par.offload
        assert (args.tp or 1, args.pp or 1) == (par.tp, par.pp)
