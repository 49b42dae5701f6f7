"""Host memory of the ranks while a job loads its model: rank 0 reads and hands out, or every rank reads.

    .venv/bin/python benchmarks/worker_load_memory.py [--layers 8] [--hidden 1024] [--ranks 2] [--parallel fsdp]

Writes a Llama of the given size (random weights, safetensors) to a temporary
folder, then runs the same one-step fine-tuning job under torchrun twice:
`rank 0 loads` (the default: rank 0 reads the weights once, the other ranks
build a meta-device skeleton and receive their shards) and `every rank`
(RIGPILOT_LOAD_ON_EVERY_RANK=1: each rank reads the whole model, as before).
It polls every rank's resident memory every 20 ms and prints, per rank, the
peak while the model loads and is sharded (until the rank reports its training phase;
on a GPU machine this is the host-memory peak, as training state then lives on
the GPUs) and the peak over the whole run, and the sums over ranks side by
side with their ratio. The target: the loading sum grows with one model copy,
not one per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def write_model(folder: Path, layers: int, hidden: int) -> int:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # as checkpoints on the hub come; jobs train in fp32
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(REPO / "examples" / "models" / "tiny-llama").save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run(
    job_root: Path, name: str, model: Path, ranks: int, parallel: str, every_rank: bool
) -> tuple[list[int], list[int]]:
    job = job_root / name
    job.mkdir(parents=True)
    degrees = {"dp_shard": ranks} if parallel == "fsdp" else {"dp_replicate": ranks}
    spec = {
        "id": name, "kind": "train", "model": str(model), "parallelism": degrees,
        "train": {"dataset": [str(REPO / "examples" / "data" / "shakespeare.txt")], "method": "full",
                  "precision": "fp32", "seq_len": 64, "micro_batch": 1, "max_steps": 1, "eval_every": 0,
                  "checkpoint_every": 0},
    }  # fmt: skip
    (job / "job.json").write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               RIGPILOT_METRICS_DIR=str(job / "metrics"))  # fmt: skip
    if every_rank:
        env["RIGPILOT_LOAD_ON_EVERY_RANK"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", "rigpilot.engine.workers", str(job)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    launcher = psutil.Process(proc.pid)
    samples: dict[int, list[tuple[float, int]]] = {}  # pid -> (time, rss)
    ranks_of: dict[int, int] = {}
    while proc.poll() is None:
        try:
            for w in launcher.children(recursive=True):
                if "rigpilot.engine.workers" not in " ".join(w.cmdline()):
                    continue
                if w.pid not in ranks_of:
                    ranks_of[w.pid] = int(w.environ().get("RANK", len(ranks_of)))
                samples.setdefault(w.pid, []).append((time.time(), w.memory_info().rss))
        except psutil.Error:
            pass
        time.sleep(0.02)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    loading, whole = [], []
    for pid in sorted(samples, key=ranks_of.__getitem__):
        rank = ranks_of[pid]
        lines = (job / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        # Set-up ends where the rank reports the "training" phase (model loaded, sharded, optimizer built).
        trained = min(r["time"] for r in map(json.loads, lines) if r.get("phase") == "training")
        loading.append(max(rss for t, rss in samples[pid] if t < trained))
        whole.append(max(rss for _, rss in samples[pid]))
    return loading, whole


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--parallel", choices=["fsdp", "ddp"], default="fsdp")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        params = write_model(model, args.layers, args.hidden)
        print(f"model: {params / 1e6:.0f}M parameters, {params * 2 / 2**20:.0f} MiB in bf16 on disk, "
              f"{params * 4 / 2**20:.0f} MiB in fp32; {args.ranks} ranks, {args.parallel}")  # fmt: skip
        rank0, rank0_whole = run(Path(tmp), "rank0", model, args.ranks, args.parallel, every_rank=False)
        every, every_whole = run(Path(tmp), "every", model, args.ranks, args.parallel, every_rank=True)
    mib = 2**20
    print(f"{'peak RSS (MiB)':<16}{'loading: rank 0 loads':>22}{'every rank':>12}{'whole run: rank 0':>20}{'every':>8}")
    for r in range(len(rank0)):
        print(f"{'rank ' + str(r):<16}{rank0[r] / mib:>22.0f}{every[r] / mib:>12.0f}"
              f"{rank0_whole[r] / mib:>20.0f}{every_whole[r] / mib:>8.0f}")  # fmt: skip
    print(f"{'sum':<16}{sum(rank0) / mib:>22.0f}{sum(every) / mib:>12.0f}"
          f"{sum(rank0_whole) / mib:>20.0f}{sum(every_whole) / mib:>8.0f}")  # fmt: skip
    print(f"loading ratio (rank 0 loads / every rank): {sum(rank0) / sum(every):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
