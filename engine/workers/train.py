"""The training loop (kind "train"): model, parallelism and data come from the other modules.

One step = grad_accum micro-batches (each a pipeline batch of pp_microbatches
micro-batches under pipeline parallelism), one clipped AdamW update, one LR
scheduler step. Between steps the ranks agree whether a SIGTERM arrived; if so
they checkpoint and exit with EXIT_CANCELLED.

One loss whatever the layout: a step's loss and gradients are the mean over
every trained token of the global batch (all micro-batches of all data-parallel
replicas), so 1 rank or 8, one micro-batch or four, with or without padding,
train the same model. Each micro-batch's loss is its summed token cross-entropy
over that global count, counted once per step before the forward passes.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from rigpilot.engine.capability import RecipeContext
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS, JobSpec, TrainSettings
from rigpilot.engine.recipe import Recipe
from rigpilot.engine.recipe_refusal import check_recipe
from rigpilot.engine.report import report
from rigpilot.engine.schema import check_group
from rigpilot.engine.workers import EXIT_CANCELLED, EXIT_OK
from rigpilot.engine.workers.activation_offload import ActivationOffload, offload_activations
from rigpilot.engine.workers.checkpoint import Checkpointer, gather_full_state, save_final_model
from rigpilot.engine.workers.chunked_loss import TokenLoss
from rigpilot.engine.workers.chunked_loss import token_loss as token_loss  # where callers have found it
from rigpilot.engine.workers.compile import CompileWarmup, apply_compile, apply_float8, private_inductor_cache
from rigpilot.engine.workers.data import (
    Dataset,
    ShardedBatches,
    build_dataset,
    eval_batches,
    mask_for_mlm,
    read_dataset,
)
from rigpilot.engine.workers.metrics import WindowSums, mfu, peak_memory, status, window_sums_async, world_sums
from rigpilot.engine.workers.model_loading import (
    LoadedModel,
    count_params,
    is_nf4,
    load_model,
    materialize,
    training_load_dtype,
)
from rigpilot.engine.workers.optimizer_offload import HostOffloadedOptimizer, host_offloaded_optimizer
from rigpilot.engine.workers.optimizers import (
    OptimizerInBackward,
    Schedulers,
    new_optimizer,
    optimizer_words,
    rounding_seed,
    stochastic_rounding,
)
from rigpilot.engine.workers.parallel_dims import Runtime, init_runtime
from rigpilot.engine.workers.parallelize import (
    PrecisionPlan,
    apply_activation_checkpointing,
    apply_data_parallel,
    apply_tensor_parallel,
    logits_split,
    offload_device,
    offloaded_shards,
    precision_dtype,
    precision_plan,
    set_gradient_sync,
    uses_fsdp,
)
from rigpilot.engine.workers.pipeline import DecoderStage, decoder_parts
from rigpilot.engine.workers.tied import TiedAcrossStages, tied_across_stages

MIN_LR_RATIO = 0.1  # cosine decays to this fraction of the peak LR
REPORT_EVERY_S = 0.25  # the step records' losses cross the ranks about this often, or every step if slower
MAX_WINDOW = 32  # steps


class CancelFlag:
    """Remembers a SIGTERM; the loop polls it between steps, so a step is never cut in half."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.requested:
            print("rigpilot-worker: SIGTERM received: finishing the current step, then checkpointing", flush=True)
        self.requested = True


def validate_settings(s: TrainSettings) -> None:
    """The engine checked these at submission; a job.json edited by hand is checked again, by the same
    declarations (engine.jobspec.spec), before a step runs."""
    check_group(s, TRAIN_SETTINGS)
    precision_dtype(s.precision)


def validate_recipe(spec: JobSpec, device: torch.device) -> None:
    """The capability contract's recipe check again, with this rank's device's own facts (its compute capability)."""
    s = spec.train
    assert s is not None
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    ctx = RecipeContext(
        s.method, s.precision, s.grad_accum, s.grad_clip, gpu_capability=cc, cpu_ranks=device.type == "cpu"
    )
    check_recipe(Recipe.of(s), spec.parallelism, ctx)


