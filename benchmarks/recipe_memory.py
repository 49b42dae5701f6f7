"""What the optimizer side of the recipe saves: weights, gradients and optimizer state of each, beside plain AdamW.

    .venv/bin/python benchmarks/recipe_memory.py [--hidden 512] [--layers 4] [--vocab 8192]

Builds a small Llama (transformers, random weights) on the CPU and, for each recipe, the optimizer the training
rank builds for it (engine.workers.optimizers: torch AdamW; torchao AdamW8bit; pure bf16 = bf16 weights with
torchao's AdamW and stochastic rounding; the step in backward = one optimizer per weight in its
post-accumulate-grad hook), runs two training steps (the moments exist from the first on) under PyTorch's
MemTracker (torch.distributed._tools.mem_tracker, as engine/workers/memtrace.py traces plans) and prints, side by
side, the bytes it counts as parameters, as optimizer state after the step and as gradients at their peak, and
the peak of the whole step, each as a ratio to plain AdamW with fp32 weights (today's recipe).

torchao's step runs eagerly here: MemTracker is a dispatch mode, which torch.compile refuses to trace under.
The tensors the optimizers hold are the same either way; only the step's temporaries differ.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["TORCHDYNAMO_DISABLE"] = "1"  # before torch is imported (see above)

# name: (optimizer, master weights, step in backward)
RECIPES: dict[str, tuple[str, str, bool]] = {
    "AdamW, fp32 weights (baseline)": ("adamw", "fp32", False),
    "8-bit AdamW, fp32 weights": ("adamw8bit", "fp32", False),
    "pure bf16 AdamW (stochastic rounding)": ("adamw", "bf16", False),
    "pure bf16 + 8-bit AdamW": ("adamw8bit", "bf16", False),
    "pure bf16 + 8-bit AdamW + step in backward": ("adamw8bit", "bf16", True),
}
GIB = 1 << 20  # printed in MiB


def measure(args: argparse.Namespace, optimizer: str, master: str, in_backward: bool) -> dict[str, int]:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from transformers import LlamaConfig, LlamaForCausalLM

    from rigpilot.engine.workers.optimizers import OptimizerInBackward, new_optimizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
    )  # fmt: skip
    dtype = torch.bfloat16 if master == "bf16" else torch.float32
    model = LlamaForCausalLM(config).to(dtype)
    params = list(model.parameters())

    def make(group: list[Any]) -> torch.optim.Optimizer:
        return new_optimizer(group, optimizer, master, 1e-4, 0.1)

    stepper: Any
    if in_backward:
        stepper = OptimizerInBackward(params, make, seed=0, rounding=master == "bf16", device=torch.device("cpu"))
        stepper.hook()
        optimizers = stepper.optimizers
    else:
        stepper = make(params)
        optimizers = [stepper]
    inputs = torch.randint(0, args.vocab, (args.batch, args.seq))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=master == "bf16"):
            loss = model(input_ids=inputs, labels=inputs, use_cache=False).loss
        loss.backward()
        if not in_backward:
            stepper.step()
        stepper.zero_grad(set_to_none=True)

    step()  # the moments exist from here on, and torchao's step is compiled
    tracker = MemTracker()
    tracker.track_external(model, *optimizers)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    now = tracker.get_tracker_snapshot()[torch.device("cpu")]
    return {
        "params": now.get(_MemRefType.PARAM, 0),
        "optimizer": now.get(_MemRefType.OPT, 0),
        "gradients (peak)": peak.get(_MemRefType.GRAD, 0),
        "step peak": peak.get("Total", 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    rows = {name: measure(args, *recipe) for name, recipe in RECIPES.items()}
    base = next(iter(rows.values()))
    columns = list(base)
    width = max(len(n) for n in rows)
    print(f"small Llama: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; MiB (× of the baseline)")
    print(f"{'recipe':<{width}}  " + "  ".join(f"{c:>20}" for c in columns))
    for name, row in rows.items():
        cells = [
            f"{row[c] / GIB:9.1f} ({row[c] / base[c]:5.2f}×)" if base[c] else f"{row[c] / GIB:9.1f}" for c in columns
        ]
        print(f"{name:<{width}}  " + "  ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
