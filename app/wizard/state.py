"""The wizard's view-model: every choice so far, and what it becomes (a JobSpec, a plan, a command line).

Plain Python: the pages read and write one `WizardState`, so Back keeps every
choice and the whole state can be saved in QSettings, rebuilt from a job
("clone") or from a plan ("launch with this plan"). `default_state` makes the
first-run defaults: the shipped tiny model and data, so Next, Next, ... Launch
on a simulated machine runs a small real CPU job.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigpilot.engine.examples import EXAMPLES
from rigpilot.engine.given_path import is_given_file
from rigpilot.engine.jobs.store import ACTIVE_STATES
from rigpilot.engine.jobspec.spec import (
    INFER_SETTINGS,
    JOB_SETTINGS,
    SETTINGS,
    TRAIN_SETTINGS,
    InferSettings,
    JobSpec,
    TrainSettings,
)
from rigpilot.engine.layout import Layout
from rigpilot.engine.planner.plan import parallelism_from_dict
from rigpilot.engine.recipe import RECIPE_SETTINGS
from rigpilot.engine.schema import ADAPTER_METHODS, FINE_TUNE_METHODS, InferBackend, Setting, flag_words, setting_words

TINY_MODEL = "models/tiny-llama"
TINY_DATA = "data/shakespeare.txt"

FINETUNE, SCRATCH, SCRIPT, INFER, CALIBRATE = "finetune", "scratch", "script", "infer", "calibrate"
# (key, title, one line on what it does)
KINDS: list[tuple[str, str, str]] = [
    (FINETUNE, "Fine-tune a model",
     "Continue training a pretrained model on your data: fully, with LoRA adapters, or QLoRA (a 4-bit base)."),
    (SCRATCH, "Train from scratch", "Train a fresh model from a config.json (random weights) on your data."),
    (SCRIPT, "Run my script", "Run your own training script under torchrun, one process per GPU."),
    (INFER, "Sharded inference", "Generate text from prompts with a model split over the GPUs."),
    (CALIBRATE, "Calibrate", "Measure this machine's matmul speed and GPU-to-GPU bandwidth for the planner."),
]
KIND_TITLES = {k: t for k, t, _ in KINDS}
PLANNED_KINDS = (FINETUNE, SCRATCH, INFER)
JOB_KIND = {FINETUNE: "train", SCRATCH: "train", SCRIPT: "script", INFER: "infer", CALIBRATE: "calibrate"}
# (InferSettings.backend, the wizard's words for it): the Engine choice and the Review page
INFER_BACKEND_CHOICES = (  # the values are engine.schema.InferBackend's; the words the wizard's
    (InferBackend.AUTO.value, "Automatic: vLLM where it can run, else Rigpilot's own"),
    (InferBackend.TRANSFORMERS.value, "Rigpilot (transformers)"),
    (InferBackend.VLLM.value, "vLLM"),
)
# Sent even at their default: the engine reads their presence (a sequence length the user chose is refused when the
# model's context is shorter; one left out is fitted to it).
_ALWAYS_SENT = frozenset({"train.seq_len"})
SIMULATED_DEFAULT_GPUS = 2  # CPU ranks on a simulated machine: enough to show data parallelism, light on cores


@dataclass
class WizardState:
    kind: str = FINETUNE
    name: str = ""
    model: str = ""  # preset, folder or hub id; from scratch: a config.json or a folder holding one
    method: str = "lora"  # fine-tune: "full" | "lora" | "qlora" (LoRA adapters over a 4-bit NF4 base)
    script: str = ""
    script_args: str = ""  # shell words after the script
    dataset: list[str] = field(default_factory=list)
    text_field: str = "text"
    prompts_file: str = ""
    prompts: list[str] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    queue_if_busy: bool = False  # submit even when a chosen GPU is busy: the job waits for it
    global_batch: int = 16  # training: sequences per optimizer step the plan is made for
    pp_microbatches: int = 0  # pipeline plans: micro-batches in flight per step; 0: as many as accumulated, >= stages
    plan: dict[str, Any] | None = None  # Plan.to_dict() the job runs under, overrides included
    plan_for: list[Any] | None = None  # plan_key() the plan was made for; another key means plan again
    train: TrainSettings = field(default_factory=TrainSettings)
    # The recipe settings (engine.recipe) the user chose here: the plan request pins these; the rest are the
    # planner's to choose, even where `train` holds the value a previous plan chose.
    pinned_recipe: list[str] = field(default_factory=list)
    # The recipe the planner chose for the settings not pinned, by name: what "from the plan" goes back to.
    planned_recipe: dict[str, Any] = field(default_factory=dict)
    infer: InferSettings = field(default_factory=InferSettings)
    trust_remote_code: bool = False
    max_restarts: int | None = None  # automatic restarts after a rank fails; None: the engine's default
    tensorboard: bool = False  # TensorBoard event files in the job's folder (engine.jobs.tensorboard)
    nodes: list[str] = field(default_factory=list)  # other engines the job spans besides this one (Settings → Nodes)
    slurm: dict[str, str] | None = None  # submit to SLURM with these options (partition, account, time, login)

    # -- what the choices mean -------------------------------------------------------------------
    @property
    def job_kind(self) -> str:
        return JOB_KIND[self.kind]

    @property
    def planned(self) -> bool:
        return self.kind in PLANNED_KINDS

    @property
    def training(self) -> bool:
        return self.kind in (FINETUNE, SCRATCH)

    @property
    def train_method(self) -> str:
        return "scratch" if self.kind == SCRATCH else self.method

    @property
    def adapters(self) -> bool:
        """LoRA or QLoRA: only adapter matrices train, and they can be merged into the weights at the end."""
        return self.training and self.train_method in ADAPTER_METHODS

    @property
    def precision(self) -> str:
        return self.infer.precision if self.kind == INFER else self.train.precision

    def set_precision(self, precision: str) -> None:
        self.train.precision = precision
        self.infer.precision = precision

    def planning_model(self) -> str:
        """The model as the planner takes it: a folder rather than the config.json inside it."""
        if Path(self.model).name == "config.json" and is_given_file(self.model):
            return str(Path(self.model).expanduser().parent)
        return self.model

    def workload_args(self) -> dict[str, Any]:
        """The `plan` request's `workload` for these choices."""
        if self.kind == INFER:
            new_tokens = min(self.infer.max_new_tokens, max(self.train.seq_len - 1, 1))
            return {
                "task": "infer", "method": "full", "precision": self.infer.precision, "seq_len": self.train.seq_len,
                "global_batch": self.infer.batch_size, "new_tokens": new_tokens, "lora": None,
            }  # fmt: skip
        method = self.train_method if self.adapters else "full"
        lora = None
        if self.adapters:
            t = self.train
            lora = {"rank": t.lora_rank, "alpha": t.lora_alpha, "dropout": t.lora_dropout,
                    "targets": list(t.lora_targets or ["all-linear"])}  # fmt: skip
        args = {
            "task": "train", "method": method, "precision": self.train.precision, "seq_len": self.train.seq_len,
            "global_batch": self.global_batch, "lora": lora,
        }  # fmt: skip
        for name in RECIPE_SETTINGS:
            # Only what the user chose pins a setting: a value a previous plan chose is the planner's to choose
            # again (for another batch, model or method); an older engine plans without them.
            if name in self.pinned_recipe:
                args[name] = getattr(self.train, name)
        return args

    def pin_recipe(self, name: str, value: Any) -> None:
        """The user chose `value` for recipe setting `name`: the plan keeps it."""
        setattr(self.train, name, value)
        if name not in self.pinned_recipe:
            self.pinned_recipe.append(name)

    def unpin_recipe(self, name: str) -> None:
        """The user gave recipe setting `name` back to the planner: the job takes what the plan chose (a plan
        that did not say, or none yet: the engine's default), and the next plan chooses it again."""
        if name in self.pinned_recipe:
            self.pinned_recipe.remove(name)
        setattr(self.train, name, self.planned_recipe.get(name, RECIPE_SETTINGS[name].default))

    def plan_key(self) -> list[Any]:
        """Everything the plan depends on; when it changes, the plan is made again."""
        return [self.kind, self.planning_model(), sorted(self.gpus), json.dumps(self.workload_args(), sort_keys=True)]

    def plan_is_current(self) -> bool:
        return self.plan is not None and self.plan_for == self.plan_key()

    def take_plan(self, plan: dict[str, Any] | None) -> None:
        """Run under `plan`: its batch shape, sequence length and checkpointing become the job's."""
        self.plan = plan
        if plan is None:
            self.plan_for = None
            return
        par, w = plan["parallelism"], plan["workload"]
        self.train.seq_len = w["seq_len"]
        if self.training:
            self.train.micro_batch = par["micro_batch"]
            self.train.grad_accum = par["grad_accum"]
            self.train.activation_checkpointing = par["checkpointing"]
            for name in RECIPE_SETTINGS:
                if w.get(name) is not None:  # a plan that says computed its memory for it
                    setattr(self.train, name, w[name])
                if name in self.pinned_recipe:
                    continue  # the user's pin, re-checked: not the planner's choice
                if w.get(name) is None:
                    self.planned_recipe.pop(name, None)
                else:
                    self.planned_recipe[name] = w[name]
            self.global_batch = w["global_batch"]
        elif self.kind == INFER:
            self.infer.batch_size = w["global_batch"]
            if w.get("new_tokens"):
                self.infer.max_new_tokens = w["new_tokens"]
        self.plan_for = self.plan_key()

    def fit_to_context(self, context: int | None) -> str | None:
        """Keep the sequence length within a model's `context` (max_position_embeddings); the note saying what
        changed, or None when it already fits (or the model does not say)."""
        if not context or context <= 0 or self.train.seq_len <= context:
            return None
        before, self.train.seq_len = self.train.seq_len, context
        if self.infer.max_new_tokens >= context:
            self.infer.max_new_tokens = max(context // 2, 1)  # room for the prompt too
        return f"Sequence length set to {context} tokens, the model's context (it was {before})."

    # -- what is submitted ---------------------------------------------------------------------------
    def parallelism(self) -> Layout:
        par = (self.plan or {}).get("parallelism") if self.planned else None
        if not par:
            return Layout()
        # The engine's own mapping of a plan onto degrees (ZeRO-1/2 as FSDP2 without resharding, offload, HSDP).
        lt = Layout.from_plan(parallelism_from_dict(par))
        # Fewer micro-batches than stages leaves stages idle for most of the step.
        microbatches = (self.pp_microbatches or max(lt.pp_microbatches, lt.pp)) if lt.pp > 1 else 1
        return dataclasses.replace(lt, pp_microbatches=microbatches)

    def job_gpus(self) -> list[int]:
        """The GPUs in rank order: the plan's order puts tensor-parallel groups on the fastest links."""
        if self.planned and self.plan:
            return list(self.plan["parallelism"]["gpu_indices"])
        return sorted(self.gpus)

    def to_spec(self) -> dict[str, Any]:
        """A JobSpec dict for the `submit` request (`id` is the engine's to give)."""
        kind = self.job_kind
        spec = JobSpec(
            id="",
            kind=kind,  # type: ignore[arg-type]
            name=self.name.strip() or default_name(self),
            model=self.model.strip() or None,
            trust_remote_code=self.trust_remote_code if kind in ("train", "infer") else False,
            gpus=self.job_gpus(),
            parallelism=self.parallelism(),
            max_restarts=self.max_restarts if kind == "train" else None,
            tensorboard=self.tensorboard,
        )
        if kind == "train":
            spec.train = dataclasses.replace(self.train, dataset=list(self.dataset), method=self.train_method,
                                             text_field=self.text_field)  # fmt: skip
            if not self.adapters:
                spec.train.lora_targets = None
                spec.train.save_merged = False
        elif kind == "infer":
            prompts = [p for p in self.prompts if p.strip()]
            spec.infer = dataclasses.replace(
                self.infer, prompts_file=self.prompts_file or None, prompts=[] if self.prompts_file else prompts
            )
        elif kind == "script":
            spec.model = None
            spec.script = [self.script, *shlex.split(self.script_args)]
        else:
            spec.model = None  # calibration measures the machine; the wizard asks for no model
        # Parts the job does not have are left out rather than sent as null; so is a setting at its declared
        # default, which the engine fills in itself: an engine from before a setting existed still takes the job.
        out = {k: v for k, v in spec.to_dict().items() if v is not None}
        if not out["tensorboard"]:
            del out["tensorboard"]  # the default, as below: an engine from before the setting still takes the job
        for section in ("train", "infer"):
            if isinstance(out.get(section), dict):
                out[section] = {k: v for k, v in out[section].items()
                                if f"{section}.{k}" in _ALWAYS_SENT
                                or (decl := SETTINGS.get(f"{section}.{k}")) is None or v != decl.default}  # fmt: skip
        return out

    def command(self) -> str:
        """The `rigpilot run ...` line that submits the same job from a terminal."""
        return run_command(self)

    # -- saving and rebuilding ------------------------------------------------------------------------
    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("plan", None)  # a plan is of one machine and moment; it is made again
        d.pop("plan_for", None)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> WizardState:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("wizard state must be a JSON object")
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WizardState:
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        train_fields = {f.name for f in dataclasses.fields(TrainSettings)}
        infer_fields = {f.name for f in dataclasses.fields(InferSettings)}
        d["train"] = TrainSettings(**{k: v for k, v in (d.get("train") or {}).items() if k in train_fields})
        d["infer"] = InferSettings(**{k: v for k, v in (d.get("infer") or {}).items() if k in infer_fields})
        state = cls(**d)
        if state.kind not in JOB_KIND:
            state.kind = FINETUNE
        return state

    def copy(self) -> WizardState:
        return dataclasses.replace(
            self, train=dataclasses.replace(self.train), infer=dataclasses.replace(self.infer),
            dataset=list(self.dataset), prompts=list(self.prompts), gpus=list(self.gpus), nodes=list(self.nodes),
            slurm=dict(self.slurm) if self.slurm is not None else None, pinned_recipe=list(self.pinned_recipe),
            planned_recipe=dict(self.planned_recipe),
        )  # fmt: skip


def default_name(state: WizardState) -> str:
    model = Path(state.model.rstrip("/")).name if state.model else ""
    if model == "config.json":
        model = Path(state.model).parent.name
    if state.kind == SCRIPT:
        return Path(state.script).stem or "script"
    words = {
        FINETUNE: f"{state.method} fine-tune",
        SCRATCH: "from scratch",
        INFER: "inference",
        CALIBRATE: "calibration",
    }
    return " ".join(w for w in (model, words[state.kind]) if w)


# -- the first-run defaults ------------------------------------------------------------------------------


def examples_present(examples: Path = EXAMPLES) -> bool:
    return (examples / TINY_MODEL / "config.json").is_file() and (examples / TINY_DATA).is_file()


def default_gpus(machine: dict[str, Any] | None, jobs: list[dict[str, Any]] | None = None) -> list[int]:
    if not machine:
        return []
    busy = {g for j in jobs or [] if j.get("state") in ACTIVE_STATES for g in j.get("gpus") or []}
    free = [g["index"] for g in machine.get("gpus", []) if g["index"] not in busy]
    if machine.get("source") == "simulated":
        return free[:SIMULATED_DEFAULT_GPUS]
    return free


def default_state(machine: dict[str, Any] | None = None, examples: Path = EXAMPLES) -> WizardState:
    """A job that runs as it is: the shipped tiny model on the shipped text, a few dozen steps."""
    simulated = bool(machine and machine.get("source") == "simulated")
    state = WizardState(gpus=default_gpus(machine))
    # CPU ranks run fp32 faster than emulated bf16, and a simulated machine has no other kind.
    state.set_precision("fp32" if simulated else "bf16")
    if examples_present(examples):
        state.kind = SCRATCH
        state.model = str(examples / TINY_MODEL)
        state.dataset = [str(examples / TINY_DATA)]
        t = state.train
        t.max_steps, t.seq_len, t.micro_batch, t.grad_accum = 30, 128, 4, 1
        t.learning_rate, t.warmup_steps, t.eval_every, t.checkpoint_every = 1e-3, 3, 10, 30
        state.global_batch = 4 * max(len(state.gpus), 1)
        state.infer.max_new_tokens = 32
    else:
        # Nothing shipped to fall back on: a LoRA fine-tune whose model and data the user picks.
        state.kind, state.method = FINETUNE, "lora"
        t = state.train
        t.max_steps, t.eval_every, t.checkpoint_every = 100, 50, 50
    return state


# -- from a job or a plan ("clone into the wizard") -------------------------------------------------------


def state_from_spec(spec: dict[str, Any], plan: dict[str, Any] | None = None) -> WizardState:
    """The wizard's choices that would submit `spec` (a JobSpec dict) again."""
    s = JobSpec.from_dict({"id": "", **spec})
    state = WizardState(name=s.name, model=s.model or "", gpus=list(s.gpus), trust_remote_code=s.trust_remote_code)
    state.max_restarts = s.max_restarts
    state.tensorboard = s.tensorboard
    if s.kind == "train":
        t = s.train or TrainSettings()
        state.kind = SCRATCH if t.method == "scratch" else FINETUNE
        state.method = t.method if t.method in FINE_TUNE_METHODS else "lora"
        state.dataset, state.text_field = list(t.dataset), t.text_field
        state.train = dataclasses.replace(t)
        dp = s.parallelism.dp_replicate * s.parallelism.dp_shard
        state.global_batch = t.micro_batch * t.grad_accum * max(dp, 1)
        if s.parallelism.pp > 1:
            state.pp_microbatches = s.parallelism.pp_microbatches
    elif s.kind == "infer":
        i = s.infer or InferSettings()
        state.kind = INFER
        state.infer = dataclasses.replace(i)
        state.prompts_file, state.prompts = i.prompts_file or "", list(i.prompts)
    elif s.kind == "script":
        state.kind = SCRIPT
        argv = list(s.script or [])
        state.script = argv[0] if argv else ""
        state.script_args = shlex.join(argv[1:])
        state.model = ""
    else:
        state.kind = CALIBRATE
    if plan is not None and state.planned:
        state.take_plan(plan)
    return state


def state_from_plan(plan: dict[str, Any], base: WizardState | None = None) -> WizardState:
    """Launch under `plan` (a Plan dict or a whole search result): its model, workload and GPUs."""
    if isinstance(plan.get("best"), dict):
        plan = plan["best"]
    state = base.copy() if base is not None else WizardState()
    w = plan["workload"]
    state.model = w["model"]
    state.gpus = sorted(plan["parallelism"]["gpu_indices"])
    state.set_precision(w["precision"])
    state.train.seq_len = w["seq_len"]
    if w["task"] == "infer":
        state.kind = INFER
        state.infer.batch_size = w["global_batch"]
        if w.get("new_tokens"):
            state.infer.max_new_tokens = w["new_tokens"]
    else:
        # From scratch only when the plan is for the configuration the last scratch run used.
        same_config = base is not None and base.kind == SCRATCH and base.planning_model() == w["model"]
        state.kind = SCRATCH if same_config else FINETUNE
        state.method = w["method"] if w["method"] in FINE_TUNE_METHODS else "full"
        if state.kind == SCRATCH and state.method != "full":
            state.kind = FINETUNE
        state.global_batch = w["global_batch"]
        lora = w.get("lora")
        if lora:
            state.train.lora_rank, state.train.lora_alpha = lora["rank"], lora["alpha"]
    state.take_plan(plan)
    return state


# -- the command line -------------------------------------------------------------------------------------


def _setting_words(settings: dict[str, Setting], part: Any, words: list[str], extras: list[str],
                   skip: tuple[str, ...] = ()) -> None:  # fmt: skip
    """Each declared setting of `part` as its flag (engine.jobspec.spec declares which have one); a setting
    the command line cannot say, and that differs from the engine's default, goes among `extras` in its words."""
    for name, s in settings.items():
        if name in skip:
            continue
        value = getattr(part, name)
        said = flag_words(s, value)
        if said is not None:
            words += said
        elif value != s.default and value is not None and value is not False and value != []:  # 0 is a value
            extras.append(setting_words(s, value))


def run_command(state: WizardState) -> str:
    """`rigpilot run KIND ...` with the flags the command line has; the rest is listed after it."""
    spec = JobSpec.from_dict(state.to_spec())
    words = ["rigpilot", "run", spec.kind]
    extras: list[str] = []
    words += flag_words(JOB_SETTINGS["gpus"], spec.gpus) or []
    if state.nodes:
        words += ["--nodes", ",".join(["local", *state.nodes])]
    if state.slurm is not None:
        words.append("--slurm")
        for key in ("partition", "account", "time", "login"):
            if state.slurm.get(key):
                words += [f"--{key}", state.slurm[key]]
    words += ["--name", spec.name]
    if spec.kind == "script":
        return shlex.join([*words, "--", *(spec.script or [])])
    if spec.model:
        words += ["--model", spec.model]
    if spec.trust_remote_code:
        words.append("--trust-remote-code")
    words += flag_words(JOB_SETTINGS["max_restarts"], spec.max_restarts) or []
    words += flag_words(JOB_SETTINGS["tensorboard"], spec.tensorboard) or []
    p = spec.parallelism
    for flag, value in (("--dp", p.dp_replicate), ("--fsdp", p.dp_shard), ("--tp", p.tp), ("--pp", p.pp)):
        if value > 1:
            words += [flag, str(value)]
    if state.planned and state.plan:
        words += ["--plan", "plan.json"]
    if p.pp > 1:
        words += ["--pp-schedule", p.pp_schedule, "--pp-microbatches", str(p.pp_microbatches)]
    if p.sequence_parallel:
        words.append("--sequence-parallel")
    if p.cpu_offload:
        if spec.kind == "train":
            words.append("--cpu-offload")
        else:
            extras.append("CPU offload (FSDP2: parameters, gradients and optimizer in host RAM)")
    if spec.kind == "train" and spec.train is not None:
        t = spec.train
        lora = t.method in ADAPTER_METHODS
        _setting_words(TRAIN_SETTINGS, t, words, extras,
                       skip=() if lora else tuple(n for n in TRAIN_SETTINGS if n.startswith("lora_")))  # fmt: skip
    elif spec.kind == "infer" and spec.infer is not None:
        _setting_words(INFER_SETTINGS, spec.infer, words, extras)
    line = shlex.join(words)
    if state.planned and state.plan:
        line += "\n# plan.json: export the plan as JSON (Review page) next to where you run this"
    if extras:
        line += "\n# set in the wizard, no flag: " + "; ".join(extras)
    return line


def steps_for(tokens: int, state: WizardState) -> int:
    """Optimizer steps to see `tokens` once: a hint for the steps field."""
    per_step = max(state.global_batch, 1) * max(state.train.seq_len, 1)
    return max(1, math.ceil(tokens / per_step))
