"""`JobSpec`: everything a job needs to run, written as job.json into the job's folder.

The engine service writes it; the worker processes (started by torchrun) read
it. It is plain JSON so a job folder can be inspected, copied or re-run by hand.

Job folder layout (`<state dir>/jobs/<job id>/`):
    job.json                 this spec
    plan.json                the planner's plan the job runs under (when there is one)
    logs/rank<N>.log         stdout+stderr of each rank
    metrics/rank<N>.jsonl    append-only metric records written through engine.report
    checkpoints/step-<N>/    checkpoints, each complete only once `COMPLETE` exists inside
    output/                  the final model (HF folder or LoRA adapter), inference results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rigpilot.engine.errors import UserError
from rigpilot.engine.layout import Layout
from rigpilot.engine.recipe import recipe_field
from rigpilot.engine.schema import (
    Checkpointing,
    InferBackend,
    Precision,
    Range,
    Setting,
    TrainMethod,
    declared,
    setting,
)

JobKind = Literal["train", "infer", "script", "calibrate", "doctor", "serve"]
# 2: the optimizer step in backward no longer runs under DDP (engine.capability refuses it there); a version-1
# job.json asking for it runs its replicas as FSDP2 shards (JobSpec.from_dict).
SPEC_VERSION = 2
# Plans and job.json files made while the engine still ran the optimizer step in backward under DDP (stepping each
# weight after backward, which saved nothing) run on the same ranks as FSDP2 now, with this note.
IN_BACKWARD_UNDER_DDP_NOTE = (
    "the optimizer step in backward runs as FSDP2 over the {ranks} ranks, not DDP replicas as when this was "
    "planned: FSDP2 frees each gradient as its weight steps, DDP's all-reduce buckets keep them all"
)


# job.json's `parallelism` object is a Layout (engine.layout); the old name stays for readers of it.
Parallelism = Layout


MANY = 10**8  # steps and intervals: far beyond any real job, yet finite
SEED = Range(0, 2**63 - 1)


def gpu_indices(text: str) -> list[int]:
    """`--gpus 0,1` (or `all`: an empty list, every GPU or as many as the degrees need)."""
    if text.strip().lower() == "all":
        return []
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1 not {text!r}") from None
    if not gpus or any(g < 0 for g in gpus):
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1 not {text!r}")
    return gpus


# Each field that is a setting is declared here once (engine.schema): the command line, the engine's range
# check, the socket's bounds and the app's labels, tooltips and command preview all come from it.
@dataclass
class TrainSettings:
    dataset: list[str] = setting(
        default_factory=list,
        flags="--data",
        metavar="FILE",
        label="Training data",
        help="Training data: .txt, .jsonl, chat or instruction .jsonl; repeatable.",
    )
    text_field: str = setting("text", label="Text field", help="The JSONL field that holds the text.")
    train_on_prompts: bool = setting(
        False,
        flags="--train-on-prompts",
        label="Train on prompts",
        help="Chat and instruction data: train on the prompts too, not only on the answers.",
    )
    eval_fraction: float = setting(
        0.05,
        range=Range(0, 1, hi_open=True),
        label="Evaluation share",
        help="The share of the data held out for evaluation.",
    )
    method: str = setting(
        TrainMethod.FULL,
        flags="--method",
        choices=TrainMethod,
        label="Method",
        help="Full fine-tune, LoRA, QLoRA (LoRA on a 4-bit NF4 base), or from scratch.",
        choice_words={
            TrainMethod.FULL: "Full fine-tune",
            TrainMethod.LORA: "LoRA",
            TrainMethod.QLORA: "QLoRA (4-bit base)",
            TrainMethod.SCRATCH: "From scratch",
        },
    )
    lora_rank: int = setting(
        16, range=Range(1, 65536), label="LoRA rank", help="Size of the adapter matrices: more capacity, more memory."
    )
    lora_alpha: int = setting(
        32, range=Range(1, 2**20), label="LoRA alpha", help="Scale of the adapters' update; twice the rank is common."
    )
    lora_dropout: float = setting(
        0.0, range=Range(0, 1, hi_open=True), label="LoRA dropout", help="Dropout on the LoRA adapters' input."
    )
    lora_targets: list[str] | None = setting(
        None,
        label="LoRA targets",
        default_words="attention and MLP projections",
        help="Which linear layers get adapters (comma-separated names).",
    )
    precision: str = setting(
        Precision.BF16,
        flags="--precision",
        choices=Precision,
        label="Precision",
        help="The mixed-precision compute dtype.",
    )
    # The recipe (engine.recipe): declared there once, flat here as job.json has always had master_weights.
    master_weights: str = recipe_field("master_weights")
    optimizer: str = recipe_field("optimizer")
    optimizer_in_backward: bool = recipe_field("optimizer_in_backward")
    loss_chunks: int = recipe_field("loss_chunks")
    activation_offload: bool = recipe_field("activation_offload")
    optimizer_offload: bool = recipe_field("optimizer_offload")
    compile: bool = recipe_field("compile")
    fp8: bool = recipe_field("fp8")
    seq_len: int = setting(
        512,
        flags="--seq",
        range=Range(1, 2**21),
        metavar="TOKENS",
        unit="tokens",
        label="Sequence length",
        help="Tokens per training sequence; memory grows with it.",
    )
    micro_batch: int = setting(
        1,
        flags="--micro-batch",
        range=Range(1, 2**16),
        metavar="N",
        unit="sequences",
        label="Micro-batch",
        help="Sequences each GPU processes at once; the biggest lever on memory.",
    )
    grad_accum: int = setting(
        1,
        flags="--grad-accum",
        range=Range(1, 2**16),
        metavar="N",
        unit="micro-batches",
        label="Gradient accumulation",
        help="Micro-batches summed before each update: a bigger batch for no memory.",
    )
    max_steps: int = setting(
        100,
        flags="--steps",
        range=Range(1, MANY),
        metavar="N",
        unit="steps",
        label="Steps",
        help="Optimizer updates to run; each sees one global batch of sequences.",
    )
    learning_rate: float = setting(
        2e-4,
        flags="--lr",
        range=Range(0, 10, lo_open=True),
        metavar="RATE",
        default_words="2e-4",
        label="Learning rate",
        help="Peak step size after warm-up; LoRA takes larger rates than full training.",
    )
    warmup_steps: int = setting(
        10,
        range=Range(0, MANY),
        unit="steps",
        label="Warm-up steps",
        help="Steps over which the rate rises from zero, so early updates stay small.",
    )
    weight_decay: float = setting(0.0, range=Range(0, 10), label="Weight decay", help="AdamW's weight decay.")
    grad_clip: float = setting(
        1.0,
        flags="--grad-clip",
        range=Range(0, 10**6),
        metavar="NORM",
        label="Gradient clipping",
        help="The largest gradient norm; larger ones are scaled down (0: no clipping, as the optimizer step in "
        "backward needs).",
    )
    activation_checkpointing: str = setting(
        Checkpointing.NONE,
        flags=("--activation-checkpointing", "--checkpointing"),
        choices=Checkpointing,
        label="Activation checkpointing",
        help="Recompute activations in the backward pass instead of keeping them: less memory, more compute.",
    )
    eval_every: int = setting(
        50,
        range=Range(0, MANY),
        unit="steps",
        label="Evaluate every",
        help="Steps between loss measurements on held-out data (0: none).",
        zero_words="never",
    )
    checkpoint_every: int = setting(
        50,
        range=Range(0, MANY),
        unit="steps",
        label="Checkpoint every",
        help="Steps between checkpoints a failed or stopped job resumes from (0: none).",
        zero_words="never",
    )
    keep_checkpoints: int = setting(
        3,
        range=Range(0, 10**6),
        label="Keep checkpoints",
        help="The newest this many stay on disk; older ones are deleted (0: all).",
        zero_words="all",
    )
    seed: int = setting(
        1234,
        flags="--seed",
        range=SEED,
        metavar="N",
        label="Seed",
        help="Makes data order and initial weights repeatable.",
    )
    save_merged: bool = setting(
        False,
        flags="--save-merged",
        label="Merged weights",
        help="LoRA: besides the adapter, a full model folder that loads without peft (as large as the model).",
    )


@dataclass
class InferSettings:
    prompts_file: str | None = setting(
        None,
        flags="--prompts",
        metavar="FILE",
        label="Prompts file",
        help='A JSONL file with a "prompt" field per line.',
    )
    prompts: list[str] = setting(
        default_factory=list, flags="--prompt", metavar="TEXT", label="Prompts", help="A prompt; repeatable."
    )
    max_new_tokens: int = setting(
        64,
        flags="--max-new-tokens",
        range=Range(1, 2**21),
        metavar="N",
        unit="tokens",
        label="New tokens",
        help="Tokens generated for each prompt at most.",
    )
    temperature: float = setting(
        0.0,
        flags="--temperature",
        range=Range(0, 100),
        metavar="T",
        default_words="0: greedy",
        label="Temperature",
        help="0 always picks the likeliest token; higher is more varied.",
    )
    top_p: float = setting(
        1.0,
        flags="--top-p",
        range=Range(0, 1, lo_open=True),
        metavar="P",
        label="Top-p",
        help="Sample only from the likeliest tokens covering this probability.",
    )
    batch_size: int = setting(
        8,
        range=Range(1, 4096),
        unit="prompts",
        label="Batch",
        help="Prompts generated together: faster, and more KV-cache memory.",
    )
    precision: str = setting(
        Precision.BF16, flags="--precision", choices=Precision, label="Precision", help="The weights' dtype."
    )
    seed: int = setting(1234, flags="--seed", range=SEED, metavar="N", label="Seed", help="Makes sampling repeatable.")
    # The submission replaces "auto" with the backend it chose (engine.capability.choose_infer_backend), so
    # job.json says what runs.
    backend: str = setting(
        InferBackend.AUTO, flags="--backend", choices=InferBackend, label="Backend", default_words="auto: vLLM where it can run",
        help="vLLM where it is installed in the engine environment and the job fits it (real GPUs, one machine, "
        "no data parallel); Rigpilot's own generator (transformers) otherwise.",
    )  # fmt: skip
    backend_reason: str = ""  # written by the engine at submit: why this backend runs


@dataclass
class ServeSettings:
    """An OpenAI-compatible server on the job's rank, or split over its ranks (engine.workers.serve); it runs until
    cancelled."""

    port: int = setting(
        0,
        flags="--port",
        range=Range(0, 65535),
        metavar="PORT",
        label="Port",
        default_words="0: a free port, which the job reports",
        help="The port the server listens on.",
    )
    listen: str = setting(
        "127.0.0.1",
        flags="--listen",
        metavar="ADDR",
        label="Listen on",
        default_words="127.0.0.1: this machine only",
        help="The address the server listens on. Any but loopback needs an API key, made for the job and printed "
        "once, and TLS on the engine's certificate.",
    )
    max_batch: int = setting(
        16,
        flags="--max-batch",
        range=Range(1, 4096),
        metavar="N",
        unit="requests",
        label="Batch",
        help="Requests decoded together at most: faster for many clients, and more KV-cache memory.",
    )
    max_new_tokens: int = setting(
        512,
        flags="--max-new-tokens",
        range=Range(1, 2**21),
        metavar="N",
        unit="tokens",
        label="New tokens",
        help="The most tokens one request may ask for (its max_tokens).",
    )
    max_prompt_tokens: int = setting(
        4096,
        flags="--max-prompt-tokens",
        range=Range(1, 2**21),
        metavar="N",
        unit="tokens",
        label="Prompt tokens",
        help="The longest prompt a request may send; longer ones are refused.",
    )
    max_concurrent: int = setting(
        64,
        flags="--max-concurrent",
        range=Range(1, 65536),
        metavar="N",
        unit="requests",
        label="Concurrent requests",
        help="Requests running or waiting at once; one more is answered 429 (busy).",
    )
    precision: str = setting(
        Precision.BF16, flags="--precision", choices=Precision, label="Precision", help="The weights' dtype."
    )
    seed: int = setting(
        1234, flags="--seed", range=SEED, metavar="N", label="Seed", help="Sampling's seed for requests without one."
    )
    # LoRA adapters served by name on the one base, selected by a request's `model` (engine.workers.serve_adapters):
    # name -> peft adapter folder (a finished LoRA job named in its place is resolved by engine.jobs.serve_source).
    adapters: dict[str, str] = field(default_factory=dict)
    source_job: str = ""  # the finished training job whose model this serves, where one was named (its id)
    base_name: str = ""  # the base model's name in requests; empty: the job's (engine.workers.serve.served_name)
    # Written by the engine at submit when `listen` is beyond loopback: its TLS certificate and key, and the
    # certificate's fingerprint, which the job reports for clients to pin (the certificate is self-signed).
    tls_cert: str = ""
    tls_key: str = ""
    tls_fingerprint: str = ""


@dataclass
class JobSpec:
    id: str
    kind: JobKind
    name: str = setting("", flags="--name", label="Name", help="A name to recognise the job by.")
    model: str | None = None  # preset, local folder, hub id or config.json (train from scratch)
    trust_remote_code: bool = False  # off unless the user turns it on for this job
    gpus: list[int] = setting(
        default_factory=list,
        flags="--gpus",
        metavar="0,1",
        parse=gpu_indices,
        label="GPUs",
        help="The machine's GPUs the job runs on.",
        default_words="all, or as many as the degrees need",
    )
    simulated: bool = True  # ranks run on the CPU with gloo, one per (simulated) GPU
    parallelism: Layout = field(default_factory=Layout)
    train: TrainSettings | None = None
    infer: InferSettings | None = None
    serve: ServeSettings | None = None
    script: list[str] | None = None  # argv of a user script: ["path/to/script.py", "--flag", ...]
    env: dict[str, str] = field(default_factory=dict)
    resume: bool = False  # continue from the newest complete checkpoint
    # Automatic restarts after a rank fails (engine.jobs.recovery); None: the default policy, 0: never.
    max_restarts: int | None = setting(
        None,
        flags="--max-restarts",
        range=Range(0, 100),
        metavar="N",
        label="Restarts after a failure",
        help="When a rank fails, the job restarts itself from its newest checkpoint, leaving out a GPU that reports "
        "a hardware fault, up to this many times in a row (0: never).",
        default_words="3 for training longer than its checkpoint interval, else 0",
    )
    tensorboard: bool = setting(
        False,
        flags="--tensorboard",
        label="TensorBoard",
        help="Also write the job's figures (loss, learning rate, tokens/s, MFU, memory, its GPUs' use) as "
        "TensorBoard event files in its folder, for `tensorboard --logdir`.",
    )
    spec_version: int = SPEC_VERSION
    # What reading an older job.json changed, for the job's notes. Written back with the upgraded job.json (a
    # resume or a restart rewrites it), so every later run still says why it runs otherwise than first asked.
    upgrade_notes: list[str] = field(default_factory=list, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not d["upgrade_notes"]:
            del d["upgrade_notes"]  # job.json files stay as they were unless an upgrade changed the job
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        d = dict(d)
        d["parallelism"] = Layout.from_dict(d.get("parallelism") or {})  # old spellings read as the one
        if d.get("train") is not None:
            d["train"] = TrainSettings(**d["train"])
        if d.get("infer") is not None:
            d["infer"] = InferSettings(**d["infer"])
        if d.get("serve") is not None:
            d["serve"] = ServeSettings(**d["serve"])
        known = {f.name for f in dataclasses.fields(cls)}
        spec = cls(**{k: v for k, v in d.items() if k in known and k != "upgrade_notes"})
        old = d.get("spec_version")  # absent: a submission, not a stored job; it is refused as asked, not changed
        if isinstance(old, int) and isinstance(d.get("upgrade_notes"), list):
            spec.upgrade_notes = [n for n in d["upgrade_notes"] if isinstance(n, str)]
        if isinstance(old, int) and old < 2 and spec.train and spec.train.optimizer_in_backward:
            if spec.parallelism.runs_ddp:
                spec.parallelism = spec.parallelism.sharded()
                spec.upgrade_notes.append(IN_BACKWARD_UNDER_DDP_NOTE.format(ranks=spec.parallelism.dp))
        spec.spec_version = max(old, SPEC_VERSION) if isinstance(old, int) else SPEC_VERSION  # a newer one stays
        return spec

    def write(self, job_dir: Path) -> None:
        job_dir.mkdir(parents=True, exist_ok=True)
        tmp = job_dir / "job.json.tmp"
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        tmp.replace(job_dir / "job.json")

    @classmethod
    def read(cls, job_dir: Path) -> JobSpec:
        """The job.json in `job_dir`; OSError when it cannot be read, UnreadableSpec (a ValueError) when what it
        holds is not a job: callers that pass over a damaged job catch the two and nothing else."""
        text = (job_dir / "job.json").read_text()
        try:
            return cls.from_dict(json.loads(text))
        except (ValueError, TypeError, KeyError, AttributeError, UserError) as e:
            raise UnreadableSpec(str(e).splitlines()[0] if str(e) else type(e).__name__) from e


class UnreadableSpec(ValueError):
    """A job.json whose content is not a job (bad JSON, a wrong type, a setting or layout out of range)."""


TRAIN_SETTINGS: dict[str, Setting] = declared(TrainSettings, "train")
INFER_SETTINGS: dict[str, Setting] = declared(InferSettings, "infer")
SERVE_SETTINGS: dict[str, Setting] = declared(ServeSettings, "serve")
JOB_SETTINGS: dict[str, Setting] = declared(JobSpec)
# Every declared setting by its key ("train.micro_batch", "max_restarts").
SETTINGS: dict[str, Setting] = {s.key: s for g in (TRAIN_SETTINGS, INFER_SETTINGS, SERVE_SETTINGS, JOB_SETTINGS) for s in g.values()}
