"""Turn a plan into what launchers read: a torchrun line, an Accelerate config, a DeepSpeed config, a SLURM script.

Ranks follow the plan's GPU order (CUDA_VISIBLE_DEVICES lists the plan's
`gpu_indices` with CUDA_DEVICE_ORDER=PCI_BUS_ID, so local rank i is the plan's
i-th GPU in nvidia-smi numbering): that order puts tensor-parallel groups and
FSDP shards on the fastest links.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS
from rigpilot.engine.planner.plan import Plan, recipe_of, recipe_words
from rigpilot.engine.planner.settings import EXPORTS, ref, refusal
from rigpilot.engine.schema import flag_words

RDZV_PORT = 29500
BUCKET_ELEMENTS = 50_000_000  # what the memory model assumes for DeepSpeed's reduce/all-gather buckets
DEFAULT_SCRIPT = "train.py"
CHECKPOINTING_NOTE = (
    "The plan's memory assumes activation checkpointing of every decoder layer: the training script must turn it on "
    "(Transformers: model.gradient_checkpointing_enable(); otherwise run each layer through "
    "deepspeed.checkpointing.checkpoint). The activation_checkpointing section configures it; it does not turn it on."
)


def export(plan: Plan, target: str, *, script: str | None = None, plan_path: str = "plan.json", nodes: int | None = None) -> str:
    if target == "torchrun":
        return torchrun_command(plan, script=script, plan_path=plan_path)
    if target == "accelerate":
        if plan.parallelism.nodes > 1:
            raise UserError("Accelerate configs are exported for one node; export a multi-node plan for torchrun or SLURM")
        return accelerate_config(plan)
    if target == "deepspeed":
        return json.dumps(deepspeed_config(plan), indent=2)
    if target == "slurm":
        return slurm_script(plan, nodes=nodes, script=script, plan_path=plan_path)
    raise UserError(f"unknown export {target!r}; use {', '.join(EXPORTS)}")


def export_best(plans: list[Plan], target: str, **kw: Any) -> tuple[str, int, str | None]:
    """Export the first of `plans` (the search's ranking, best first) that `target` can express.

    Returns the text, the index of the plan exported and, when it is not the best, a line saying why.
    The search is the same with or without an export; a tool that cannot express the best plan
    (DeepSpeed and tensor parallelism, Accelerate and pipelines) gets the next plan it can, said so.
    """
    first: UserError | None = None
    for i, plan in enumerate(plans):
        try:
            text = export(plan, target, **kw)
        except UserError as e:
            first = first or e
            if i == 0 and not plans[0].workload.training:
                break  # the training-only configs refuse every plan of an inference search alike
            continue
        if i == 0:
            return text, 0, None
        slower = 1 - plan.timing.tokens_per_s / plans[0].timing.tokens_per_s if plans[0].timing.tokens_per_s else 0.0
        why = str(first).split(";")[0]
        return text, i, (f"exported plan #{i + 1} ({plan.parallelism.describe()}, {slower:.0%} slower): "
                         f"the best plan cannot be expressed for {target}: {why}")  # fmt: skip
    assert first is not None
    raise first


def _env(plan: Plan) -> dict[str, str]:
    par = plan.parallelism
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in par.gpu_indices),
        "OMP_NUM_THREADS": "4",
    }


def _script(plan: Plan, script: str | None) -> str:
    if script:
        return script
    return DEFAULT_SCRIPT if plan.workload.training else "infer.py"


def script_args(plan: Plan) -> list[str]:
    """The settings the plan's memory depends on, as the script's flags (named as `rigpilot run train` names them).

    The plan file holds them too; spelled out on the command line, a script that reads flags and not the
    plan cannot run the plan without them unnoticed.
    """
    par, w = plan.parallelism, plan.workload
    args = ["--precision", w.precision]
    if w.training:
        args += ["--micro-batch", str(par.micro_batch), "--grad-accum", str(par.grad_accum)]
        args += ["--activation-checkpointing", par.checkpointing]
        # The recipe the plan was sized for, as `rigpilot run train` spells it (the plain recipe's settings left out).
        for name, value in recipe_of(w).changed().items():
            args += flag_words(TRAIN_SETTINGS[name], value) or []
    if par.tp > 1:
        args += ["--tp", str(par.tp)] + (["--sequence-parallel"] if par.sequence_parallel else [])
    if par.pp > 1:
        args += ["--pp", str(par.pp), "--pp-microbatches", str(par.grad_accum)]
    if w.training and par.backend == "fsdp":
        shard = par.dp // par.replicate_degree
        args += ["--fsdp", str(shard)] + (["--dp", str(par.replicate_degree)] if par.replicate_degree > 1 else [])
        if par.offload:
            args.append("--cpu-offload")
    elif par.dp > 1:
        args += ["--dp", str(par.dp)]
    return args


def _script_line(plan: Plan, script: str | None, plan_path: str) -> str:
    argv = [_script(plan, script), "--plan", plan_path, *script_args(plan)]
    return " ".join(shlex.quote(a) for a in argv)


def torchrun_command(plan: Plan, *, script: str | None = None, plan_path: str = "plan.json") -> str:
    """One shell line: environment, torchrun on this machine, the training script with the plan and its settings."""
    par = plan.parallelism
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in _env(plan).items())
    args = _script_line(plan, script, plan_path)
    if not plan.workload.training and par.tp == 1:
        # A layer split (device_map) or a single GPU runs in one process that sees all the plan's GPUs.
        return f"{env} python {args}"
    if par.nodes > 1:
        # The same line on every node, each with its NODE_RANK and the first node's address as HEAD.
        return (
            f"{env} torchrun --nnodes={par.nodes} --node-rank=\"$NODE_RANK\" --nproc-per-node={par.gpus_per_node} "
            f"--rdzv-backend=c10d --rdzv-endpoint=\"$HEAD:{RDZV_PORT}\" {args}"
        )
    return f"{env} torchrun --standalone --nnodes=1 --nproc-per-node={par.world_size} {args}"


def _training_only(plan: Plan, what: str) -> None:
    if not plan.workload.training:
        raise refusal("{what} configs are for training; use {torchrun} for an inference plan",
                      reason="export_is_for_training", what=what, torchrun=ref("export", "torchrun"))  # fmt: skip


def accelerate_config(plan: Plan) -> str:
    """An `accelerate launch --config_file` YAML for the plan."""
    _training_only(plan, "Accelerate")
    par, w = plan.parallelism, plan.workload
    if par.pp > 1:
        raise refusal("Accelerate cannot run pipeline-parallel plans; use {torchrun}", reason="export_cannot_run",
                      torchrun=ref("export", "torchrun"))  # fmt: skip
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "NO",
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "gpu_ids": ",".join(str(i) for i in par.gpu_indices),
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": "no" if w.precision == "fp32" else w.precision,
        "num_machines": 1,
        "num_processes": par.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": False,
    }
    if par.backend == "deepspeed":
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            "gradient_accumulation_steps": par.grad_accum,
            "gradient_clipping": 1.0,
            "offload_optimizer_device": "cpu" if par.offload_optimizer else "none",
            "offload_param_device": "cpu" if par.offload_params else "none",
            "zero3_init_flag": par.zero_stage == 3,
            "zero3_save_16bit_model": par.zero_stage == 3,
            "zero_stage": par.zero_stage,
        }
    elif par.backend == "fsdp":
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {
            "fsdp_activation_checkpointing": par.checkpointing != "none",
            # Without a class name Accelerate wraps the model's _no_split_modules (its decoder layers).
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_cpu_ram_efficient_loading": True,
            # FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state on the host together.
            "fsdp_offload_params": par.offload,
            # False is FSDP2's ZeRO-2: units stay gathered from forward through backward.
            "fsdp_reshard_after_forward": par.reshard_after_forward,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_version": 2,
        }
    elif par.checkpointing != "none" and par.tp == 1:
        # Accelerate turns activation checkpointing on only through its FSDP plugin. FSDP1 without sharding
        # holds what DDP holds (whole weights, gradients and optimizer state on every GPU), so the plan's
        # memory stands; a lone GPU is the one-rank case of it.
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {
            "fsdp_activation_checkpointing": True,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_offload_params": False,
            "fsdp_sharding_strategy": "NO_SHARD",
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_version": 1,
        }
    elif par.checkpointing != "none":
        raise refusal("Accelerate's config turns activation checkpointing on only with FSDP, and this plan is "
                      "tensor-parallel DDP; use {torchrun}", reason="export_cannot_run",
                      torchrun=ref("export", "torchrun"))  # fmt: skip
    elif par.world_size > 1:
        cfg["distributed_type"] = "MULTI_GPU"
    if par.tp > 1 or par.hsdp:
        cfg["parallelism_config"] = {
            "parallelism_config_cp_size": 1,
            "parallelism_config_dp_replicate_size": par.replicate_degree if par.backend == "fsdp" else par.dp,
            "parallelism_config_dp_shard_size": par.dp // par.replicate_degree if par.backend == "fsdp" else 1,
            "parallelism_config_tp_size": par.tp,
        }
    recipe = recipe_of(w)
    if recipe.master_weights == "bf16":
        # Pure bf16: the model's own weights are bf16 and nothing autocasts (Accelerate's mixed precision keeps
        # fp32 weights); the script loads the model with torch_dtype=torch.bfloat16.
        cfg["mixed_precision"] = "no"
    # Accelerate's config has no key for the batch: the script's DataLoader and Accelerator take these.
    header = (
        f"# Rigpilot plan: {par.describe()}\n"
        f"# In the script: DataLoader(batch_size={par.micro_batch}), "
        f"Accelerator(gradient_accumulation_steps={par.grad_accum}).\n"
        "# Launch with CUDA_DEVICE_ORDER=PCI_BUS_ID so gpu_ids use nvidia-smi's numbering.\n"
    )
    if not recipe.plain:
        header += f"# Recipe: {recipe_words(w)}.\n"
        header += "".join(f"# {line}\n" for line in _script_recipe(recipe, "Accelerate"))
    return header + to_yaml(cfg)


def _script_recipe(recipe: Any, tool: str) -> list[str]:
    """What the training script must do for the parts of the recipe `tool`'s config has no key for."""
    out = []
    if recipe.master_weights == "bf16" and tool == "Accelerate":
        out.append("Pure bf16: load the model with torch_dtype=torch.bfloat16 (mixed_precision is 'no' for that reason).")
    if recipe.optimizer == "adamw8bit":
        out.append(f"{tool} cannot say it: the script builds torchao.optim.AdamW8bit(model.parameters(), ...).")
    if recipe.optimizer_in_backward:
        out.append(f"{tool} cannot say it: the optimizer steps in each parameter's post-accumulate-grad hook "
                   "(no gradient accumulation or clipping).")  # fmt: skip
    if recipe.loss_chunks > 1:
        out.append(f"{tool} cannot say it: the loss is chunked cross-entropy over {recipe.loss_chunks} chunks of "
                   "tokens (torchtune's CEWithChunkedOutputLoss).")  # fmt: skip
    if recipe.activation_offload:
        out.append(f"{tool} cannot say it: saved activations are offloaded to pinned host memory "
                   "(torchtune's OffloadActivations context).")  # fmt: skip
    if recipe.optimizer_offload and tool != "DeepSpeed's config":
        out.append(f"{tool} cannot say it: the optimizer state, master weights and gradients live in pinned host "
                   "memory and AdamW steps on the CPU, the GPU keeping the weights (torchao's CPUOffloadOptimizer; "
                   "DeepSpeed can: zero_optimization.offload_optimizer.device 'cpu').")  # fmt: skip
    if recipe.compile:
        out.append(f"{tool} cannot say it: each transformer block is torch.compile'd (regional compilation).")
    if recipe.fp8:
        out.append(f"{tool} cannot say it: linear layers are converted with torchao.float8.convert_to_float8_training.")
    return out


def deepspeed_config(plan: Plan) -> dict[str, Any]:
    """A DeepSpeed JSON config (as a dict) for a ZeRO plan, DeepSpeed's own or the FSDP2 plan it corresponds to."""
    _training_only(plan, "DeepSpeed")
    par, w = plan.parallelism, plan.workload
    if par.tp > 1 or par.pp > 1:
        raise refusal("this plan uses tensor or pipeline parallelism, which the DeepSpeed export does not cover; "
                      "plan again with {deepspeed} to get a ZeRO plan", reason="export_cannot_run",
                      deepspeed=ref("export", "deepspeed"))  # fmt: skip
    # An FSDP2 plan's ZeRO stage is DeepSpeed's; FSDP2's CPU offload (parameters, gradients and optimizer state
    # on the host) is ZeRO-3 with offload_param and offload_optimizer, set from the plan's two flags below.
    stage = par.zero_stage if par.backend in ("deepspeed", "fsdp") else 0
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": BUCKET_ELEMENTS,
    }
    if stage in (1, 2):
        zero["allgather_bucket_size"] = BUCKET_ELEMENTS
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": BUCKET_ELEMENTS,
                "stage3_param_persistence_threshold": 100_000,
                "stage3_max_live_parameters": 1_000_000_000,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    if stage == 3 and par.hsdp:
        # HSDP shards within groups of shard_degree GPUs; ZeRO++'s secondary partition keeps a parameter shard
        # per group of that size, so the all-gathers stay inside it as the plan's do.
        zero["zero_hpz_partition_size"] = par.shard_degree
    host_optimizer = recipe_of(w).optimizer_offload and not par.offload
    if host_optimizer and stage == 0:
        # ZeRO-Offload needs a ZeRO stage; on one GPU stage 2 partitions nothing and offloads the optimizer.
        zero["stage"] = stage = 2
        zero["allgather_bucket_size"] = BUCKET_ELEMENTS
    if par.offload_optimizer or host_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if par.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg: dict[str, Any] = {
        "train_batch_size": par.micro_batch * par.grad_accum * par.dp,
        "train_micro_batch_size_per_gpu": par.micro_batch,
        "gradient_accumulation_steps": par.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": w.precision == "bf16"},
        "fp16": {"enabled": w.precision == "fp16"},
        "zero_optimization": zero,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if par.checkpointing != "none":
        # DeepSpeed's section configures its checkpointing; the model's layers must still be run through it
        # (Transformers: model.gradient_checkpointing_enable(); otherwise deepspeed.checkpointing.checkpoint).
        # DeepSpeed ignores top-level keys it does not know, so the note below travels with the file.
        cfg["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
        cfg["rigpilot"] = {
            "activation_checkpointing": par.checkpointing,
            "note": CHECKPOINTING_NOTE,
        }
    recipe = recipe_of(w)
    if recipe.master_weights == "bf16":
        # DeepSpeed's low-precision model states (DeepSpeed PR 7700): no fp32 master copy, bf16 optimizer state.
        cfg["bf16"].update({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True})
    if recipe.optimizer_in_backward:
        cfg["gradient_clipping"] = 0.0
    if not recipe.plain:
        # DeepSpeed ignores top-level keys it does not know: what its config cannot say travels in the file.
        cfg.setdefault("rigpilot", {})["recipe"] = recipe_words(w)
        script = _script_recipe(recipe, "DeepSpeed's config")
        if script:
            cfg["rigpilot"]["not_in_this_config"] = script
    if w.precision == "fp16":
        cfg["fp16"].update({"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1})
    if par.offload_optimizer or par.offload_params or host_optimizer:
        # ZeRO-Offload steps with DeepSpeed's CPU Adam, which it builds only from a config optimizer.
        # The learning rate is a placeholder for the training script's own.
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}
    return cfg


SLURM_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}|UNLIMITED|INFINITE)$")
SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# torch.distributed reads its place in the job from these; SLURM numbers the tasks of a step the same way.
_RANK_FROM_SLURM = (
    "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS "
    'LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE; exec "$@"'
)


def check_slurm_options(partition: str | None, account: str | None, time_limit: str | None) -> None:
    """Refuse, in one line, what sbatch would misread: these go into `#SBATCH` lines of the script."""
    for flag, value in (("--partition", partition), ("--account", account)):
        if value is not None and not SLURM_NAME.match(value):
            raise UserError(f"{flag} {value!r} is not a SLURM name (letters, digits, '_', '.', '-')")
    if time_limit is not None and not SLURM_TIME.match(time_limit):
        raise UserError(
            f"--time {time_limit!r} is not a SLURM time limit: MINUTES, HH:MM:SS, DAYS-HH:MM:SS or UNLIMITED"
        )


def slurm_script(
    plan: Plan | None,
    *,
    nodes: int | None = None,
    script: str | None = None,
    plan_path: str = "plan.json",
    partition: str | None = None,
    account: str | None = None,
    time_limit: str | None = None,
    command: list[str] | None = None,
    env: dict[str, str] | None = None,
    ranks_per_node: int | None = None,
    gpus_per_node: int | None = None,
    job_name: str | None = None,
    output: str | None = None,
) -> str:
    """An sbatch script running the plan: a multi-node plan on its own nodes; a one-node plan's per-node
    layout on `nodes` nodes (default 1), data-parallel across them.

    One SLURM task per rank: SLURM starts every rank itself (srun), places them, signals them on
    scancel and accounts for each, and torch.distributed joins them from SLURM's own numbering with
    the first node as its rendezvous. The engine submits exactly this script for `rigpilot run
    --slurm`, giving the job's own `command` (its ranks write metrics and logs into the job folder)
    and `env`, and `ranks_per_node`/`gpus_per_node` where simulated GPUs run as CPU ranks; without a
    plan those must be given.
    """
    if nodes is None:
        nodes = plan.parallelism.nodes if plan is not None else 1
    if nodes < 1:
        raise refusal("{nodes} must be at least 1", reason="out_of_range",
                      fields={"setting": "nodes", "value": nodes, "lo": 1}, nodes=ref("nodes"))  # fmt: skip
    if plan is not None and plan.parallelism.nodes > 1 and nodes != plan.parallelism.nodes:
        raise refusal("this plan spans {spans} nodes; plan again with {nodes} to run it on {n}",
                      reason="nodes_mismatch", fields={"setting": "nodes", "value": nodes},
                      spans=plan.parallelism.nodes, nodes=ref("nodes", nodes), n=nodes)  # fmt: skip
    check_slurm_options(partition, account, time_limit)
    if plan is None and (command is None or ranks_per_node is None):
        raise UserError("a SLURM script without a plan needs the job's command and its ranks per node")
    if plan is not None:
        par, w = plan.parallelism, plan.workload
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", w.model.split("/")[-1]).strip("-") or "job"
        ranks = ranks_per_node or par.gpus_per_node
        gpus = par.gpus_per_node if gpus_per_node is None else gpus_per_node
        env = {**_env(plan), **(env or {})}
        comments = [f"# Rigpilot plan{'' if par.nodes > 1 else ', per node'}: {par.describe()}."]
        if nodes > 1 and par.nodes == 1 and w.training:
            comments.append(f"# Data parallelism spans the {nodes} nodes: each optimizer step sees {nodes} × {w.global_batch} sequences.")
        line = " ".join(shlex.quote(a) for a in command) if command else _script_line(plan, script, plan_path)
    else:
        assert command is not None and ranks_per_node is not None
        name, ranks, gpus, env, comments = "job", ranks_per_node, gpus_per_node or 0, dict(env or {}), []
        line = " ".join(shlex.quote(a) for a in command)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name or 'rigpilot-' + name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={ranks}",
    ]
    if gpus:
        lines += [f"#SBATCH --gpus-per-node={gpus}", "#SBATCH --exclusive"]
    lines += [f"#SBATCH --{flag}={value}" for flag, value in
              (("partition", partition), ("account", account), ("time", time_limit)) if value]  # fmt: skip
    if output:
        # A resumed job's run appends to the same log, as the engine's own launcher log does.
        lines += [f"#SBATCH --output={output}", "#SBATCH --open-mode=append"]
    else:
        lines.append("#SBATCH --output=%x-%j.out")
    lines += [
        *comments,
        "set -euo pipefail",
        "",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'export MASTER_ADDR="$head"',
        "# One port per job, so jobs sharing a node do not meet at the same rendezvous.",
        f"export MASTER_PORT=$(({RDZV_PORT} + SLURM_JOB_ID % 20000))",
        *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
        "",
        f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(_RANK_FROM_SLURM)} rank \\",
        f"    {line}",
    ]
    return "\n".join(lines) + "\n"


# -- a small YAML writer (mappings, lists and scalars: all an Accelerate config holds) ---------------------------

_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")
_RESERVED = {"yes", "no", "true", "false", "on", "off", "null", "y", "n", "~"}


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, int | float):
        return repr(v)
    s = str(v)
    if _PLAIN.match(s) and s.lower() not in _RESERVED:
        return s
    return "'" + s.replace("'", "''") + "'"


def to_yaml(d: dict[str, Any], indent: int = 0) -> str:
    pad = "  " * indent
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out.append(f"{pad}{k}:" + (" {}" if not v else ""))
            if v:
                out.append(to_yaml(v, indent + 1).rstrip("\n"))
        elif isinstance(v, list):
            out.append(f"{pad}{k}: [{', '.join(_scalar(x) for x in v)}]")
        else:
            out.append(f"{pad}{k}: {_scalar(v)}")
    return "\n".join(out) + "\n"
