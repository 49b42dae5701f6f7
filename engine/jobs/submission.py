"""Checking a submitted job before anything is created for it.

Everything a user can get wrong (no dataset, an empty or missing file, a
corrupt config.json, a GPU the machine does not have, degrees that do not
multiply to the rank count) is found here and raised as one `UserError`, so a
bad submission leaves no folder and no row behind.

A job submitted with a plan (the planner's `Plan` JSON, engine.planner.plan)
runs under it: GPUs and parallel degrees where the submission left them open,
and for training the micro-batch, gradient accumulation (pipeline micro-batches
under pipeline parallelism), activation checkpointing, sequence length and
precision, which the plan decides over the submission's own values because its
memory and speed figures were computed for them. What was taken is recorded in
the job (`predicted.from_plan`, with `predicted.plan_notes`).

A job also needs room in the engine's state folder (`disk_need`): a training job
about one checkpoint (full training: fp32 weights and AdamW's two moments, 12
bytes a parameter; LoRA: the adapters and theirs) and its final model, every job
its logs and metrics. The supervisor refuses a job while the folder has less.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from rigpilot.engine import runtime
from rigpilot.engine.api.protocol import check_dataclass
from rigpilot.engine.capability import (
    BackendChoice,
    RecipeContext,
    WorkerVllm,
    backend_words,
    choose_infer_backend,
    why_not,
)
from rigpilot.engine.diskspace import human_size
from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import EITHER, FILE, FOLDER, Expect, check_given_path, open_given_file
from rigpilot.engine.hardware.machine import Machine, short_gpu_name
from rigpilot.engine.jobs import machine_check as machine_checks
from rigpilot.engine.jobs import serve_source
from rigpilot.engine.jobs.limits import check_job_settings
from rigpilot.engine.jobs.store import JobRecord
from rigpilot.engine.jobspec.spec import (
    IN_BACKWARD_UNDER_DDP_NOTE,
    TRAIN_SETTINGS,
    InferSettings,
    JobSpec,
    ServeSettings,
    TrainSettings,
)
from rigpilot.engine.layout import Layout, accumulation_of_plan, schedule_name
from rigpilot.engine.models.config_file import CONFIG_MAX
from rigpilot.engine.models.formulas import is_decoder
from rigpilot.engine.planner.amounts import fmt_gib
from rigpilot.engine.planner.plan import Plan, recipe_words
from rigpilot.engine.recipe import RECIPE_SETTINGS, Recipe
from rigpilot.engine.recipe_refusal import check_recipe
from rigpilot.engine.schema import (
    ADAPTER_METHODS,
    FINE_TUNE_METHODS,
    Checkpointing,
    MasterWeights,
    Precision,
    TrainMethod,
)  # fmt: skip

KINDS = ("train", "infer", "script", "calibrate", "doctor", "serve")
ENGINE_FIELDS = frozenset({"id", "spec_version", "simulated", "upgrade_notes"})  # a submission's are ignored
# Room every job needs besides its checkpoints and model: its logs, metrics and record.
JOB_ROOM_BYTES = 1 << 20


@dataclass
class Submission:
    spec: JobSpec
    plan: dict[str, Any] | None
    ranks: int
    cwd: str | None
    predicted: dict[str, Any] | None  # plan_prediction(), plus `from_plan` and `plan_notes` when a plan was applied
    from_plan: dict[str, Any] = field(default_factory=dict)  # job settings taken from the plan, by name
    notes: list[str] = field(default_factory=list)  # how the plan was mapped onto what jobs can run
    model_type: str | None = None  # config.json's model_type, where the model could be read here
    host_ram: dict[str, Any] = field(default_factory=dict)  # the plan's host-RAM figures beside this host's
    backend: BackendChoice | None = None  # inference jobs: the generator that runs and why
    disk_need: int = JOB_ROOM_BYTES  # bytes the job needs free in the state folder (see disk_need)
    disk_need_what: str = ""  # what they are for, in words, where more than logs and metrics
    machine_check: dict[str, Any] | None = None  # what the machine check sets for the job (engine.jobs.machine_check)


def prepare(
    spec_data: dict[str, Any],
    plan: dict[str, Any] | None,
    cwd: str | None,
    *,
    job_id: str,
    machine: Machine,
    max_cpu_ranks: int,
    nodes: int = 1,
    slurm: bool = False,
    worker_vllm: Callable[[], WorkerVllm] | None = None,
    machine_check: dict[str, Any] | None = None,
    jobs: tuple[Callable[[str], list[JobRecord]], Path] | None = None,
) -> Submission:
    """A checked, complete JobSpec for `spec_data` (JobSpec fields; `id` is the service's to give).

    `nodes` > 1: the job spans that many identical nodes (engine.service.multinode); `ranks` is then
    what runs on this one, and the parallel degrees stay global (they multiply to nodes × ranks).
    An inference job that runs on vLLM has one process (`ranks` 1): vLLM starts a worker per GPU itself.
    `worker_vllm` says whether vLLM is installed where the job runs (default: engine.runtime.worker_vllm);
    it is asked only when nothing else rules vLLM out. `slurm`: the job goes to a SLURM cluster.
    `machine_check`: the engine's stored machine check of this machine (its JSON), which may set variables for
    the job's ranks (engine.jobs.machine_check). `jobs`: (find, the jobs' folder) of the engine's jobs, which a
    serve submission may name in place of a model or an adapter (engine.jobs.serve_source).
    """
    data = _given_fields(spec_data)
    base = _working_folder(cwd)
    if jobs is not None:
        find, root = jobs
        data = serve_source.with_job_folders(data, base, find, lambda job_id: root / job_id)
    # A script only gets the plan's predictions (plan_prediction reads them): how it splits the work is its own.
    planned = parse_plan(plan) if data.get("kind") != "script" else None
    spec = JobSpec.from_dict({**data, "id": job_id})
    check_job_settings(spec)  # the user's own values, named as they gave them
    spec.simulated = machine.simulated
    from_plan: dict[str, Any] = {}
    notes: list[str] = []
    if planned is not None:
        from_plan, notes = _take_plan_layout(spec, planned, nodes, machine)
    ranks, dp_shrink = _place_ranks(spec, machine, max_cpu_ranks, nodes, notes)
    model_type = _check_kind(spec, data, base, planned, ranks * nodes, dp_shrink, from_plan, notes)
    if spec.kind in ("train", "infer"):
        model_type = model_type or (planned.model_type if planned else None) or None
        _check_runs(spec, model_type, planned, nodes, machine, decoder=_decoder(spec, base))
    backend = None
    if spec.kind == "infer" and spec.infer:
        backend = _choose_backend(spec, spec.infer, machine, worker_vllm, nodes=nodes, slurm=slurm, notes=notes)
        if backend.name == "vllm":
            ranks = 1
    check_job_settings(spec)  # and once more with what the plan and the defaults filled in
    host_ram = _check_host_ram(planned, machine, notes)
    predicted = plan_prediction(plan)
    if (planned is not None and from_plan) or notes:
        predicted = {**(predicted or {}), "from_plan": from_plan, "plan_notes": notes}
    need, need_what = disk_need(spec, _model_config(spec.model, base)[1] if spec.kind == "train" and spec.model else {})
    return Submission(
        spec, plan, ranks, str(base) if base else None, predicted, from_plan, notes, model_type, host_ram, backend,
        need, need_what, machine_checks.for_job(machine_check, spec, slurm=slurm),
    )


def _given_fields(spec_data: dict[str, Any]) -> dict[str, Any]:
    """The submission's own JobSpec fields, checked by type; the id, version, simulated flag and upgrade notes are
    the engine's, and ignored in a submission (as a job.json sent back would carry them)."""
    check_dataclass(JobSpec, spec_data, "spec", ignore=ENGINE_FIELDS)
    data = {k: v for k, v in spec_data.items() if k not in ENGINE_FIELDS}
    if data.get("kind") not in KINDS:
        raise UserError(f"unknown job kind {data.get('kind')!r}; choose one of {', '.join(KINDS)}")
    return data


