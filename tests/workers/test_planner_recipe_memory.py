"""Each technique of the training recipe, alone, on a real CPU step, against the planner's formula.

A tiny Llama and a tiny Mixtral (engine/accuracy's configs, 4 blocks, vocabulary 4096 so the loss weighs)
step once on one rank (backend "single", bf16 mixed precision, no checkpointing, micro-batch 2 × 128 tokens).
The step is the worker's own, on real CPU tensors under PyTorch's MemTracker: memtrace's real-tensor mode
(`_trace_step(real=True)`: the worker's model, chunked loss, activation offloading, host optimizer) and, for the
step in backward, the worker's `OptimizerInBackward` as benchmarks/recipe_memory.py runs it. The formula is
`MemoryModel.train_stage` for the same Parallelism and a Workload with the recipe field set.

What is compared, and why not the formula's total as it stands: the formula holds every gradient beside the
activations and the loss, where a real step peaks at the loss, before backward has made any gradient. So the
formula's total is never below the measured peak, and its total less its gradient term is held within 5% of it.
Activation offloading's formula also keeps a window of OFFLOAD_WINDOW_LAYERS blocks on the device, which a GPU's
side streams hold (the block computing and the one prefetched back) and a CPU step does not: taken out for the
comparison. 8-bit AdamW's step is compiled by torchao, which MemTracker (a dispatch mode) cannot run under: its
state tensors' bytes are measured directly and compared with the formula's optimizer term.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rigpilot.engine.models import describe_model
from rigpilot.engine.planner.memory import OFFLOAD_WINDOW_LAYERS, MemoryModel, StageMemory
from rigpilot.engine.planner.model import model_facts
from rigpilot.engine.planner.plan import Parallelism, Workload

torch = pytest.importorskip("torch")

LAYERS, VOCAB, SEQ, MICRO = 4, 4096, 128, 2
TOLERANCE = 0.05
TECHNIQUES: dict[str, dict[str, Any]] = {
    "plain": {},
    "pure bf16": {"master_weights": "bf16"},
    "chunked loss": {"loss_chunks": 8},
    "activation offload": {"activation_offload": True},
    "optimizer state in host memory": {"optimizer_offload": True},
}
PAR = Parallelism(gpu_indices=[0], backend="single", micro_batch=MICRO, grad_accum=1, checkpointing="none")


@pytest.fixture(scope="module", params=["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rigpilot.engine.accuracy.models import TINY_CONFIGS

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    config = {**TINY_CONFIGS[request.param], "num_hidden_layers": LAYERS, "vocab_size": VOCAB}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _formula(folder: Path, **recipe: Any) -> StageMemory:
    w = Workload(model=str(folder), precision="bf16", seq_len=SEQ, global_batch=MICRO, **recipe)
    return MemoryModel(model_facts(describe_model(str(folder))), w).train_stage(PAR, 0, None)


@dataclass
class Measured:
    peak: int
    categories: dict[str, int]  # at the peak
    after_forward: dict[str, int]


def _measure(folder: Path, **recipe: Any) -> Measured:
    return _measured(str(folder), tuple(sorted(recipe.items())))


@functools.cache  # one step per family and technique, shared by the tests that read it
def _measured(folder: str, recipe: tuple[tuple[str, Any], ...]) -> Measured:
    from rigpilot.engine.layout import Layout
    from rigpilot.engine.workers import memtrace

    config = memtrace._load_config(folder, False)
    workload = {"model": folder, "task": "train", "method": "full", "precision": "bf16", "seq_len": SEQ,
                **dict(recipe)}  # fmt: skip
    par = {"micro_batch": MICRO, "grad_accum": 1, "checkpointing": "none"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        phases = memtrace._trace_step(config, LAYERS, workload, par, Layout.from_dict({}), False, real=True)
    return Measured(phases.peak, phases.categories, phases.snapshots["after_forward"])


def _window(f: StageMemory) -> float:
    """The offloading window's blocks, which the formula keeps on the device (see the module's docstring)."""
    return f.host_offloaded / (LAYERS - OFFLOAD_WINDOW_LAYERS) * OFFLOAD_WINDOW_LAYERS


def _close(formula: float, measured: float) -> bool:
    return abs(formula - measured) <= TOLERANCE * measured


@pytest.mark.parametrize("technique", [t for t in TECHNIQUES if t != "chunked loss"])
def test_the_formula_holds_each_technique_within_five_percent(family: Path, technique: str) -> None:
    recipe = TECHNIQUES[technique]
    f = _formula(family, **recipe)
    m = _measure(family, **recipe)
    total = f.total - f.overhead  # tensors; the overhead (allocator, CUDA context) is not a CPU step's
    assert total >= m.peak * (1 - TOLERANCE), (technique, total, m.peak)  # never under: the OOM direction
    at_loss = total - f.gradients - (_window(f) if recipe.get("activation_offload") else 0.0)
    assert _close(at_loss, m.peak), (technique, at_loss, m.peak, m.categories)
    if technique == "pure bf16":  # bf16 weights and moments: half of the plain step's
        assert _close(f.weights, m.categories["Parameter"]) and _close(f.optimizer, m.categories["Optstate"])
    elif technique == "activation offload":  # what stays on the device at the end of forward
        # The worker offloads the edges' saved tensors too (all but the head's), which the formula keeps on the
        # device: 6% more than the step holds, on the safe side; held within 10% here.
        kept, measured = f.activations - _window(f), m.after_forward["Activation"]
        assert measured <= kept <= 1.1 * measured, (f, m.after_forward)
    elif technique == "optimizer state in host memory":  # master copies, gradients and state, filed as state
        assert _close(f.host_offloaded + f.optimizer, m.categories["Optstate"]), (f, m.categories)
    else:
        assert _close(f.activations, m.categories["Activation"]), (f, m.categories)


def _head_gradient(folder: Path) -> float:
    """Bytes of the output matrix's fp32 gradient: the one gradient a chunked loss's peak holds (see below)."""
    m = model_facts(describe_model(str(folder)))
    return 4.0 * m.vocab * m.h


def test_chunked_loss_is_never_under_the_step(family: Path) -> None:
    recipe = TECHNIQUES["chunked loss"]
    f, m = _formula(family, **recipe), _measure(family, **recipe)
    assert f.total - f.overhead >= m.peak, (f, m.categories)
    assert m.peak < _measure(family).peak  # what chunking is for


@pytest.mark.parametrize("chunks", [2, 8])
def test_chunked_loss_at_its_peak(family: Path, chunks: int) -> None:
    """Chunked cross-entropy: the formula against what the step holds at its peak, which comes in the loss's
    backward, not before it as the plain step's does.

    The worker checkpoints each chunk, so forward keeps only the final hidden states and the labels; each chunk's
    backward recomputes its logits and the head's bf16 copy, and autograd sums the chunks' parts of the head's
    fp32 gradient out of place: the sum so far, the chunk's part and the new sum at once. So the peak holds one
    gradient, the head's (autograd's sum, filed as a temporary), which the formula counts in its gradient term:
    it is added back to the formula's figure less its gradients. With 2 chunks the recomputed chunk (its logits
    and the head's copy) is the larger; with 8 the sum of the gradient."""
    recipe = {"loss_chunks": chunks}
    f, m = _formula(family, **recipe), _measure(family, **recipe)
    head = _head_gradient(family)
    assert m.categories["Gradient"] == 0  # the sum is autograd's until the loss's backward is done
    at_peak = f.total - f.overhead - f.gradients + head
    assert f.total - f.overhead >= m.peak and _close(at_peak, m.peak), (at_peak, m.peak, f, m.categories)
    formula = f.activations + f.buffers + head
    measured = m.categories["Activation"] + m.categories["Temp"]
    assert _close(formula, measured), (formula, measured)
    # forward saves no logits and no copy of the head: the formula's activations, not one chunk's worth more
    assert _close(f.activations, m.after_forward["Activation"]), (f.activations, m.after_forward)


