"""What chunked loss and activation offloading save: one training step's peak memory, side by side.

    .venv/bin/python benchmarks/activation_memory.py [--vocab 32000] [--seq-len 512] [--micro-batch 2]

A tiny Llama (4 blocks, hidden 256) with a large vocabulary steps once on one CPU rank, through the
planner's memory trace (engine/workers/memtrace.py), which builds and runs the worker's own model, loss
and offloading: on real CPU tensors under PyTorch's MemTracker ("measured") and on fake tensors ("traced",
the planner's figure). Printed: the step's peak with the whole logits and with the loss in chunks, and with
the activations kept and offloaded (full activation checkpointing and none). Host copies of offloaded
activations are left out of the peak, as host memory is out of a GPU's. The whole fp32 logits of the
batch (micro_batch x seq_len x vocab x 4 bytes) are printed beside them for scale.
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
    args = ap.parse_args()

    import warnings

    warnings.filterwarnings("ignore")
    from rigpilot.engine.layout import Layout
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
        print(f"tiny Llama, vocab {args.vocab}, seq {args.seq_len}, micro-batch {args.micro_batch}, fp32, one rank")
        print(f"the whole fp32 logits: {logits / MIB:.1f} MiB")
        print(f"{'recipe':<44} {'measured MiB':>13} {'traced MiB':>11}")
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
            workload = {"model": str(folder), "task": "train", "method": "full", "precision": "fp32",
                        "seq_len": args.seq_len, "loss_chunks": chunks, "activation_offload": offload}  # fmt: skip
            par = {"micro_batch": args.micro_batch, "grad_accum": 1, "checkpointing": checkpointing}
            n = config.num_hidden_layers
            real = memtrace._trace_step(config, n, workload, par, layout, False, real=True)
            fake = memtrace._trace_step(config, n, workload, par, layout, False)
            print(f"{name:<44} {real.forward_backward / MIB:>13.1f} {fake.forward_backward / MIB:>11.1f}")


if __name__ == "__main__":
    main()