def _take_plan_layout(spec: JobSpec, planned: Plan, nodes: int, machine: Machine) -> tuple[dict[str, Any], list[str]]:
    """The plan's GPUs and degrees where the submission left them open, once the plan is known to run here."""
    check_plan_runs(spec, planned)
    check_plan_machine(planned, machine)
    spans = planned.parallelism.nodes
    if spans > 1 and spans != nodes:
        # Else the degrees, made for every node's ranks, would be checked against this node's alone.
        raise UserError(
            f"this plan spans {spans} nodes: run it with --nodes local,NODE… naming {spans} engines "
            f"(see 'rigpilot nodes'), or plan for {nodes} node{'s' * (nodes != 1)}"
        )
    return apply_plan_layout(spec, planned)


def _place_ranks(spec: JobSpec, machine: Machine, max_cpu_ranks: int, nodes: int, notes: list[str]) -> tuple[int, float]:
    """The job's GPUs and its ranks on this node, and how many times fewer data-parallel replicas run than the
    layout has (more than 1 where simulated GPUs became fewer CPU ranks)."""
    spec.gpus = _check_gpus(spec.gpus or _default_gpus(spec, machine, nodes), machine)
    ranks = len(spec.gpus)
    dp_shrink = 1.0
    if machine.simulated:
        # Simulated GPUs become CPU ranks; more ranks than cores only makes every rank slower.
        # The machine check tests every pair of GPUs, so each simulated GPU keeps a rank of its own: its
        # checks are short and small, and fewer ranks would leave pairs untested.
        ranks = ranks if spec.kind == "doctor" else max(1, min(ranks, max_cpu_ranks))
        if spec.kind != "script" and spec.parallelism.world_size == nodes * len(spec.gpus) > nodes * ranks:
            dp_before = spec.parallelism.dp
            # the degrees fit the GPUs, not the CPU ranks
            ranks = _per_node(_fit_to_cpu_ranks(spec, ranks * nodes, notes), nodes)
            dp_shrink = dp_before / spec.parallelism.dp
    return ranks, dp_shrink


def _check_kind(
    spec: JobSpec, data: dict[str, Any], base: Path | None, planned: Plan | None, world: int, dp_shrink: float,
    from_plan: dict[str, Any], notes: list[str],
) -> str | None:  # fmt: skip
    """What each kind of job needs checked (its files, model and degrees over `world` ranks); the model's type
    where its config could be read. A training job also takes the plan's training settings here."""
    model_type = None
    if spec.kind == "script":
        _check_script(spec, base)
    elif spec.kind == "train":
        spec.train = spec.train or TrainSettings()
        if planned is not None:
            for apply in (partial(apply_plan_method, given=data.get("train") or {}), apply_plan_training):
                taken, more = apply(spec, planned)
                from_plan.update(taken)
                notes += more
        if dp_shrink > 1:
            _keep_global_batch(spec.train, dp_shrink, notes)
        _pipeline_defaults(spec, "pp_microbatches" in (data.get("parallelism") or {}) or "pp_microbatches" in from_plan, notes)
        seq_given = "seq_len" in (data.get("train") or {}) or "seq_len" in from_plan
        model_type = _check_train(spec, base, seq_given, notes)
        _check_degrees(spec, world, notes)
    elif spec.kind == "infer":
        spec.infer = spec.infer or InferSettings()
        model_type = _check_infer(spec, base)
        _check_degrees(spec, world)
    elif spec.kind == "serve":
        spec.serve = spec.serve or ServeSettings()
        model_type = _check_serve(spec, base, world)
    elif spec.kind == "doctor":
        _check_degrees(spec, world)
    elif spec.kind == "calibrate":
        _check_degrees(spec, world)
        if spec.model:
            spec.model, model_type = _check_model(spec.model, base)
    return model_type


def _choose_backend(
    spec: JobSpec, infer: InferSettings, machine: Machine, worker_vllm: Callable[[], WorkerVllm] | None, *,
    nodes: int, slurm: bool, notes: list[str],
) -> BackendChoice:  # fmt: skip
    """The generator an inference job runs on, recorded in its settings with why; a refusal raises."""
    backend = choose_infer_backend(
        infer.backend, spec.parallelism, simulated=machine.simulated,
        worker_vllm=worker_vllm or runtime.worker_vllm, temperature=infer.temperature, nodes=nodes, slurm=slurm,
    )  # fmt: skip
    if backend.refusal:
        raise UserError(backend.refusal)
    infer.backend, infer.backend_reason = backend.name, backend.reason
    notes.append(f"inference backend: {backend_words(backend.name, backend.reason)}")
    return backend