def test_chunked_loss_beside_activation_offload(family: Path) -> None:
    """Activation offloading leaves the chunked loss's head alone: its hooks, inside each chunk's recomputation in
    backward, kept every chunk's saved tensors (the head's bf16 copy among them) on the device until the loss's
    backward was done, 8 copies of the head at once. Now the step's peak holds no more saved activations than the
    formula keeps on the device, and the formula is above the peak."""
    both, alone = _measure(family, loss_chunks=8, activation_offload=True), _measure(family, loss_chunks=8)
    assert both.peak <= alone.peak, (both.categories, alone.categories)
    f = _formula(family, loss_chunks=8, activation_offload=True)
    assert f.total - f.overhead >= both.peak, (f, both.categories)
    assert both.categories.get("Activation", 0) <= f.activations - _window(f), (f, both.categories)


def test_the_step_in_backward(family: Path) -> None:
    """The worker's OptimizerInBackward on the model as the worker loads it (fp32 weights, bf16 autocast)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoConfig, AutoModelForCausalLM

    from rigpilot.engine.workers.optimizers import OptimizerInBackward, new_optimizer

    f = _formula(family, optimizer_in_backward=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(family))
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
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    total = f.total - f.overhead
    assert f.gradients == pytest.approx(max(p.numel() for p in model.parameters()) * 4)  # one weight's, fp32
    assert total >= peak and _close(total - f.gradients, peak), (total, f.gradients, peak)


@pytest.mark.slow
def test_eight_bit_adamw_state(family: Path) -> None:
    """torchao's AdamW8bit compiles its step, under which MemTracker cannot run: the state's bytes, read off the
    optimizer's 8-bit tensors (uint8 codes and fp32 block scales), against the formula's optimizer term.
    Slow: the first step compiles torchao's update for each parameter shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rigpilot.engine.workers.optimizers import new_optimizer

    f = _formula(family, optimizer="adamw8bit")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(family))
    optimizer = new_optimizer(list(model.parameters()), "adamw8bit", "fp32", 1e-4, 0.1)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()
    state = 0
    for s in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            moment = s[key]
            # torchao keeps small tensors' (the norms') moments as plain fp32 tensors
            parts = (moment.codes, moment.scale) if hasattr(moment, "codes") else (moment,)
            state += sum(part.numel() * part.element_size() for part in parts)
    assert _close(f.optimizer, state), (f.optimizer, state)
