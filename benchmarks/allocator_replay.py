"""The CUDA caching allocator's rounding and fragmentation, measured on CPU: a traced step replayed under its rules.

    python benchmarks/allocator_replay.py            # Llama-3.1-8B-shaped blocks, single GPU, LoRA and full
    python benchmarks/allocator_replay.py --layers 2 # fewer blocks: faster

The engine's own fake-tensor trace of a plan (engine/workers/memtrace.py: the same model classes, LoRA,
checkpointing and loss as a rank, on FakeTensorMode) is recorded as the sequence of every storage it
allocates and frees; `engine.planner.allocator.CachingAllocator` replays that sequence under the allocator's
rules (c10/cuda/CUDACachingAllocator.cpp: 512 B blocks, 2 MiB small and 20 MiB large segments, large ones
rounded to 2 MiB, best fit, splitting and merging). Printed per plan: the traced peak of allocated bytes,
the replay's peak of reserved bytes, and the memory model's prediction of both (tensor bytes, and tensor
bytes plus the allocator's reserve `MemoryModel.allocator_reserve` adds to its overhead, without the CUDA context).

Only single-GPU plans are modelled this way (the memory model keeps a share of what is allocated for the
others): replays of FSDP2 plans (8 ranks, 4 blocks) reserve 36-78% over their allocated peak, since each
unit's gathered parameters are requested between activations; but the real allocator keeps a pool per
stream and FSDP2 gathers on its own streams, which this replay does not model, so those figures are not
trusted as a measurement.

The model is built with the real widths (hidden 4096, MLP 14336, 32 heads of which 8 KV, vocabulary
128256) and fewer blocks: the traced peak is of those blocks, and the model is asked about the same shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner import memory
from rigpilot.engine.planner.allocator import CachingAllocator
from rigpilot.engine.planner.plan import LoraSettings, Workload
from rigpilot.engine.planner.search import SearchOptions, search

LLAMA_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
}  # fmt: skip


@dataclass
class Replay:
    name: str
    allocated: int  # traced peak
    reserved: int  # replayed peak
    predicted_tensors: float
    predicted_reserved: float

    @property
    def fragmentation(self) -> float:
        return self.reserved / self.allocated - 1.0

    @property
    def margin(self) -> float:
        """Predicted reserved over replayed reserved, minus one: negative means the model falls short."""
        return self.predicted_reserved / self.reserved - 1.0


def record(plan: dict[str, Any]) -> tuple[CachingAllocator, dict[str, Any]]:
    """Trace `plan` with memtrace, replaying every storage allocation and free through a CachingAllocator."""
    from rigpilot.engine.workers import memtrace

    alloc = CachingAllocator()
    base = memtrace._GpuPeak

    class Recording(base):  # type: ignore[misc, valid-type]
        def __init__(self, tracker: Any, host: frozenset[str]) -> None:
            super().__init__(tracker, host)
            inner = tracker._update_snap
            # What the tracker registered before this point (parameters, optimizer state), in its order.
            for winfo, _ in list(tracker._WINFO.values()):
                if winfo.mem_consumed > 0:
                    alloc.malloc(winfo, winfo.mem_consumed)

            def update(u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
                kind = str(getattr(u_type, "name", u_type))
                if kind == "ADD" and winfo.mem_consumed > 0:
                    alloc.malloc(winfo, winfo.mem_consumed)
                elif kind == "DEL":
                    alloc.free(winfo)
                elif kind == "SIZE":
                    # FSDP2 resizes an unsharded parameter's storage to 0 and back: a free and a new request.
                    alloc.free(winfo)
                    if winfo.mem_consumed > 0:
                        alloc.malloc(winfo, winfo.mem_consumed)
                inner(u_type, winfo, *args, **kwargs)

            tracker._update_snap = update

    memtrace._GpuPeak = Recording
    try:
        out = memtrace.trace_plan(plan)
    finally:
        memtrace._GpuPeak = base
    return alloc, out


def plans(folder: Path, seq: int) -> list[tuple[str, Any]]:
    spec = describe_model(str(folder))
    out = []
    lora = {"method": "lora", "lora": LoraSettings(rank=16)}
    for name, profile, work in (
        ("LoRA r16, batch 1, H100", "8x-h100-sxm", {**lora, "global_batch": 1}),
        ("LoRA r16, batch 2, H100", "8x-h100-sxm", {**lora, "global_batch": 2}),
        ("LoRA r16, batch 4, RTX 4090", "1x-rtx4090", {**lora, "global_batch": 4}),
        ("full, batch 1, H100", "8x-h100-sxm", {"method": "full", "global_batch": 1}),
    ):
        w = Workload(model=str(folder), task="train", seq_len=seq, **work)
        r = search(spec, load_profile(profile), w, gpus=[0], options=SearchOptions(suggest=False, offload="off"))
        if r.best is not None:
            out.append((name, r.best))
    return out


def run(layers: int, seq: int) -> list[Replay]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama-8b-shaped"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**LLAMA_8B, "num_hidden_layers": layers}))
        for name, plan in plans(folder, seq):
            alloc, traced = record(plan.to_dict())
            if not traced.get("ok"):
                print(f"{name}: not traced: {traced}")
                continue
            m = plan.peak_memory
            tensors = m.total - m.overhead
            # One GPU, no process group: the overhead is the CUDA context and the allocator's reserve.
            reserve = m.overhead - (memory.CUDA_CONTEXT_BYTES_LARGE if "H100" in name else memory.CUDA_CONTEXT_BYTES)
            label = f"{name} ({plan.parallelism.checkpointing} checkpointing, micro-batch {plan.parallelism.micro_batch})"
            rows.append(Replay(label, alloc.peak_allocated, alloc.peak_reserved, tensors, tensors + reserve))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    rows = run(args.layers, args.seq)
    gib = 1024**3
    print(f"{'plan':58} {'traced alloc':>12} {'replayed reserved':>17} {'fragm.':>7} {'model tensors':>13} {'model reserved':>14} {'margin':>7}")
    for r in rows:
        print(f"{r.name:58} {r.allocated / gib:>10.2f} G {r.reserved / gib:>15.2f} G {r.fragmentation:>+7.1%} "
              f"{r.predicted_tensors / gib:>11.2f} G {r.predicted_reserved / gib:>12.2f} G {r.margin:>+7.1%}")
    return 0 if all(r.margin >= 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