def disk_need(spec: JobSpec, config: dict[str, Any]) -> tuple[int, str]:
    """(bytes, what they are for) a job needs free: one checkpoint and the final model for training, where the
    model's size is known from its config; logs and metrics for every job."""
    t = spec.train
    params = _params(config)
    if spec.kind != "train" or t is None or params is None:
        return JOB_ROOM_BYTES, ""
    # Master weights, and AdamW's two moments, are fp32 (4 bytes each) or bf16 (2) as the job says.
    state = 2 if t.master_weights == "bf16" else 4
    saved = state if t.method == "scratch" else _dtype_bytes(config)
    if t.method in ADAPTER_METHODS:
        adapters = _lora_params(config, t) or params // 100
        checkpoint, model = adapters * 3 * state, adapters * state + (params * saved if t.save_merged else 0)
        what = ["a {} checkpoint of the adapters and their optimizer state", "the {} adapter"]
        if t.save_merged:
            what[1] = "the {} adapter and merged model"
    else:
        checkpoint, model = params * 3 * state, params * saved  # the weights and AdamW's two moments
        what = ["a {} checkpoint of the weights and optimizer state", "the {} final model"]
    if t.checkpoint_every <= 0:
        checkpoint, what = 0, what[1:]
    sizes = [human_size(n) for n in ([checkpoint] if checkpoint else []) + [model]]
    words = ", and ".join(w.format(n) for w, n in zip(what, sizes, strict=True))
    return checkpoint + model + JOB_ROOM_BYTES, words


def _params(config: dict[str, Any]) -> int | None:
    from rigpilot.engine.models.formulas import has_formula, spec_from_config

    if not config or not has_formula(config):
        return None
    try:
        return spec_from_config(config).params_total
    except (UserError, ValueError, TypeError, KeyError):
        return None


def _lora_params(config: dict[str, Any], t: TrainSettings) -> int | None:
    from rigpilot.engine.models.formulas import spec_from_config
    from rigpilot.engine.planner.model import model_facts

    try:
        facts = model_facts(spec_from_config(config))
        return facts.lora_params(t.lora_rank, facts.resolve_targets(t.lora_targets or "all-linear"))
    except (UserError, ValueError, TypeError, KeyError):
        return None


def _dtype_bytes(config: dict[str, Any]) -> int:
    dtype = config.get("torch_dtype", config.get("dtype"))
    return 2 if dtype in ("bfloat16", "float16") else 4


def _keep_global_batch(t: TrainSettings, shrink: float, notes: list[str]) -> None:
    """Fewer replicas each accumulate more micro-batches, so a step still sees the planned global batch."""
    factor = round(shrink)
    if abs(shrink - factor) > 1e-9 or factor < 1:
        notes.append(
            f"simulated: {shrink:g} times fewer replicas do not divide the accumulation evenly; "
            f"the global batch is {1 / shrink:.2g} of the plan's"
        )
        return
    if t.optimizer_in_backward:
        # The optimizer step in backward cannot accumulate: each replica takes a larger micro-batch instead.
        before = t.micro_batch
        t.micro_batch *= factor
        notes.append(
            f"simulated: the micro-batch rises from {before} to {t.micro_batch} (the optimizer step in backward "
            "cannot accumulate) so each step still trains the plan's global batch"
        )
        return
    before = t.grad_accum
    t.grad_accum *= factor
    notes.append(
        f"simulated: gradient accumulation rises from {before} to {t.grad_accum} so each step still trains "
        "the plan's global batch"
    )


def _pipeline_defaults(spec: JobSpec, microbatches_given: bool, notes: list[str]) -> None:
    """A pipeline needs micro-batches to overlap its stages: at least one per stage unless the user said otherwise."""
    p = spec.parallelism
    if p.pp <= 1:
        return
    if not microbatches_given and p.pp_microbatches < p.pp:
        spec.parallelism = p = dataclasses.replace(p, pp_microbatches=p.pp)
        notes.append(f"pipeline micro-batches default to the number of stages ({p.pp})")
    if p.pp_schedule == "1F1B" and p.pp_microbatches < p.pp:
        spec.parallelism = dataclasses.replace(p, pp_schedule="GPipe")
        notes.append(
            f"1F1B needs at least {p.pp} pipeline micro-batches and the job has {p.pp_microbatches}: GPipe runs instead"
        )


def _check_host_ram(plan: Plan | None, machine: Machine, notes: list[str]) -> dict[str, Any]:
    """Refuse a plan whose host RAM does not fit the host that runs it; returns the figures, named.

    A real machine runs its ranks on this host, so the plan's need is checked against this host's
    RAM. A simulated machine's plan was checked against the simulated profile's RAM by the planner,
    while its CPU ranks run here: both figures are kept, each under its own name.
    """
    import psutil

    needed = plan.host.needed if plan is not None and _is_int(plan.host.needed) else None
    if plan is None or needed is None:
        return {}
    this_host = psutil.virtual_memory().total
    out: dict[str, Any] = {"this_host": this_host, "simulated": machine.simulated}
    out["plan_needs"] = needed
    out["offloaded"] = plan.host.offloaded if _is_int(plan.host.offloaded) else 0
    if machine.simulated:
        out["plan_machine"] = machine.host.memory_total
        params, work = plan.model_params, plan.workload
        if _is_int(params) and work.task == "train":
            # CPU ranks keep every byte a GPU would (fp32 weights, gradients, AdamW moments) in this host's RAM.
            state = params * 16 if work.method == "full" else params * 4
            if state > this_host:
                notes.append(
                    f"simulated: its CPU ranks would keep about {fmt_gib(state)} of model state in this host's "
                    f"{fmt_gib(this_host)} of RAM and run out of memory; simulated machines run small models"
                )
        return out
    if needed > this_host:
        offloaded = f", {fmt_gib(out['offloaded'])} of it offloaded state" if out["offloaded"] else ""
        raise UserError(
            f"this plan needs {fmt_gib(needed)} of host RAM{offloaded}; this machine has {fmt_gib(this_host)}: "
            "plan again with fewer offloaded GPUs' worth of state, or without CPU offload"
        )
    return out