def lr_lambda(warmup_steps: int, max_steps: int) -> Any:
    """Linear warmup to the peak, then cosine decay to MIN_LR_RATIO of it at max_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def clip_grad_norm(
    params: list[nn.Parameter], max_norm: float, pp_group: Any | None, counted_elsewhere: Sequence[nn.Parameter] = ()
) -> torch.Tensor:
    """Global L2 norm of all gradients (clipped to max_norm when > 0), correct for DTensor and pipeline splits.

    Gradients are grouped by the mesh they live on (FSDP, TP, FSDP x TP, or
    plain tensors), each group's norm made whole with full_tensor(), and stage
    norms summed over the pipeline group. The norm comes back as a 0-dim tensor
    and the clipping stays on the device: no host sync in the step.
    `counted_elsewhere`: parameters another stage's norm already counts (the last
    stage's copy of a tied matrix); clipped, not counted.
    """
    skip = {id(p) for p in counted_elsewhere}
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    counted: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        mesh = g.device_mesh if isinstance(g, DTensor) else None
        groups[mesh].append(g)
        if id(p) not in skip:
            counted[mesh].append(g)
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=device)
    for group in counted.values():
        norm = plain(torch.nn.utils.get_total_norm(group, 2.0))
        square = square + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(square, group=pp_group)
    total = square.sqrt()
    if max_norm > 0:
        # A non-finite norm is reported, not applied: scaling by it would turn every gradient into NaN.
        coef = torch.where(torch.isfinite(total), (max_norm / (total + 1e-6)).clamp(max=1.0), 1.0)
        for group in groups.values():
            torch._foreach_mul_(group, coef)
    return total


def lora_dtypes_note(model: nn.Module) -> str:
    """The dtypes the frozen and the trainable parameters are held in, as the log states them."""

    def names(params: list[nn.Parameter]) -> str:
        # QLoRA's NF4 weights report the dtype they dequantise to; the note counts them apart.
        kinds = sorted({"nf4" if is_nf4(p) else str(p.dtype).removeprefix("torch.") for p in params})
        return "/".join(kinds) or "none"

    params = list(model.parameters())
    frozen = names([p for p in params if not p.requires_grad])
    trainable = names([p for p in params if p.requires_grad])
    return f"LoRA: the frozen base weights are {frozen}, the trainable adapters {trainable}"


@dataclass
class StepFigures:
    """What a step's record says besides its loss, kept until the loss has been added up."""

    step: int
    lr: float
    grad_norm: torch.Tensor
    tokens: int
    step_time: float
    ended: float  # wall clock: the record's time is when the step ended, not when its loss landed
    compiled: bool = False  # torch.compile compiled during the step: its time is mostly compilation


class StepWindows:
    """Step records on their way: their losses are added up over the ranks a window of steps at a time.

    One all-reduce per step would cost a small model's step on CPU ranks several percent; one per
    window of about REPORT_EVERY_S does not, and the charts cannot tell. A window is one step where
    steps are slower than that, so a big model's records still arrive as each step ends. Its length
    comes from the previous window's summed step times, which every rank receives alike: the ranks
    cut the same windows without another collective. The loop closes one early where it needs the
    figures at once (the last step, a checkpoint, an evaluation). The sums land while later steps
    compute; whether any rank was asked to stop rides along, so a SIGTERM is acted on within a
    window or two.
    """

    def __init__(self, device: torch.device, write: Callable[[StepFigures, float | None], None]) -> None:
        self.device, self.write = device, write
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.figures: list[StepFigures] = []
        self.shares: list[torch.Tensor | None] = []
        self.every = 1
        self.close_at = 1
        self.landing: torch.futures.Future[tuple[WindowSums, int]] | None = None

    def add(self, figures: StepFigures, share: torch.Tensor | None, stop: bool, now: bool) -> bool:
        """Add a step (its share of the loss, or None); returns whether a rank has been asked to stop.

        `now`: the step's record is written before this returns. Every rank must call this with the
        same steps and `now`, since closing a window is a collective.
        """
        self.figures.append(figures)
        self.shares.append(share)
        stopped = False
        if now or figures.step >= self.close_at:
            stopped = self._land()
            window = self.figures
            seconds = sum(f.step_time for f in window)
            sums = window_sums_async(self.shares, stop, seconds, self.device)
            self.landing = sums.then(lambda f: self._written(window, f.value()))
            self.figures, self.shares = [], []
            self.close_at = figures.step + self.every
        if now or stopped:
            stopped = self._land() or stopped
        return stopped

    def _written(self, window: list[StepFigures], sums: WindowSums) -> tuple[WindowSums, int]:
        for f, loss in zip(window, sums.losses, strict=True):
            self.write(f, loss)
        return sums, len(window)

    def _land(self) -> bool:
        if self.landing is None:
            return False
        sums, steps = self.landing.wait()
        self.landing = None
        mean_step = sums.seconds / (steps * self.world)
        self.every = max(1, min(MAX_WINDOW, int(REPORT_EVERY_S / mean_step) if mean_step > 0 else MAX_WINDOW))
        return sums.flag


