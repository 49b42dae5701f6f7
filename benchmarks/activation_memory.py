"""What chunked loss and activation offloading save: one training step's peak memory, side by side.

    .venv/bin/python benchmarks/activation_memory.py [--vocab 32000] [--seq-len 512] [--micro-batch 2] [--precision bf16]

A tiny Llama (4 blocks, hidden 256) with a large vocabulary steps once on one CPU rank, through the
planner's memory trace (engine/workers/memtrace.py), which builds and runs the worker's own model, loss
and offloading: on real CPU tensors under PyTorch's MemTracker ("measured") and on fake tensors ("traced",
the planner's figure). Printed: the step's peak with the whole logits and with the loss in chunks, and with
the activations kept and offloaded (full activation checkpointing and none). Host copies of offloaded
activations are left out of the peak, as host memory is out of a GPU's. The whole fp32 logits of the
batch (micro_batch x seq_len x vocab x 4 bytes) are printed beside them for scale.

Beside them, the planner's formula (engine.planner.memory, what the search sizes plans with before any trace): its
total (less the CUDA context and allocator overhead, which a CPU step has not) holds every gradient beside the
activations, so it is above the step's peak; its total less the gradients is the step at its loss, which a whole
loss peaks at and a chunked one exceeds by the head's gradient (autograd's sum of the chunks' parts, made while
every activation is still saved).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--precision", default="fp32", help="fp32, or bf16 (mixed: autocast over fp32 weights)")
    args = ap.parse_args()

    import warnings

    warnings.filterwarnings("ignore")
    from rigpilot.engine.layout import Layout
    from rigpilot.engine.models import describe_model
    from rigpilot.engine.planner.memory import MemoryModel
    from rigpilot.engine.planner.model import model_facts
    from rigpilot.engine.planner.plan import Parallelism, Workload
    from rigpilot.engine.workers import memtrace

    config_json = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
        "intermediate_size": 688, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "vocab_size": args.vocab, "max_position_embeddings": max(args.seq_len, 256), "tie_word_embeddings": False,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-llama-big-vocab"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config_json))
        config = memtrace._load_config(str(folder), False)
        layout = Layout.from_dict({})
        logits = args.micro_batch * args.seq_len * args.vocab * 4
        print(f"tiny Llama, vocab {args.vocab}, seq {args.seq_len}, micro-batch {args.micro_batch}, {args.precision}, "
              "one rank")  # fmt: skip
        print(f"the whole fp32 logits: {logits / MIB:.1f} MiB")
        print(f"{'recipe':<44} {'measured MiB':>13} {'traced MiB':>11} {'formula MiB':>12} {'less grads':>11}")
        facts = model_facts(describe_model(str(folder)))
        cases = [
            ("whole loss", 1, False, "none"),
            (f"loss in {args.chunks} chunks", args.chunks, False, "none"),
            ("activations kept (no checkpointing)", 1, False, "none"),
            ("activations offloaded (no checkpointing)", 1, True, "none"),
            ("activations kept (full checkpointing)", 1, False, "full"),
            ("activations offloaded (full checkpointing)", 1, True, "full"),
            (f"offloaded + {args.chunks} chunks (full checkpointing)", args.chunks, True, "full"),
        ]
        for name, chunks, offload, checkpointing in cases:
            workload = {"model": str(folder), "task": "train", "method": "full", "precision": args.precision,
                        "seq_len": args.seq_len, "loss_chunks": chunks, "activation_offload": offload}  # fmt: skip
            par = {"micro_batch": args.micro_batch, "grad_accum": 1, "checkpointing": checkpointing}
            n = config.num_hidden_layers
            real = memtrace._trace_step(config, n, workload, par, layout, False, real=True)
            fake = memtrace._trace_step(config, n, workload, par, layout, False)
            w = Workload(model=str(folder), precision=args.precision, seq_len=args.seq_len, global_batch=args.micro_batch,
                         loss_chunks=chunks, activation_offload=offload)  # fmt: skip
            one = Parallelism(gpu_indices=[0], backend="single", micro_batch=args.micro_batch, checkpointing=checkpointing)
            f = MemoryModel(facts, w).train_stage(one, 0, None)
            formula = f.total - f.overhead
            print(f"{name:<44} {real.forward_backward / MIB:>13.1f} {fake.forward_backward / MIB:>11.1f} "
                  f"{formula / MIB:>12.1f} {(formula - f.gradients) / MIB:>11.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