def describe(sub: Submission, free: int | None = None) -> list[str]:
    """What a submission would run, in lines a person reads (the CLI's --check and the wizard's Review page).

    `free`: the state folder's free bytes, said beside what the job needs there."""
    spec, p = sub.spec, sub.spec.parallelism
    where = f"{sub.ranks} CPU rank{'s' * (sub.ranks != 1)} (simulated GPUs)" if spec.simulated else f"{sub.ranks} ranks"
    if sub.backend is not None and sub.backend.name == "vllm":
        where = "one vLLM process, which starts a worker per GPU itself"
    gpus = ",".join(map(str, spec.gpus))
    what = spec.kind
    if spec.kind == "train" and spec.train:
        what = f"train ({spec.train.method})"
    lines = [f"would run: {what} of {spec.model or ' '.join(spec.script or [])} on GPUs {gpus} as {where}"]
    if spec.kind in ("train", "infer"):
        layout = p.words()
        how = []
        if p.dp_shard > 1 or p.cpu_offload:
            how.append("FSDP2" + ("" if p.reshard_after_forward else " without resharding after forward (ZeRO-2)"))
        if p.cpu_offload:
            how.append("parameters, gradients and optimizer state offloaded to CPU RAM")
        if p.tp > 1 and p.sequence_parallel:
            how.append("sequence parallel")
        if p.pp > 1:
            how.append(f"pipeline {p.pp_schedule}, {p.pp_microbatches} micro-batches per schedule run")
        lines.append(f"layout: {layout}" + (f" ({'; '.join(how)})" if how else ""))
    if spec.kind == "train" and spec.train:
        t = spec.train
        lines.append(
            f"training: {t.precision}{', bf16 master weights' if t.master_weights == 'bf16' else ''}, "
            f"micro-batch {t.micro_batch} × {t.grad_accum} accumulation, "
            f"sequence {t.seq_len}, {t.max_steps} steps, activation checkpointing {t.activation_checkpointing}"
        )
        if not Recipe.of(t).plain:
            lines.append(f"recipe: {recipe_words(t)}")
    elif spec.kind == "infer" and spec.infer:
        i = spec.infer
        sampling = "greedy" if i.temperature == 0 else f"temperature {i.temperature:g}, top-p {i.top_p:g}, seed {i.seed}"
        batch = "vLLM batches the prompts itself" if i.backend == "vllm" else f"batch {i.batch_size}"
        lines.append(f"inference: {i.precision}, up to {i.max_new_tokens} new tokens, {batch}, {sampling}")
    elif spec.kind == "serve" and spec.serve:
        v = spec.serve
        port = f"port {v.port}" if v.port else "a free port"
        lines.append(
            f"serving: an OpenAI-compatible API on {v.listen}, {port}; {v.precision}, up to {v.max_batch} requests "
            f"decoded together, {v.max_concurrent} at once, {v.max_new_tokens} new tokens a request"
        )
        if v.tls_cert:
            lines.append("access: TLS with the engine's certificate, and the job's API key (printed once it serves)")
        if v.adapters:
            lines.append(f"LoRA adapters, unmerged, by name: {', '.join(sorted(v.adapters))}")
    lines += machine_checks.lines(sub.machine_check)
    ram = sub.host_ram
    if "plan_needs" in ram:
        if ram.get("simulated"):
            machine_ram = ram.get("plan_machine")
            of = f" of the simulated machine's {fmt_gib(machine_ram)}" if machine_ram else ""
            lines.append(
                f"host RAM: the plan needs {fmt_gib(ram['plan_needs'])}{of}; this host, which runs the CPU ranks, "
                f"has {fmt_gib(ram['this_host'])}"
            )
        else:
            lines.append(f"host RAM: the plan needs {fmt_gib(ram['plan_needs'])} of {fmt_gib(ram['this_host'])}")
    if sub.disk_need_what:
        room = f"; {human_size(free)} free" if free is not None else ""
        lines.append(f"disk: about {human_size(sub.disk_need)} ({sub.disk_need_what}){room}")
    lines += [f"note: {n}" for n in sub.notes]
    return lines


def would_run(sub: Submission) -> dict[str, Any]:
    """The same as `describe`, as data: what the check request answers besides the lines."""
    spec = sub.spec
    out: dict[str, Any] = {
        "kind": spec.kind,
        "model": spec.model,
        "model_type": sub.model_type,
        "ranks": sub.ranks,
        "gpus": list(spec.gpus),
        "simulated": spec.simulated,
        "parallelism": spec.parallelism.to_dict(),
        "notes": list(sub.notes),
        "host_ram": dict(sub.host_ram),
        "disk_need_bytes": sub.disk_need,
    }
    if spec.train:
        t = spec.train
        out.update(method=t.method, precision=t.precision, master_weights=t.master_weights,
                   micro_batch=t.micro_batch, grad_accum=t.grad_accum,
                   seq_len=t.seq_len, max_steps=t.max_steps, activation_checkpointing=t.activation_checkpointing)  # fmt: skip
    elif spec.infer:
        out.update(method="full", precision=spec.infer.precision, micro_batch=spec.infer.batch_size, grad_accum=1,
                   seq_len=None, backend=spec.infer.backend, backend_reason=spec.infer.backend_reason)  # fmt: skip
    return out