@dataclass
class Batch:
    inputs: torch.Tensor
    labels: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.inputs.numel()


class Trainer:
    def __init__(self, spec: JobSpec, job_dir: Path, runtime: Runtime) -> None:
        assert spec.train is not None
        self.spec, self.s, self.job_dir, self.rt = spec, spec.train, job_dir, runtime
        self.cancel = CancelFlag()
        self.dims = runtime.dims
        self.precision: PrecisionPlan = precision_plan(self.s.precision, runtime)
        self.notes: list[str] = list(spec.upgrade_notes)  # what reading an older job.json changed
        # What turns a micro-batch's summed token loss into its share of the step's loss (set per step).
        self.loss_scale = 1.0
        # The process groups a step reduces over, looked up once: slicing a device mesh builds a new one.
        mesh = runtime.mesh
        self.dp_groups = [mesh[d].get_group() for d in ("dp_replicate", "dp_shard") if mesh[d].size() > 1]
        self.pp_group = mesh["pp"].get_group() if self.dims.pp > 1 else None

    # --- set-up -----------------------------------------------------------------------------------

    def setup(self) -> None:
        s, rt = self.s, self.rt
        files, docs = read_dataset(s.dataset, s.text_field)
        status("loading model")
        # Pipeline stages keep only their own layers, so each builds its model whole and drops the rest.
        # RIGPILOT_LOAD_ON_EVERY_RANK=1: the old way, for a model class that cannot be built on meta.
        every_rank = os.environ.get("RIGPILOT_LOAD_ON_EVERY_RANK") == "1"
        rank0_loads = self.dims.world_size > 1 and self.dims.pp == 1 and not every_rank
        # Full training: fp32 master weights (or bf16 ones, if asked). LoRA/QLoRA: the base in the compute dtype.
        dtype = training_load_dtype(s.method, self.precision.compute, s.master_weights)
        if s.master_weights == "bf16":
            self.notes.append("bf16 master weights: the weights, their gradients and AdamW's state are all bf16")
        self.loaded: LoadedModel = load_model(
            self.spec, dtype=dtype, for_training=True, seed=s.seed, rank0_loads=rank0_loads
        )
        counts = count_params(self.loaded.model)
        if self.loaded.nf4_linears:
            self.notes.append(
                f"QLoRA: the base weights of {self.loaded.nf4_linears} adapted linear layers are 4-bit NF4 (torchao)"
            )
        if self.loaded.lora:
            self.notes.append(lora_dtypes_note(self.loaded.model))
        self.flops_per_token = 6.0 * counts["compute"]
        self.log(
            f"model {self.loaded.source.ref}: {counts['total'] / 1e6:.2f}M parameters, "
            f"{counts['trainable'] / 1e6:.3f}M trainable, objective {self.loaded.objective}"
        )
        causal = self.loaded.objective == "causal"
        self.data: Dataset = build_dataset(
            files,
            docs,
            self.loaded.tokenizer,
            s.seq_len + 1 if causal else s.seq_len,
            s.eval_fraction,
            s.seed,
            train_on_prompts=s.train_on_prompts or not causal,
        )
        self.log(
            f"data: {self.data.num_tokens} tokens, {len(self.data.train)} train / {len(self.data.eval)} eval sequences"
        )
        if self.data.train_trained is not None:
            share = self.data.trained_tokens / max(self.data.num_tokens, 1)
            self.notes.append(f"chat data: the loss covers the assistant's answers only ({share:.0%} of the tokens)")
        if self.data.unmaskable_chats:
            self.notes.append(
                f"{self.data.unmaskable_chats} conversation(s) are trained whole, prompts included: the model's chat "
                "template does not render them turn by turn"
            )
        self.pp_microbatches = self.spec.parallelism.pp_microbatches if self.dims.pp > 1 else 1
        self.sampler = ShardedBatches(
            len(self.data.train), s.micro_batch * self.pp_microbatches, rt.dp_rank, self.dims.dp, s.seed, s.grad_accum
        )
        # Same seed within a model replica (TP ranks must drop the same activations), different across replicas.
        torch.manual_seed(s.seed + 1 + rt.dp_rank)
        self._parallelize()
        self._loss_and_offload()
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.params = params
        self._new_optimizer(params)
        self.checkpointer = Checkpointer(
            self.job_dir,
            rt,
            self.module,
            self.optimizers,
            self.scheduler,
            self.sampler,
            trainable_only=self.loaded.lora,
            keep=s.keep_checkpoints,
            derived=self.tied.derived_keys(self.module) if self.tied is not None else (),
        )
        for note in self.notes:
            self.log(note)
            report(kind="note", message=note)

    def _new_optimizer(self, params: list[nn.Parameter]) -> None:
        """The optimizer(s) and LR schedule of the recipe (engine.workers.optimizers)."""
        s = self.s
        self.rounding = stochastic_rounding(s.master_weights)
        self.in_backward: OptimizerInBackward | None = None

        def make(group: list[nn.Parameter]) -> torch.optim.Optimizer:
            return new_optimizer(group, s.optimizer, s.master_weights, s.learning_rate, s.weight_decay)

        schedule = lr_lambda(s.warmup_steps, s.max_steps)
        if s.optimizer_in_backward:
            self.in_backward = OptimizerInBackward(
                params, make, seed=s.seed, rounding=self.rounding, device=self.rt.device
            )
            self.in_backward.hook()  # the contract refuses it under DDP, where it would free nothing
            self.optimizer: Any = self.in_backward
            self.optimizers: list[torch.optim.Optimizer] = self.in_backward.optimizers
            self.scheduler: Any = Schedulers(self.optimizers, schedule)
        elif s.optimizer_offload:
            self.optimizer = host_offloaded_optimizer(params, self.spec, self.rt.device, self.notes)
            self.optimizers = [self.optimizer]
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
            return
        else:
            self.optimizer = make(params)
            self.optimizers = [self.optimizer]
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        words = optimizer_words(s.optimizer, s.master_weights, s.optimizer_in_backward)
        if words:
            self.notes.append(words)

    def _parallelize(self) -> None:
        rt, dims = self.rt, self.dims
        model = self.loaded.model
        self.tied: TiedAcrossStages | None = None
        self.loss_parallel = False
        if dims.pp > 1:
            if self.precision.compute == torch.float16 and self.precision.device_type == "cuda":
                raise UserError(
                    "fp16 with pipeline parallel is not supported (no loss scaling across stages): use bf16"
                )
            model = DecoderStage(decoder_parts(model, "pipeline parallel"), rt.pp_rank, dims.pp)
            self.log(f"pipeline stage {rt.pp_rank}: layers {model.first_layer}..{model.last_layer - 1}")
        if self.s.fp8:  # the linear layers become Float8Linear before TP splits them (torchtitan's order)
            fp8_gather = dims.dp_shard > 1 and dims.tp == 1 and not self.spec.parallelism.cpu_offload
            self.notes += apply_float8(model, rt.device, fsdp_all_gather=fp8_gather)
        if dims.tp > 1:
            sequence_parallel = self.spec.parallelism.sequence_parallel
            if sequence_parallel and self.s.seq_len % dims.tp:
                # Uneven sequence shards would need padded collectives; a plain TP step computes the same.
                self.notes.append(
                    f"sequence parallel needs the sequence length ({self.s.seq_len}) to be a multiple of "
                    f"tp ({dims.tp}): running plain tensor parallel"
                )
                sequence_parallel = False
            self.notes += apply_tensor_parallel(model, rt.mesh["tp"], sequence_parallel, vocab_parallel=True)
            self.loss_parallel = logits_split(model)
        apply_activation_checkpointing(model, self.s.activation_checkpointing)
        if self.s.compile:  # each block with its checkpointing, before FSDP2 wraps it (torchtitan's order)
            self.notes += apply_compile(model, getattr(self.loaded.config, "model_type", None), self.loaded.lora)
        self.module: nn.Module = model  # the module whose parameters and state dict are this rank's part
        reshard = self.spec.parallelism.reshard_after_forward
        if not reshard and dims.dp_shard > 1:
            self.notes.append("FSDP2 keeps each block's parameters gathered from forward through backward (ZeRO-2)")
        skeleton = self.loaded.rank0_state is not None
        offload = self.spec.parallelism.cpu_offload
        fsdp = uses_fsdp(dims, offload)
        if skeleton and not fsdp:
            materialize(model, self.loaded, rt.device)  # DDP starts from the values it is given
        self.wrapped = apply_data_parallel(model, rt, self.precision, reshard, cpu_offload=offload)
        if skeleton and fsdp:
            # Each rank allocates and receives its shards only; offloaded shards are allocated in host memory.
            materialize(model, self.loaded, offload_device(rt, offload))
        if skeleton:
            self.notes.append("the weights were read once, by rank 0, and handed out to the other ranks")
        if dims.pp > 1:
            # After tensor and data parallelism, which replace the parameters the pair is made of.
            self.tied = tied_across_stages(model, rt.mesh)
        if self.tied is not None:
            self.tied.align_weights()
            self.notes.append(
                "the tied embedding and LM head sit on the first and last stage: their gradients are summed "
                "every step, so they stay one matrix"
            )
        if offload:
            on_host, total = offloaded_shards(model)
            self.notes.append(
                f"CPU offload (FSDP2 CPUOffloadPolicy over {dims.dp} rank(s)): {on_host} of {total} parameter shards, "
                "their gradients and the optimizer step in host memory"
            )
        self.module.train()
        self.scaler = None
        if self.precision.compute == torch.float16 and self.precision.device_type == "cuda":
            self.scaler = torch.amp.GradScaler("cuda")
        self.schedule = self._pipeline_schedule() if dims.pp > 1 else None

    def _loss_and_offload(self) -> None:
        """The recipe's activation side: the loss a chunk of tokens at a time, saved activations on the host."""
        s = self.s
        self.loss = TokenLoss(self.module, s.loss_chunks, self.precision.autocast_context)
        self.loss.hold_head(self.wrapped)
        if s.loss_chunks > 1:
            self.notes.append(
                f"chunked loss: the output head's logits and their fp32 cross-entropy are computed "
                f"{s.loss_chunks} chunks of tokens at a time, so the whole fp32 logits never exist"
            )
        self.offload: ActivationOffload = offload_activations(
            self.module, s.activation_offload, self.rt.device, head_in_loss=self.loss.head is not None
        )
        if s.activation_offload:
            pinned = "pinned host memory, copied on a side stream" if self.rt.device.type == "cuda" else "host memory"
            self.notes.append(f"activation offloading: the activations saved for backward wait in {pinned}")

    def _pipeline_schedule(self) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        p = self.spec.parallelism
        schedule = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[p.pp_schedule]  # spelled one way (engine.layout)
        if p.pp_schedule == "1F1B" and p.pp_microbatches < self.dims.pp:
            raise UserError(
                f"1F1B needs at least as many micro-batches as stages ({self.dims.pp}); pp_microbatches={p.pp_microbatches}"
            )
        stage = PipelineStage(
            self.wrapped, self.rt.pp_rank, self.dims.pp, self.rt.device, group=self.rt.mesh["pp"].get_group()
        )
        # scale_grads=False: every micro-batch's loss is already its share of the step's token mean.
        return schedule(stage, n_microbatches=p.pp_microbatches, loss_fn=self._scaled_loss, scale_grads=False)

    def _scaled_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # No side effects: the schedule also calls it once to infer gradient shapes on its first step.
        # `logits`: the last stage's output, the final hidden states where the loss is chunked.
        with self.offload.keep_on_device():
            return self.loss(logits, labels) * self.loss_scale

    # --- batches ----------------------------------------------------------------------------------

    def _batch(self, block: torch.Tensor, step: int, micro: int, trained: torch.Tensor | None = None) -> Batch:
        """Inputs and labels of a batch; tokens outside `trained` (prompts, eval padding) get no label."""
        if self.loaded.objective == "causal":
            labels = block[:, 1:]
            if trained is not None:
                labels = labels.masked_fill(~trained[:, 1:], -100)
            return Batch(block[:, :-1].to(self.rt.device), labels.to(self.rt.device))
        tok = self.loaded.tokenizer
        g = torch.Generator().manual_seed(self.s.seed * 1_000_003 + step * 7919 + micro * 131 + self.rt.dp_rank)
        inputs, labels = mask_for_mlm(block, tok.mask_token_id, len(tok), list(tok.all_special_ids), g)
        if trained is not None:
            labels = labels.masked_fill(~trained, -100)
        return Batch(inputs.to(self.rt.device), labels.to(self.rt.device))

    # --- one step ---------------------------------------------------------------------------------

    def _forward_loss(self, batch: Batch) -> torch.Tensor:
        # use_cache=False: a KV cache in training only costs memory, and checkpointed blocks would
        # find it filled by their first run when they recompute. Encoders have no cache to turn off.
        kwargs = {"use_cache": False} if self.loaded.objective == "causal" else {}
        with self.precision.autocast_context(), self.loss.model_output(), self.offload.saving():
            output = self.wrapped(input_ids=batch.inputs, **kwargs).logits  # the hidden states if chunked
        return self.loss(output, batch.labels)

    def _loss_context(self) -> Any:
        """loss_parallel() around the forward and backward of vocabulary-sharded logits, else nothing."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def train_step(self, step: int) -> tuple[torch.Tensor | None, int]:
        """Run one optimizer step's forward/backward passes.

        Returns (this replica's share of the step's loss as a float64 tensor, or None on ranks that
        hold no loss; tokens). The shares of all replicas add up to the step's loss.
        """
        accum = self.s.grad_accum
        batches = []
        everyone = []  # the global batches' block indices, every replica's
        for micro in range(accum):
            global_picked = self.sampler.next_global_indices()
            everyone.append(global_picked)
            picked = global_picked[self.rt.dp_rank]
            trained = None if self.data.train_trained is None else self.data.train_trained[picked]
            batches.append(self._batch(self.data.train[picked], step, micro, trained))
        count = self._global_trained_tokens(batches, torch.cat(everyone).flatten())
        # DDP and FSDP average the gradients over the data-parallel ranks; the dp factor undoes that.
        # A step without a trained token anywhere has a zero loss and zero gradients, not NaN.
        self.loss_scale = self.dims.dp / max(count, 1)
        shares: list[torch.Tensor] = []  # the micro-batches' losses as backpropagated
        tokens = 0
        for micro, batch in enumerate(batches):
            tokens += batch.tokens
            if self.schedule is not None:
                mb_losses: list[torch.Tensor] = []  # the schedule's loss_fn (_scaled_loss) scales them
                with self.precision.autocast_context(), self._loss_context(), self.offload.saving():
                    if self.rt.pp_rank == 0:
                        self.schedule.step(batch.inputs, target=batch.labels, losses=mb_losses)
                    else:
                        self.schedule.step(target=batch.labels, losses=mb_losses)
                shares += [plain(x.detach()) for x in mb_losses]
                continue
            with set_gradient_sync(self.wrapped, micro == accum - 1), self._loss_context():
                scaled = self._forward_loss(batch) * self.loss_scale
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            shares.append(plain(scaled.detach()))
        if not self._reports_loss():
            return None, tokens
        return torch.stack(shares).double().sum() / self.dims.dp, tokens

    def _global_trained_tokens(self, batches: list[Batch], everyone: torch.Tensor) -> int:
        """Trained tokens in this step's micro-batches on every data-parallel replica.

        Next-token labels follow from the blocks alone, and every rank knows every replica's blocks
        (`everyone`): counted here, with no collective. Masked-LM labels are drawn per replica, so
        their counts are summed over the data-parallel dims of the mesh (the ranks of one replica,
        tensor and pipeline parallel, hold the same labels).
        """
        if self.loaded.objective == "causal":
            if self.data.train_trained is None:
                return everyone.numel() * (self.data.block_len - 1)
            return int(self.data.train_trained[everyone][:, 1:].sum())
        count = torch.stack([(b.labels != -100).sum() for b in batches]).sum().to(torch.int64)
        for group in self.dp_groups:
            dist.all_reduce(count, group=group)
        return int(count)

    def _optimizer_step(self, step: int) -> torch.Tensor:
        """Step the weights (those stepped in backward are done: only their norm is added up) and the LR."""
        if self.in_backward is not None:
            norm = self.in_backward.finish_step()
            self.scheduler.step()
            return norm
        if self.tied is not None:
            self.tied.sum_grads()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        duplicates = self.tied.counted_elsewhere() if self.tied is not None else []
        if isinstance(self.optimizer, HostOffloadedOptimizer):  # its gradients are in host memory by now
            norm = self.optimizer.clip_grad_norm_(self.s.grad_clip)
        else:
            norm = clip_grad_norm(self.params, self.s.grad_clip, self.pp_group, duplicates)
        with rounding_seed(self.s.seed, step, 0, self.rt.device) if self.rounding else contextlib.nullcontext():
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        if self.rounding and self.tied is not None:
            # The two stages' copies drew different rounding bits: the embedding's is the pair's.
            self.tied.align_weights()
        self.scheduler.step()
        return norm

    # --- evaluation -------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, step: int) -> float | None:
        """The eval loss: summed token cross-entropy over every trained eval token, over their count."""
        self.module.eval()
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        batch_size = self.s.micro_batch * self.pp_microbatches
        batches = eval_batches(self.data.eval, batch_size, self.rt.dp_rank, self.dims.dp, self.data.eval_trained)
        self.loss_scale = 1.0  # the pipeline's loss_fn gives plain sums here
        for i, (block, trained) in enumerate(batches):
            batch = self._batch(block, -1 - i, 0, trained)  # negative steps: masking never repeats a training batch's
            count += int((batch.labels != -100).sum())
            if self.schedule is not None:
                mb_losses: list[torch.Tensor] = []
                with self.precision.autocast_context(), self._loss_context():
                    if self.rt.pp_rank == 0:
                        self.schedule.eval(batch.inputs, target=batch.labels, losses=mb_losses)
                    else:
                        self.schedule.eval(target=batch.labels, losses=mb_losses)
                if mb_losses:
                    total += torch.stack([plain(x) for x in mb_losses]).double().sum().cpu()
            else:
                with self._loss_context():
                    total += plain(self._forward_loss(batch)).double().cpu()
        self.loss.release()
        self.module.train()
        mine = [float(total), float(count)] if self._reports_loss() else [0.0, 0.0]
        loss_sum, tokens = world_sums(mine, self.rt.device)
        return loss_sum / tokens if tokens > 0 else None

    def _reports_loss(self) -> bool:
        """One rank per data-parallel replica holds the loss: the last stage's first tensor-parallel rank."""
        return self.rt.pp_rank == self.dims.pp - 1 and self.rt.tp_rank == 0

    # --- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        s, rt = self.s, self.rt
        step = 0
        if self.spec.resume:
            resumed = self.checkpointer.resume()
            if resumed is None:
                note = "resume requested but there is no complete checkpoint: starting from step 0"
                self.log(note)
                report(kind="note", message=note)
            else:
                path, step, notes = resumed
                if self.tied is not None:  # a checkpoint written before the pair was kept tied holds two
                    self.tied.align_weights()
                    self.tied.align_optimizer(self.optimizer)
                for note in [*notes, f"resumed from {path.name} at step {step}"]:
                    self.log(note)
                    report(step=step, kind="note", message=note)
        # From here on a SIGTERM has work to save: finish the step, checkpoint, then exit.
        self.cancel.install()
        warmup = CompileWarmup(s.compile)
        status(warmup.phase, max_steps=s.max_steps)
        windows = StepWindows(rt.device, self._report_step)
        last_end = time.perf_counter()
        while step < s.max_steps:
            warmup.begin()
            self.optimizer.zero_grad(set_to_none=True)
            lr = float(self.scheduler.get_last_lr()[0])  # torchao keeps it a (CPU) tensor
            if self.in_backward is not None:
                self.in_backward.begin_step(step)
            loss, tokens = self.train_step(step)
            grad_norm = self._optimizer_step(step)
            step += 1
            # Between step ends: on a GPU the host runs ahead of the device only as far as the
            # collectives let it, so this is the device's step time without a sync.
            now = time.perf_counter()
            warming = warmup.phase == "compiling"
            figures = StepFigures(step, lr, grad_norm, tokens, now - last_end, time.time(), warmup.end())
            if warming:
                status("training", step=step, compile_time=figures.step_time)
            last_end = now
            last = step == s.max_steps
            checkpoint_now = s.checkpoint_every > 0 and (step % s.checkpoint_every == 0 or last)
            evaluate_now = not last and s.eval_every > 0 and step % s.eval_every == 0
            # The records go before anything else is written, and the last one is never lost.
            cancelled = windows.add(figures, loss, self.cancel.requested, now=last or checkpoint_now or evaluate_now)
            # The trained steps are saved before anything that could fail without touching them
            # (evaluation, the export): the last step is always checkpointed, unless checkpoints are off.
            if cancelled or checkpoint_now:
                self._checkpoint(step, resume_phase=not cancelled)
            if cancelled and last:
                # Every step is trained and saved: the job finishes (evaluation, the model) rather than end cancelled.
                self.log("cancel requested after the last step: finishing the job")
            elif cancelled:
                status("cancelled", step=step, exit_code=EXIT_CANCELLED)
                self.log(f"cancelled after step {step}; checkpoint saved")
                return EXIT_CANCELLED
            if evaluate_now:
                self._evaluate_and_report(step)
            if checkpoint_now or evaluate_now:
                last_end = time.perf_counter()  # the next step's time leaves the checkpoint and the evaluation out
        # A job resumed from its last step's checkpoint evaluates and exports again, as one that got there.
        if s.eval_every > 0:
            self._evaluate_and_report(step)
        status("saving")
        self.save_output()
        status("done", step=step, exit_code=EXIT_OK)
        return EXIT_OK

    def _report_step(self, f: StepFigures, step_loss: float | None) -> None:
        """Write a step's record and log line once its loss has landed."""
        # Per device, as torchtitan counts: the replica's tokens over the ranks that share it. A step that
        # compiled states its time as compilation and no speed, which would read as the training's.
        speed: dict[str, float | None] = {"compile_time": f.step_time}
        if not f.compiled:
            tps = f.tokens / f.step_time / self.dims.non_dp
            speed = {"tokens_per_s": tps, "mfu": mfu(self.flops_per_token, tps)}
        grad_norm = float(f.grad_norm)
        report(
            step=f.step,
            loss=step_loss,
            lr=f.lr,
            grad_norm=grad_norm,
            step_time=f.step_time,
            time=f.ended,
            peak_memory=peak_memory(self.rt.device),
            **speed,
        )
        self.log(
            f"step {f.step}/{self.s.max_steps} loss {_fmt(step_loss)} lr {f.lr:.3g} grad_norm {grad_norm:.3g} "
            f"{f.step_time * 1000:.0f} ms{' (compiling)' if f.compiled else ''}"
        )

    def _evaluate_and_report(self, step: int) -> None:
        if not len(self.data.eval):
            return
        eval_loss = self.evaluate(step)
        if eval_loss is not None:
            report(step=step, kind="eval", eval_loss=eval_loss)
            self.log(f"step {step} eval_loss {eval_loss:.4f}")

    def _checkpoint(self, step: int, resume_phase: bool) -> None:
        status("checkpointing", step=step)
        t0 = time.perf_counter()
        path = self.checkpointer.save(step)
        report(step=step, kind="checkpoint", checkpoint_time=time.perf_counter() - t0)
        self.log(f"checkpoint {path}")
        if resume_phase:
            status("training")

    def save_output(self) -> None:
        state = gather_full_state(self.module, self.rt, trainable_only=self.loaded.lora)
        if self.rt.is_main:
            out = self.job_dir / "output"
            save_final_model(
                out,
                self.loaded,
                state,
                save_merged=self.s.save_merged,
                trust_remote_code=self.spec.trust_remote_code,
            )
            self.log(f"model saved to {out}")
        dist.barrier()

    def log(self, message: str) -> None:
        if self.rt.is_main:
            print(f"[rank0] {message}", flush=True)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A loss or norm as a plain tensor: under loss_parallel or TP it is a replicated DTensor, which plain sums refuse."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def run_train(spec: JobSpec, job_dir: Path) -> int:
    if spec.train is None:
        raise UserError("train job without train settings")
    validate_settings(spec.train)
    runtime = init_runtime(spec)
    validate_recipe(spec, runtime.device)
    s = spec.train
    if s.compile or s.optimizer == "adamw8bit" or s.master_weights == "bf16":
        # torchao's optimizers compile their step (8-bit moments, stochastic rounding) even without --compile:
        # their kernels too go to the private cache, not inductor's /tmp default another user could plant.
        private_inductor_cache()
    trainer = Trainer(spec, job_dir, runtime)
    trainer.setup()
    return trainer.run()
