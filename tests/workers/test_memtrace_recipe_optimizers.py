"""The trace of the two optimizer recipes it used to leave to the formula, against real CPU steps.

8-bit AdamW (torchao's AdamW8bit) and the optimizer step in backward (the worker's OptimizerInBackward) on a tiny
Llama and (slow) a tiny Mixtral, 4 blocks, vocabulary 4096, one rank, bf16 mixed precision, micro-batch 2 × 128.
The fake trace (`_trace_step`, fake tensors) is held within 5% of the same step on real CPU tensors under
MemTracker; the step in backward also of the worker's own loop (as benchmarks/recipe_memory.py runs it), and the
8-bit state of torchao's real, compiled optimizer.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

LAYERS, VOCAB, SEQ, MICRO = 4, 4096, 128, 2
TOLERANCE = 0.05


@pytest.fixture(scope="module", params=["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rigpilot.engine.accuracy.models import TINY_CONFIGS

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    config = {**TINY_CONFIGS[request.param], "num_hidden_layers": LAYERS, "vocab_size": VOCAB}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _trace(folder: Path, real: bool, **recipe: Any) -> Any:
    return _traced(str(folder), real, tuple(sorted(recipe.items())))


@functools.cache
def _traced(folder: str, real: bool, recipe: tuple[tuple[str, Any], ...]) -> Any:
    from rigpilot.engine.layout import Layout
    from rigpilot.engine.workers import memtrace

    config = memtrace._load_config(folder, False)
    workload = {"model": folder, "task": "train", "method": "full", "precision": "bf16", "seq_len": SEQ,
                **dict(recipe)}  # fmt: skip
    par = {"micro_batch": MICRO, "grad_accum": 1, "checkpointing": "none"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return memtrace._trace_step(config, LAYERS, workload, par, Layout.from_dict({}), False, real=real)


def _close(traced: float, measured: float) -> bool:
    return abs(traced - measured) <= TOLERANCE * measured


@pytest.mark.parametrize(
    "recipe",
    [
        # Both at once in the quick run: each alone (slow) is the same two mechanisms apart.
        {"optimizer": "adamw8bit", "optimizer_in_backward": True},
        pytest.param({"optimizer_in_backward": True}, marks=pytest.mark.slow),
        pytest.param({"optimizer": "adamw8bit"}, marks=pytest.mark.slow),
    ],
    ids=["8-bit in backward", "in backward", "8-bit"],
)
def test_the_fake_trace_holds_the_real_step(family: Path, recipe: dict[str, Any]) -> None:
    fake, real = _trace(family, False, **recipe), _trace(family, True, **recipe)
    assert _close(fake.forward_backward, real.forward_backward), (fake, real)
    assert _close(fake.optimizer, real.optimizer), (fake, real)
    assert _close(fake.categories["Optstate"], real.categories["Optstate"]), (fake.categories, real.categories)


def test_in_backward_no_two_full_gradients_coexist(family: Path) -> None:
    plain, stepped = _trace(family, False), _trace(family, False, optimizer_in_backward=True)
    largest = max(p.numel() for p in _model(family).parameters()) * 4  # one fp32 gradient
    # Each gradient is gone when its hook has stepped its weight: none is left after backward, and the step's
    # phase holds at most one weight's; the plain step holds all of them there.
    assert stepped.snapshots["after_backward"]["Gradient"] == 0
    assert plain.snapshots["after_backward"]["Gradient"] > 2 * largest
    assert plain.optimizer - stepped.optimizer >= plain.snapshots["after_backward"]["Gradient"] - largest


def _model(folder: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def test_in_backward_against_the_workers_own_step(family: Path) -> None:
    """The worker's OptimizerInBackward on the model as the worker loads it (fp32 weights, bf16 autocast)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from rigpilot.engine.workers.optimizers import OptimizerInBackward, new_optimizer

    model = _model(family)
    stepper = OptimizerInBackward(list(model.parameters()), lambda g: new_optimizer(g, "adamw", "fp32", 1e-4, 0.1),
                                  seed=0, rounding=False, device=torch.device("cpu"))  # fmt: skip
    stepper.hook()
    ids = torch.randint(0, VOCAB, (MICRO, SEQ))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        stepper.finish_step()

    step()  # the moments exist from here on
    tracker = MemTracker()
    tracker.track_external(model, *stepper.optimizers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
            step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert _close(_trace(family, False, optimizer_in_backward=True).peak, peak)


def _state_bytes(optimizer: Any) -> int:
    total = 0
    for s in optimizer.state.values():
        for value in s.values():  # the step count and both moments (8-bit where the weight is large enough)
            parts = (value.codes, value.scale, value.qmap) if hasattr(value, "codes") else (value,)
            total += sum(part.numel() * part.element_size() for part in parts)
    return total


@pytest.mark.slow
def test_eight_bit_state_is_torchaos_own(family: Path) -> None:
    """The traced state's bytes against those torchao's real optimizer holds after its compiled step (uint8
    codes, fp32 block scales, the code tables). Slow: torchao compiles its update for each weight's shape."""
    from rigpilot.engine.workers.optimizers import new_optimizer

    model = _model(family)
    optimizer = new_optimizer(list(model.parameters()), "adamw8bit", "fp32", 1e-4, 0.1)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()
    assert _trace(family, False, optimizer="adamw8bit").categories["Optstate"] == _state_bytes(optimizer)


@pytest.mark.slow
def test_the_stand_in_update_allocates_what_the_compiled_one_does() -> None:
    """memtrace.EIGHT_BIT_STEP_BUFFERS against the buffers inductor's code for torchao's update allocates
    (on CPU: the trace's stand-in is checked where this machine can compile). Slow: one compile."""
    from torch._inductor.utils import run_and_get_code

    from rigpilot.engine.workers import memtrace
    from rigpilot.engine.workers.optimizers import new_optimizer

    weight = torch.nn.Parameter(torch.randn(1024, 512))
    weight.grad = torch.randn_like(weight)
    optimizer = new_optimizer([weight], "adamw8bit", "fp32", 1e-4, 0.1)
    optimizer.step()  # the state exists; the next step's code is the steady state's
    torch._dynamo.reset()
    _, codes = run_and_get_code(optimizer.step)
    sizes = sorted(
        int(m.group(1)) * (int(m.group(2)) if m.group(2) else 1)
        for code in codes
        for m in re.finditer(r"empty_strided_\w+\(\((\d+), ?(\d+)?,? ?\)", code)
    )
    blocks = weight.numel() // 256
    expected = sorted(
        {"weight": weight.numel(), "blocks": blocks}[what] for what, n in memtrace.EIGHT_BIT_STEP_BUFFERS for _ in range(n)
    )
    assert sizes == expected, codes


@pytest.mark.slow
def test_under_fsdp_each_rank_holds_its_shard_of_the_8bit_state_and_no_whole_gradients(family: Path) -> None:
    """Two FSDP2 ranks (the fake process group): torchao's 8-bit moments inside the shards' DTensors, and the
    step in backward's hook on the sharded parameter after its reduce-scatter, as the worker runs them."""
    from rigpilot.engine.recipe import Recipe
    from rigpilot.engine.workers import memtrace

    plan = {
        "workload": {"model": str(family), "task": "train", "method": "full", "precision": "bf16", "seq_len": SEQ},
        "parallelism": {"gpu_indices": [0, 1], "backend": "fsdp", "dp": 2, "zero_stage": 3, "shard_degree": 2,
                        "micro_batch": MICRO, "grad_accum": 1, "checkpointing": "none"},
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = memtrace.trace_plan(json.loads(json.dumps(plan)))
        recipe = Recipe(optimizer="adamw8bit", optimizer_in_backward=True)
        both = memtrace.trace_plan(json.loads(json.dumps(plan)), recipe=recipe)
    whole = _trace(family, False, optimizer="adamw8bit").categories["Optstate"]
    assert _close(2 * both["categories"]["Optstate"], whole), (both["categories"], whole)
    # The step's phase: plain AdamW holds every sharded gradient and its moments' update there; stepped in
    # backward, none is left and the 8-bit update holds one weight's buffers.
    assert both["phases"]["optimizer"] < plain["phases"]["optimizer"] / 2, (plain, both)
