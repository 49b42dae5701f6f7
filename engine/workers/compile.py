"""torch.compile of each transformer block and torchao's FP8 training: the recipe's speed settings on a rank.

Regional compilation, as torchtitan's `apply_compile` and torchtune's `compile_model` do: each block is compiled
once its tensor parallel plan and activation checkpointing are applied and before FSDP2 wraps it, so the
blocks' identical code compiles into one graph reused by every block, and the embedding, the head and the loss
stay eager. Blocks are compiled in place (`module.compile()`), not wrapped in an OptimizedModule, so their
state-dict keys (checkpoints, the exported model, resuming) are those of an eager run: no `_orig_mod.`.

FP8: torchao's float8 training swaps the blocks' linear layers for Float8Linear (dynamic tensorwise scaling,
torchao's default), on GPUs of compute capability 8.9 or newer. The LM head and any linear whose dimensions
are not multiples of 16 stay in high precision, as in torchtitan.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch
from torch import nn

from rigpilot.engine.capability import LLAMA_STYLE_TYPES, RecipeContext
from rigpilot.engine.errors import UserError
from rigpilot.engine.layout import Layout
from rigpilot.engine.recipe import Recipe
from rigpilot.engine.recipe_refusal import check_recipe, refuse
from rigpilot.engine.settings import cache_dir
from rigpilot.engine.workers.parallelize import blocks

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# FP8 matmuls need both dimensions of each weight to be multiples of 16 (torch._scaled_mm's rule).
FP8_DIM_MULTIPLE = 16
# Model types whose blocks compile into one graph without a break (Llama's, tested); other blocks may break
# the graph (a mixture of experts routes tokens by data), which torch.compile then splits rather than refuses.
FULLGRAPH_TYPES = LLAMA_STYLE_TYPES


def private_inductor_cache() -> Path:
    """The compiled kernels' cache: `~/.cache/rigpilot/torchinductor` (XDG), 0700; its path, set for inductor.

    Inductor's default, /tmp/torchinductor_<user>, sits in a folder every user writes to, where another user
    can create it first and plant kernels this job would load; the user's own cache folder cannot be. Kept
    across jobs, so a second job of the same model skips most of the warm-up. A cache the user chose
    (TORCHINDUCTOR_CACHE_DIR in the job's environment) is theirs and kept; inductor writes its default into
    the variable itself once anything asks for it (torchao's import does), so that value is not a choice.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    path = cache_dir() / "torchinductor"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.chmod(0o700)  # mkdir's mode is masked by the umask, and an older folder keeps its own
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise  # a full disk is the worker's to report (engine.diskspace), as anywhere else
        raise UserError(
            f"torch.compile's kernel cache {path} cannot be made ({e.strerror}): give the job "
            f"{INDUCTOR_CACHE_ENV} set to a folder of yours, or run without --compile",
            reason="compile_cache_unwritable",
            path=str(path),
        ) from None
    os.environ[INDUCTOR_CACHE_ENV] = str(path)
    return path


def apply_compile(model: nn.Module, model_type: str | None = None, adapters: bool = False) -> list[str]:
    """torch.compile each transformer block of `model` (a whole model or a pipeline stage) in place.

    After tensor parallel and activation checkpointing (so the checkpoint wrapper is compiled with its
    block), before data parallel: torchtitan's order. Whole graphs (fullgraph) for Llama-style blocks without
    `adapters` (peft's LoRA layers); other blocks may be split where dynamo cannot trace. Returns notes for
    the log.
    """
    where = private_inductor_cache()
    fullgraph = model_type in FULLGRAPH_TYPES and not adapters
    block_list = blocks(model)
    for block in block_list:
        # NOTE: compile in place: torch.compile(block) would return an OptimizedModule whose state dict
        # prefixes every key with `_orig_mod.`, and checkpoints of a compiled job would not load eagerly.
        block.compile(backend="inductor", fullgraph=fullgraph)
    return [
        f"torch.compile: each of the {len(block_list)} transformer blocks is compiled (inductor"
        f"{', whole graphs' if fullgraph else ''}); the first step compiles them, its kernels cached in {where}"
    ]


class CompileWarmup:
    """Which steps compiled: their time is compilation, not training speed.

    The first step after start-up compiles every block's forward and backward; a later step compiles only
    where something the graphs were specialised on changed (a recompile). Read from dynamo's own count of
    the graphs it made (a private counter, hence the guard): a step during which it grew compiled.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.started = _graphs_made()
        self.first = True

    @property
    def phase(self) -> str:
        """The phase the job shows while the next step runs."""
        return "compiling" if self.enabled and self.first else "training"

    def begin(self) -> None:
        self.started = _graphs_made()

    def end(self) -> bool:
        """Whether the step since `begin` compiled (the first step of a compiled job always does)."""
        if not self.enabled:
            return False
        compiled = self.first or _graphs_made() != self.started
        self.first = False
        return compiled


def _graphs_made() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"]) + int(counters["aot_autograd"]["total"])


# --- FP8 -----------------------------------------------------------------------------------------------------


def fp8_linear(module: nn.Module, fqn: str) -> bool:
    """Whether torchao converts this module to FP8: a plain linear layer inside the blocks whose dimensions
    FP8 matmuls take. The LM head stays in high precision (its logits feed the loss directly)."""
    if type(module) is not nn.Linear:  # not LoRA's wrappers, not an already-converted layer
        return False
    if fqn.split(".")[-1] in ("lm_head", "output", "score"):
        return False
    return module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0


def apply_float8(
    model: nn.Module, device: torch.device, emulate: bool = False, fsdp_all_gather: bool = False
) -> list[str]:
    """Convert `model`'s linear layers to torchao's Float8Linear (before tensor parallel, as torchtitan does).

    `emulate`: torchao's emulation mode, which runs the FP8 casts and scales in high-precision matmuls; it
    runs anywhere and exists to test the numerics (the CPU tests use it), not to train. Without it the
    device is checked here, on the rank, whatever the engine was told about the GPUs.
    `fsdp_all_gather`: FSDP2 gathers the converted weights in FP8 (half bf16's traffic; torchao's
    enable_fsdp_float8_all_gather), for a model FSDP2 shards without tensor parallel: it trains the same
    model, as tests/workers/test_workers_compile.py checks in emulation on gloo ranks.
    """
    if not emulate:  # the contract again, with this rank's own device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        check_recipe(Recipe(fp8=True), Layout(), RecipeContext(gpu_capability=capability, cpu_ranks=device.type != "cuda"))
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted: list[str] = []

    def chosen(module: nn.Module, fqn: str) -> bool:
        if fp8_linear(module, fqn):
            converted.append(fqn)
            return True
        return False

    config = Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)
    convert_to_float8_training(model, module_filter_fn=chosen, config=config)
    if not converted:
        refuse("fp8", True, f"FP8: none of the model's linear layers has dimensions that are multiples of {FP8_DIM_MULTIPLE}")
    kept = sum(1 for _, m in model.named_modules() if type(m) is nn.Linear)
    how = "emulated in high precision" if emulate else "dynamic tensorwise scaling"
    gathered = ", gathered by FSDP2 in FP8" if fsdp_all_gather else ""
    return [f"FP8 (torchao float8, {how}{gathered}): {len(converted)} linear layers; {kept} stay in high precision"]