def _fit_to_cpu_ranks(spec: JobSpec, cap: int, notes: list[str]) -> int:
    """Shrink the data-parallel degree so the job fits the simulated machine's CPU ranks; returns the ranks.

    Tensor and pipeline degrees shape the model itself, so they are kept; data parallelism only
    repeats the work. A model split wider than the cap still runs, its ranks sharing the cores:
    the cap is about speed, and refusing would refuse the very plans the planner recommends.
    """
    p = spec.parallelism
    model_ranks = p.tp * p.pp
    before = f"dp {p.dp_replicate} × fsdp {p.dp_shard}"
    if model_ranks >= cap:
        spec.parallelism = dataclasses.replace(p, dp_replicate=1, dp_shard=1)
        notes.append(
            f"simulated: {len(spec.gpus)} GPUs run as {model_ranks} CPU ranks (tp {p.tp} × pp {p.pp}); data "
            f"parallelism shrinks from {before} to 1"
            + (f", and the ranks share this machine's cores (it runs {cap} per job well)" if model_ranks > cap else "")
        )
        return model_ranks
    dp = cap // model_ranks
    shard = max(d for d in range(1, min(p.dp_shard, dp) + 1) if dp % d == 0)
    spec.parallelism = p = dataclasses.replace(p, dp_replicate=dp // shard, dp_shard=shard)
    notes.append(
        f"simulated: {len(spec.gpus)} GPUs run as {dp * model_ranks} CPU ranks (at most {cap} per job), so data "
        f"parallelism shrinks from {before} to dp {p.dp_replicate} × fsdp {p.dp_shard}; tp and pp are kept"
    )
    return dp * model_ranks


def _per_node(total: int, nodes: int) -> int:
    if total % nodes:
        raise UserError(f"{total} CPU ranks do not split evenly over {nodes} nodes; give the degrees yourself")
    return total // nodes


def _default_gpus(spec: JobSpec, machine: Machine, nodes: int = 1) -> list[int]:
    if spec.kind == "serve":  # one rank, or as many as its degrees (_check_serve)
        return [g.index for g in machine.gpus][: spec.parallelism.world_size]
    want = spec.parallelism.world_size // nodes if spec.parallelism.world_size % nodes == 0 else 1
    all_gpus = [g.index for g in machine.gpus]
    return all_gpus[:want] if want > 1 else all_gpus


def _check_gpus(gpus: list[int], machine: Machine) -> list[int]:
    known = [g.index for g in machine.gpus]
    if not known:
        raise UserError("this machine has no GPU to run a job on")
    for g in gpus:
        if g not in known:
            raise UserError(f"GPU {g} does not exist; this machine has GPUs {_ranges(known)} ({machine.label})")
    if len(set(gpus)) != len(gpus):
        raise UserError(f"GPU list {gpus} names a GPU twice")
    return list(gpus)


def _ranges(indices: list[int]) -> str:
    return f"{indices[0]}–{indices[-1]}" if len(indices) > 1 else str(indices[0])


def _resolve(path: str, base: Path | None, what: str, expect: Expect = FILE, *, missing_ok: bool = False) -> Path:
    """A path of the submission, checked (engine.given_path); relative ones are under the client's `base`."""
    if not path.startswith(("/", "~")) and base is None:
        raise UserError(f"{path}: give an absolute path (no working folder was sent)")
    return check_given_path(path, what, expect=expect, base=base, missing_ok=missing_ok)


def _check_script(spec: JobSpec, base: Path | None) -> None:
    if not spec.script:
        raise UserError("a script job needs the script to run: rigpilot run script -- path/to/script.py [args]")
    script = _resolve(spec.script[0], base, "script", EITHER)
    if script.is_dir():
        raise UserError(f"script {script} is a folder; give the Python file to run: rigpilot run script -- FILE.py")
    spec.script = [str(script), *spec.script[1:]]


def _check_train(spec: JobSpec, base: Path | None, seq_given: bool, notes: list[str]) -> str | None:
    """Model and data of a training job (the settings' ranges are engine.jobs.limits'); returns the model type."""
    t = spec.train
    assert t is not None
    if not spec.model:
        raise UserError("a training job needs a model (--model PRESET, FOLDER, HUB-ID or config.json)")
    spec.model, config = _model_config(spec.model, base)
    context = config.get("max_position_embeddings")
    if _is_int(context) and context > 0 and t.seq_len > context:
        if seq_given:
            raise UserError(
                f"sequence length {t.seq_len} is longer than the model's context of {context} tokens; "
                f"use --seq {context} or less",
                reason="seq_too_long", setting="train.seq_len", value=t.seq_len, limit=context,
            )  # fmt: skip
        notes.append(f"sequence length {context}: the model's context (the default {t.seq_len} is longer)")
        t.seq_len = context
    if not t.dataset:
        raise UserError("a training job needs a dataset (--data FILE, repeatable)")
    t.dataset = [str(_check_data_file(f, base)) for f in t.dataset]
    return _model_type(config)


def _check_infer(spec: JobSpec, base: Path | None) -> str | None:
    i = spec.infer
    assert i is not None
    if not spec.model:
        raise UserError("an inference job needs a model (--model PRESET, FOLDER or HUB-ID)")
    spec.model, model_type = _check_model(spec.model, base)
    if i.prompts_file:
        i.prompts_file = str(_check_data_file(i.prompts_file, base, "prompts file"))
    elif not [p for p in i.prompts if p.strip()]:
        raise UserError("an inference job needs prompts (--prompts FILE or --prompt TEXT)")
    return model_type


def _check_serve(spec: JobSpec, base: Path | None, world: int) -> str | None:
    """A served model runs on one rank, or split over its GPUs by tensor parallelism (the degree not given: all
    of them) or into pipeline stages; replicas and mixed layouts come later, and adapters are served on one
    rank."""
    if not spec.model:
        raise UserError("a served model needs a model (a preset, a model folder or a Hugging Face repo id)")
    p = spec.parallelism
    if p.world_size == 1 and world > 1:
        p = spec.parallelism = dataclasses.replace(p, tp=world)
    assert spec.serve is not None
    one_way = p.world_size in (p.tp, p.pp)
    if not one_way or world != p.world_size or (p.world_size > 1 and spec.serve.adapters):
        if not one_way:
            why = "a served model is split one way in this version: give --tp or --pp, not both, nor --dp"
        elif world != p.world_size:
            why = f"it needs {p.world_size} GPUs, and {world} are given: give as many (--gpus)"
        else:
            why = "LoRA adapters are served on one GPU in this version: give one GPU (--gpus 0)"
        raise UserError(
            f"serving on {max(world, p.world_size)} ranks (tp {p.tp}, pp {p.pp}) is not in this version: {why}",
            reason="serve_layout_unsupported", ranks=max(world, p.world_size), tp=p.tp, pp=p.pp,
        )  # fmt: skip
    spec.model, model_type = _check_model(spec.model, base)
    _check_serve_access(spec.serve)
    _check_adapters(spec, base)
    return model_type


def _check_serve_access(s: ServeSettings | None) -> None:
    """Beyond loopback, the engine's own TLS certificate (made on first use, as for its --tcp)."""
    from rigpilot.engine.workers.serve_setup import parse_listen

    if s is None:
        return
    s.listen, loopback = parse_listen(s.listen)
    s.tls_cert = s.tls_key = s.tls_fingerprint = ""  # the engine's to name, never the submitter's
    if loopback:
        return
    from rigpilot.engine.api.tls import load_or_create_identity

    try:
        identity = load_or_create_identity()
    except UserError as e:
        raise UserError(f"listening on {s.listen} needs TLS, and {e}", reason="serve_tls_unavailable",
                        listen=s.listen) from None  # fmt: skip
    s.tls_cert, s.tls_key, s.tls_fingerprint = str(identity.cert), str(identity.key), identity.fingerprint


MAX_ADAPTERS = 64  # every one is in memory and in every forward's bookkeeping
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def _check_adapters(spec: JobSpec, base: Path | None) -> None:
    from rigpilot.engine.workers.serve_setup import check_adapter_folder

    s = spec.serve
    if s is None or not s.adapters:
        return
    if not isinstance(s.adapters, dict):
        raise UserError("serve.adapters maps adapter names to their folders", reason="serve_adapter_invalid")
    if len(s.adapters) > MAX_ADAPTERS:
        raise UserError(f"{len(s.adapters)} adapters: one server takes {MAX_ADAPTERS} at most",
                        reason="serve_adapter_invalid", adapters=len(s.adapters))  # fmt: skip
    resolved = {}
    for name, folder in s.adapters.items():
        if not isinstance(name, str) or not _ADAPTER_NAME.fullmatch(name) or not isinstance(folder, str):
            raise UserError(f"adapter {name!r}: a name is letters, digits and . _ - : / (as model names are)",
                            reason="serve_adapter_invalid", adapter=str(name))  # fmt: skip
        if name == (s.base_name or spec.name):
            raise UserError(f"adapter {name!r} has the base model's name: give it another",
                            reason="serve_adapter_invalid", adapter=name)  # fmt: skip
        path = str(_resolve(folder, base, f"adapter {name}", FOLDER))
        check_adapter_folder(name, path)
        resolved[name] = path
    s.adapters = resolved


def _check_data_file(path: str, base: Path | None, what: str = "data file") -> Path:
    p = _resolve(path, base, what)
    with open_given_file(p, what) as f:
        try:
            has_text = any(line.strip() for line in f)
        except OSError as e:
            raise UserError(f"cannot read {what} {p}: {e.strerror}") from None
    if not has_text:
        raise UserError(f"{what} {p} is empty")
    return p


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or model.endswith(".json")


def _check_model(model: str, base: Path | None) -> tuple[str, str | None]:
    ref, config = _model_config(model, base)
    return ref, _model_type(config)


def _model_type(config: dict[str, Any]) -> str | None:
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else None


def _working_folder(cwd: str | None) -> Path | None:
    """The client's folder, against which relative paths resolve: checked as any path a person gave."""
    base = check_given_path(cwd, "working folder", expect=FOLDER) if cwd else None
    if base is not None and not base.is_absolute():
        raise UserError(f"working folder {cwd} must be an absolute path")
    return base


def default_seq_len(model: str, cwd: str | None) -> int:
    """A training's sequence length when none is given: the jobs' default, or the model's context where shorter.

    What a training job does (_check_train); a scaling study, which plans before it submits, asks here first.
    """
    default = TrainSettings.seq_len
    _, config = _model_config(model, _working_folder(cwd))
    context = config.get("max_position_embeddings")
    return min(default, context) if _is_int(context) and context > 0 else default


def _model_config(model: str, base: Path | None) -> tuple[str, dict[str, Any]]:
    """(the model reference, its config.json where it can be read here: a local model or a preset).

    Local models must be readable now; hub ids are the worker's to resolve ({} here)."""
    if _looks_like_path(model):
        candidate = _resolve(model, base, "model", EITHER)
    elif base is not None and _resolve(model, base, "model", EITHER, missing_ok=True).exists():
        candidate = base / model  # a folder name relative to where the user stands
    else:
        from rigpilot.engine.models.presets import find_preset, preset_for_repo
        from rigpilot.engine.models.repo_id import repo_id_problem

        preset = find_preset(model) or preset_for_repo(model)
        if preset is None and (problem := repo_id_problem(model)):
            raise UserError(f"model {model!r} is neither a preset, a local path nor a Hugging Face repo id: {problem}")
        return model, preset.config if preset else {}  # a preset or a hub id
    if candidate.is_dir():
        config = check_given_path(candidate / "config.json", "model config", missing_ok=True)
        if not config.exists():
            raise UserError(f"model folder {candidate} has no config.json")
    else:
        config = candidate
    try:
        with open_given_file(config, "model config") as f:
            raw = json.loads(f.read(CONFIG_MAX + 1))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"model config {config} is not valid JSON ({e})") from None
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"model config {config} is not a JSON object with the model's settings")
    return str(candidate), raw


