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

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rigpilot.engine.layout import Layout

JobKind = Literal["train", "infer", "script", "calibrate"]
SPEC_VERSION = 1


# job.json's `parallelism` object is a Layout (engine.layout); the old name stays for readers of it.
Parallelism = Layout


@dataclass
class TrainSettings:
    dataset: list[str] = field(default_factory=list)  # files: .txt, .jsonl (text field), chat/instruction .jsonl
    text_field: str = "text"
    # Chat and instruction data: False trains on the assistant's answers only (the prompts still give context).
    train_on_prompts: bool = False
    eval_fraction: float = 0.05
    method: str = "full"  # "full" | "lora" | "qlora" (LoRA on a 4-bit NF4 base) | "scratch"
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = None  # None: the attention and MLP projections
    precision: str = "bf16"  # "fp32" | "bf16" | "fp16"
    seq_len: int = 512
    micro_batch: int = 1
    grad_accum: int = 1
    max_steps: int = 100
    learning_rate: float = 2e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    activation_checkpointing: str = "none"  # "none" | "selective" | "full"
    eval_every: int = 50
    checkpoint_every: int = 50
    keep_checkpoints: int = 3  # the newest this many checkpoints stay on disk; 0 keeps every one
    seed: int = 1234
    save_merged: bool = False  # LoRA: also save merged full weights


@dataclass
class InferSettings:
    prompts_file: str | None = None  # JSONL with a "prompt" field
    prompts: list[str] = field(default_factory=list)
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    batch_size: int = 8
    precision: str = "bf16"
    seed: int = 1234
    # "auto" | "transformers" (Rigpilot's own generator) | "vllm". The submission replaces "auto" with
    # the backend it chose (engine.capability.choose_infer_backend), so job.json says what runs.
    backend: str = "auto"
    backend_reason: str = ""  # written by the engine at submit: why this backend runs


@dataclass
class JobSpec:
    id: str
    kind: JobKind
    name: str = ""
    model: str | None = None  # preset, local folder, hub id or config.json (train from scratch)
    trust_remote_code: bool = False  # off unless the user turns it on for this job
    gpus: list[int] = field(default_factory=list)  # machine GPU indices
    simulated: bool = True  # ranks run on the CPU with gloo, one per (simulated) GPU
    parallelism: Layout = field(default_factory=Layout)
    train: TrainSettings | None = None
    infer: InferSettings | None = None
    script: list[str] | None = None  # argv of a user script: ["path/to/script.py", "--flag", ...]
    env: dict[str, str] = field(default_factory=dict)
    resume: bool = False  # continue from the newest complete checkpoint
    # Automatic restarts after a rank fails (engine.service.recovery); None: the default policy, 0: never.
    max_restarts: int | None = None
    spec_version: int = SPEC_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        d = dict(d)
        d["parallelism"] = Layout.from_dict(d.get("parallelism") or {})  # old spellings read as the one
        if d.get("train") is not None:
            d["train"] = TrainSettings(**d["train"])
        if d.get("infer") is not None:
            d["infer"] = InferSettings(**d["infer"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def write(self, job_dir: Path) -> None:
        job_dir.mkdir(parents=True, exist_ok=True)
        tmp = job_dir / "job.json.tmp"
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        tmp.replace(job_dir / "job.json")

    @classmethod
    def read(cls, job_dir: Path) -> JobSpec:
        return cls.from_dict(json.loads((job_dir / "job.json").read_text()))