def _check_degrees(spec: JobSpec, ranks: int, notes: list[str] | None = None) -> None:
    """No degrees given: plain data parallel over every rank; FSDP2 where the recipe steps the optimizer in
    backward, which frees each gradient as its weight steps under FSDP2 but nothing under DDP (its all-reduce
    buckets keep them all), so the contract refuses it there."""
    in_backward = spec.kind == "train" and spec.train is not None and spec.train.optimizer_in_backward
    if in_backward and spec.parallelism.world_size == 1 and ranks > 1:
        spec.parallelism = dataclasses.replace(spec.parallelism, dp_shard=ranks)
        if notes is not None:
            notes.append(
                f"FSDP2 over the {ranks} ranks: the optimizer step in backward frees each gradient only when the "
                "gradients are sharded (DDP keeps them all)"
            )
    spec.parallelism = spec.parallelism.fitted(ranks)


def plan_of(plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """The plan itself, from a plan or a whole search result (`rigpilot plan --json`: its best plan)."""
    if plan and isinstance(plan.get("best"), dict):
        return plan["best"]
    if plan and isinstance(plan.get("result"), dict):
        return plan_of(plan["result"])
    return plan


def parse_plan(plan: dict[str, Any] | None) -> Plan | None:
    """The plan a submission runs under (a plan, or a search result's best), read as the planner wrote it."""
    d = plan_of(plan)
    return None if d is None else Plan.from_dict(d)


def plan_prediction(plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the planner predicted for a job: the fields measurements are compared with.

    Reads the planner's `Plan` JSON (engine.planner.plan): the largest `memory[].total`
    is the peak per GPU, `timing.tokens_per_s` and `timing.step_s` the speed.
    """
    plan = plan_of(plan)
    if not plan:
        return None
    out: dict[str, Any] = {}
    memory = plan.get("memory")
    if isinstance(memory, list):
        totals = [m["total"] for m in memory if isinstance(m, dict) and _is_number(m.get("total"))]
        if totals:
            out["peak_memory_bytes"] = max(totals)
    timing = plan.get("timing")
    if isinstance(timing, dict):
        if _is_number(timing.get("tokens_per_s")) and timing["tokens_per_s"] > 0:
            out["tokens_per_s"] = timing["tokens_per_s"]
        if _is_number(timing.get("step_s")) and timing["step_s"] > 0:
            out["step_time_s"] = timing["step_s"]
    if out:
        out["suggestion"] = _oom_suggestion(plan.get("parallelism"))
    return out or None


def _oom_suggestion(par: Any) -> str:
    """The first memory saver the plan did not use yet, as the flag or setting to change."""
    par = par if isinstance(par, dict) else {}
    if par.get("checkpointing", "none") == "none":
        return "turn on activation checkpointing, or re-plan with 'rigpilot plan' for this machine"
    if (par.get("micro_batch") or 1) > 1:
        return f"halve the micro-batch (--micro-batch {max(par['micro_batch'] // 2, 1)}) and double gradient accumulation"
    if (par.get("zero_stage") or 0) < 3 and (par.get("dp") or 1) > 1:
        return "shard parameters, gradients and optimizer state (--fsdp) instead of replicating them"
    return "train LoRA adapters instead (--method lora), or use more GPUs"


def _check_runs(
    spec: JobSpec, model_type: str | None, plan: Plan | None, nodes: int, machine: Machine, *, decoder: bool = True
) -> None:
    """The capability contract, asked once, of the job as it will run: its layout (the plan's, where it left
    the degrees open) and method, and what only the plan says (the optimizer and weights it was sized for);
    then, for training, its recipe on this machine and model (engine.recipe_refusal: the setting is named).
    `decoder`: the model has an output head (see `_decoder`)."""
    method = spec.train.method if spec.kind == "train" and spec.train else "full"
    facts: dict[str, Any] = {}
    if plan is not None:
        w, par = plan.workload, plan.parallelism
        facts = dict(optimizer=w.optimizer or "adamw" if w.task == "train" else "adamw", weight_bits=w.weight_bits)
        if nodes > 1:
            facts.update(nodes=nodes, gpus_per_node=min(len(par.gpu_indices), spec.parallelism.world_size // nodes))
    reason = why_not(spec.parallelism, spec.kind, method=method, model_type=model_type, **facts)
    if reason:
        raise UserError(f"this plan does not run here: {reason}" if plan is not None else reason)
    if spec.kind == "train" and spec.train is not None:
        t = spec.train
        ctx = RecipeContext(
            t.method, t.precision, t.grad_accum, t.grad_clip,
            gpu_capability=_lowest_capability(machine, spec.gpus), cpu_ranks=machine.simulated, decoder=decoder,
        )  # fmt: skip
        check_recipe(Recipe.of(t), spec.parallelism, ctx)


def _decoder(spec: JobSpec, base: Path | None) -> bool:
    """Whether the training job's model has an output head, as the planner reads it from config.json; True where
    the config is not read here (a hub id: the rank asks its loaded model)."""
    if spec.kind != "train" or not spec.model:
        return True
    config = _model_config(spec.model, base)[1]
    return is_decoder(config) if config else True


def _lowest_capability(machine: Machine, gpus: list[int]) -> tuple[int, int] | None:
    """The lowest compute capability of the job's GPUs, None where one of them does not say (the worker checks)."""
    found: list[tuple[int, int]] = []
    for g in machine.gpus:
        if gpus and g.index not in gpus:  # no GPUs named: the job may use any of them
            continue
        major, _, minor = (g.compute_capability or "").partition(".")
        if not (major.isdigit() and minor.isdigit()):
            return None
        found.append((int(major), int(minor)))
    return min(found) if found else None


def check_plan_runs(spec: JobSpec, plan: Plan) -> None:
    """Refuse, in one line, a plan made for another kind of job (whether its layout runs is `_check_runs`'s)."""
    task = plan.workload.task
    if spec.kind in ("train", "infer") and task in ("train", "infer") and task != spec.kind:
        made_for = "training" if task == "train" else "inference"
        raise UserError(
            f"this plan was made for {made_for}, not for a {spec.kind} job; "
            f"plan this job with 'rigpilot plan' and submit that plan"
        )


def check_plan_machine(plan: Plan, machine: Machine) -> None:
    """Refuse a plan whose GPUs are not this machine's: its memory and speed were worked out for other GPUs.

    The GPUs' names decide, not the label, so a plan made on another host with the same GPUs runs.
    """
    names = {g.index: short_gpu_name(g.name) for g in machine.gpus}  # as the plan names them
    indices = plan.parallelism.gpu_indices
    if not plan.gpu_names or not isinstance(indices, list) or len(indices) != len(plan.gpu_names):
        return  # a plan saved before it named its GPUs: _check_gpus still checks that they exist
    if all(names.get(i) == name for i, name in zip(indices, plan.gpu_names, strict=True)):
        return
    raise UserError(
        f"this plan was made for {plan.machine or 'other GPUs'}, and the engine serves {machine.label}: "
        "plan the job for this machine, or switch the engine's machine first",
        reason="plan_other_machine",
        plan_machine=plan.machine,
        machine=machine.label,
    )


def apply_plan_method(spec: JobSpec, plan: Plan, given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The plan's training method and adapters where the submission left them open (`given`: its own train fields).

    A plan sized for QLoRA run as a full fine-tune would need several times the memory it shows, so a
    method the submission gives that differs from the plan's is refused, not overridden either way.
    """
    t = spec.train
    method, lora = plan.workload.method, plan.workload.lora
    words = TRAIN_SETTINGS["method"].choice_word
    if t is None or plan.workload.task != "train" or method not in (m.value for m in FINE_TUNE_METHODS):
        return {}, []
    asked = given.get("method")
    if asked is not None and asked != method and not (asked == TrainMethod.SCRATCH and method == TrainMethod.FULL):
        raise UserError(
            f"this plan was made for {words(method)}, and the job asks for {words(asked)}: "
            f"plan again with --method {asked}, or leave the method out to train as planned",
            reason="plan_other_method",
            plan_method=method,
            method=asked,
        )
    taken: dict[str, Any] = {}
    if asked is None and t.method != method:
        t.method = taken["method"] = method
    if lora is not None and t.method in ADAPTER_METHODS:
        targets = [n for n in lora.targets if n != "all-linear"] or None
        for name, value in (("lora_rank", lora.rank), ("lora_alpha", lora.alpha), ("lora_dropout", lora.dropout),
                            ("lora_targets", targets)):  # fmt: skip
            if name not in given and value is not None and getattr(t, name) != value:
                setattr(t, name, value)
                taken[name] = value
    return taken, []


def apply_plan_layout(spec: JobSpec, plan: Plan) -> tuple[dict[str, Any], list[str]]:
    """Take GPUs and the plan's layout (`Layout.from_plan`) where the submission left them open.

    ZeRO-1 has no FSDP2 form and runs as ZeRO-2 (FSDP2 without resharding after forward), which
    shards gradients too: a little less memory than planned, the same communication; a note says
    so. Returns (what was taken, notes).
    """
    taken: dict[str, Any] = {}
    notes: list[str] = []
    par = plan.parallelism
    indices = par.gpu_indices
    if not spec.gpus and isinstance(indices, list) and indices and all(_is_int(g) for g in indices):
        spec.gpus = list(indices)
        taken["gpus"] = list(indices)
    lt = Layout.from_plan(plan)
    p = spec.parallelism
    if lt.cpu_offload:
        spec.parallelism = p = dataclasses.replace(p, cpu_offload=True)
        taken["cpu_offload"] = True
    if p.world_size != 1:
        if (lt.dp, lt.tp, lt.pp) != (p.dp, p.tp, p.pp):
            notes.append(
                f"the submission's own parallel degrees (dp {p.dp}, tp {p.tp}, pp {p.pp}) "
                f"were kept instead of the plan's (dp {lt.dp}, tp {lt.tp}, pp {lt.pp})"
            )
        return taken, notes
    spec.parallelism = p = dataclasses.replace(
        p, dp_replicate=lt.dp_replicate, dp_shard=lt.dp_shard, tp=lt.tp, pp=lt.pp,
        sequence_parallel=lt.sequence_parallel, reshard_after_forward=lt.reshard_after_forward,
    )  # fmt: skip
    if getattr(plan.workload, "optimizer_in_backward", None) and p.runs_ddp:
        spec.parallelism = p = p.sharded()
        notes.append(IN_BACKWARD_UNDER_DDP_NOTE.format(ranks=p.dp))
    zero = par.zero_stage if _is_int(par.zero_stage) else 0
    if zero == 1 and par.dp > 1:
        notes.append(
            f"the plan's ZeRO-1 (optimizer state sharded over {par.dp} GPUs) runs as FSDP2 without resharding "
            "after forward (ZeRO-2): gradients are sharded too, so each GPU holds a little less than planned"
        )
    taken["parallelism"] = {
        "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp, "pp": p.pp,
        "sequence_parallel": p.sequence_parallel, "reshard_after_forward": p.reshard_after_forward,
        "cpu_offload": p.cpu_offload,
    }  # fmt: skip
    if zero:
        taken["zero_stage"] = zero
    return taken, notes


def apply_plan_training(spec: JobSpec, plan: Plan) -> tuple[dict[str, Any], list[str]]:
    """Put the plan's training settings into spec.train; returns (what was taken, by JobSpec name; notes).

    The plan decides over the submission's values: its memory and speed were computed for exactly
    these. Its micro-batches per step are the pipeline's under pipeline parallelism (one schedule
    run per step) and gradient accumulation otherwise: `Layout.from_plan` and `accumulation_of_plan`.
    """
    t = spec.train
    par, workload = plan.parallelism, plan.workload
    taken: dict[str, Any] = {}
    notes: list[str] = []
    if t is None:
        return taken, notes
    if _is_int(par.micro_batch) and par.micro_batch >= 1:
        t.micro_batch = taken["micro_batch"] = par.micro_batch
    if _is_int(par.grad_accum) and par.grad_accum >= 1:
        if spec.parallelism.pp > 1 and par.pp > 1:
            lt = Layout.from_plan(plan)
            changes: dict[str, Any] = {"pp_microbatches": lt.pp_microbatches}
            taken["pp_microbatches"] = lt.pp_microbatches
            # Too few micro-batches for 1F1B fall back to GPipe in _pipeline_defaults, with a note.
            if schedule_name(par.pipeline_schedule):
                changes["pp_schedule"] = taken["pp_schedule"] = lt.pp_schedule
            spec.parallelism = dataclasses.replace(spec.parallelism, **changes)
            t.grad_accum = taken["grad_accum"] = accumulation_of_plan(plan)
        else:  # the job runs no pipeline: the plan's micro-batches are all accumulation
            t.grad_accum = taken["grad_accum"] = par.grad_accum
    if par.checkpointing in Checkpointing.__members__.values():
        t.activation_checkpointing = taken["activation_checkpointing"] = par.checkpointing
    if _is_int(workload.seq_len) and workload.seq_len >= 1:
        t.seq_len = taken["seq_len"] = workload.seq_len
    if workload.precision in Precision.__members__.values():
        t.precision = taken["precision"] = workload.precision
    master = workload.master_weights
    if master is not None and master in MasterWeights.__members__.values():  # a plan that does not say: None
        t.master_weights = taken["master_weights"] = master
    # The rest of the recipe the plan was sized for; a plan saved before a setting existed leaves the job's own.
    for name in RECIPE_SETTINGS:
        value = getattr(workload, name, None)
        if name == "master_weights" or value is None or RECIPE_SETTINGS[name].refusal(value) is not None:
            continue
        setattr(t, name, value)
        taken[name] = value
    if t.optimizer_in_backward:
        if t.grad_clip:
            notes.append(f"the plan steps the optimizer in backward, which cannot clip: gradient clipping "
                         f"{t.grad_clip:g} was turned off (0)")  # fmt: skip
            t.grad_clip = taken["grad_clip"] = 0.0
        if t.grad_accum != 1 and spec.parallelism.pp == 1:
            notes.append(f"the plan steps the optimizer in backward, which cannot accumulate: gradient accumulation "
                         f"{t.grad_accum} became 1")  # fmt: skip
            t.grad_accum = taken["grad_accum"] = 1
    return taken, notes


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
