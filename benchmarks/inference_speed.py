"""Inference speed: Rigpilot's `infer` jobs (1 rank, PP2, TP2) beside transformers' generate(), in one run.

    .venv/bin/python benchmarks/inference_speed.py [--model small|tiny] [--prompts 16] [--batch 8]
                                                   [--new 32] [--repeats 3] [--layouts 1,pp2,tp2]

The model: a Llama with seeded random weights and the tokenizer of
examples/models/tiny-llama ("tiny": that example's own config, hidden 64;
"small": hidden 512, 8 layers), saved to a temporary folder; fp32, greedy.
The same prompts (lengths 1 to ~40 tokens, so every batch is left-padded),
in the same batches, go to

  generate   transformers' AutoModelForCausalLM.generate(), in a process of
             its own with --threads threads (default: every core), timed
             around the generate() calls only (the first included: a user's
             script pays it too);
  rigpilot   `python -m torch.distributed.run --standalone --nproc-per-node N
             -m rigpilot.engine.workers JOB_DIR` with the ranks' environment
             the service gives a simulated job (OMP_NUM_THREADS = threads / ranks).

On a shared machine a 2-thread process stalls whenever another process holds
one of the cores (OpenMP waits for its slowest thread): there, compare at
--threads 1 too.

alternately (generate, 1, pp2, tp2, generate, ...), --repeats rounds; every
figure is the median of the rounds with its spread (min-max), and the ratios
are given for the medians and for the best rounds (as timeit's minimum: on a
shared machine the best round is the one least disturbed).

For Rigpilot two figures: "reported", the job's tokens/s as the CLI and the
GUI show it (engine.jobs.metrics.summarize over the ranks' metric files),
and "true", measured from outside the worker: the tokens in
output/results.jsonl over the generation's wall time, from the moment the
last rank announced "generating" (no stage can run before every stage is
there) to the newest record any rank wrote. Every run's tokens are checked
against generate()'s, so a fast wrong answer cannot pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TINY_LLAMA = REPO / "examples" / "models" / "tiny-llama"
LAYOUTS = {"1": ({}, 1), "pp2": ({"pp": 2}, 2), "tp2": ({"tp": 2}, 2)}
WORDS = (
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: rough winds do shake "
    "the darling buds of May, and summer's lease hath all too short a date"
).split()


def make_prompts(n: int) -> list[str]:
    # Lengths 1, 4, 7, ... words (wrapping), so every batch mixes short and long prompts.
    return [" ".join(WORDS[(i * 5) % 7 : (i * 5) % 7 + 1 + (3 * i) % 28]) for i in range(n)]


def save_model(folder: Path, size: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    extra: dict[str, Any] = {"initializer_range": 0.3}
    if size == "small":
        extra.update(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=4, initializer_range=0.05)  # fmt: skip
    config = AutoConfig.from_pretrained(TINY_LLAMA, **extra)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_LLAMA).save_pretrained(folder)
    return folder


GENERATE = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompts, batch, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(folder)
tok.padding_side = "left"
out, seconds = [], 0.0
with torch.no_grad():
    for i in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True)
        gen = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
        seconds += time.perf_counter() - t0
        for row in gen[:, enc["input_ids"].shape[1]:].tolist():
            out.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
print(json.dumps({"tokens": out, "seconds": seconds}))
"""


def run_generate(folder: Path, prompts: list[str], batch: int, new: int, threads: int) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE, str(folder), json.dumps(prompts), str(batch), str(new)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    count = sum(len(t) for t in res["tokens"])
    return {"tokens": res["tokens"], "true": count / res["seconds"], "reported": None}


def run_rigpilot(
    folder: Path, prompts: list[str], batch: int, new: int, layout: str, scratch: Path, threads: int
) -> dict[str, Any]:
    from rigpilot.engine.jobs.metrics import read_records, summarize
    from rigpilot.engine.jobspec.spec import JobSpec

    parallelism, ranks = LAYOUTS[layout]
    job_dir = Path(tempfile.mkdtemp(prefix=f"infer-{layout}-", dir=scratch))
    spec = {
        "id": job_dir.name, "kind": "infer", "model": str(folder), "parallelism": parallelism,
        "infer": {"prompts": prompts, "max_new_tokens": new, "batch_size": batch, "precision": "fp32"},
    }  # fmt: skip
    JobSpec.from_dict(spec).write(job_dir)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES="",
               RIGPILOT_METRICS_DIR=str(job_dir / "metrics"))  # fmt: skip
    env["OMP_NUM_THREADS"] = str(max(1, threads // ranks))  # as engine.launch.torchrun shares the cores
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", "rigpilot.engine.workers", str(job_dir)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} job failed:\n{proc.stderr[-3000:]}")
    results = [json.loads(line) for line in (job_dir / "output" / "results.jsonl").read_text().splitlines()]
    tokens = [r["tokens"] for r in results]
    records, _, _ = read_records(job_dir / "metrics", {}, max_bytes=64 << 20)
    start = max(r["time"] for r in records if r.get("kind") == "status" and r.get("phase") == "generating")
    end = max(r["time"] for r in records if r.get("kind") != "status")
    summary, _ = summarize(job_dir / "metrics")
    count = sum(len(t) for t in tokens)
    return {"tokens": tokens, "true": count / (end - start), "reported": summary.tokens_per_s}


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:8.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("small", "tiny"), default="small")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=32, help="max new tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default="1,pp2,tp2")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="cores for generate(); Rigpilot's ranks share them (default: every core, as the service)")
    args = ap.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    for x in layouts:
        if x not in LAYOUTS:
            print(f"unknown layout {x!r}: use {', '.join(LAYOUTS)}", file=sys.stderr)
            return 2
    prompts = make_prompts(args.prompts)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rpbench-infer") as tmp:
        scratch = Path(tmp)
        folder = save_model(scratch / "model", args.model)
        rows: dict[str, dict[str, list[float]]] = {k: {"true": [], "reported": []} for k in ["generate", *layouts]}
        expected: list[list[int]] | None = None
        mismatched: set[str] = set()
        for _ in range(args.repeats):
            for name in ["generate", *layouts]:
                t0 = time.perf_counter()
                if name == "generate":
                    res = run_generate(folder, prompts, args.batch, args.new, args.threads)
                    expected = res["tokens"]
                else:
                    res = run_rigpilot(folder, prompts, args.batch, args.new, name, scratch, args.threads)
                if res["tokens"] != expected:
                    mismatched.add(name)
                rows[name]["true"].append(res["true"])
                if res["reported"] is not None:
                    rows[name]["reported"].append(res["reported"])
                print(f"  {name:8s} {res['true']:8.1f} tokens/s ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    base = statistics.median(rows["generate"]["true"])
    print(f"model {args.model}, fp32, greedy, {args.prompts} prompts, batch {args.batch}, {args.new} new tokens, "
          f"{args.threads} threads, {args.repeats} rounds; load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")  # fmt: skip
    print(f"threads: generate() {args.threads} in one process; Rigpilot {args.threads} over its ranks "
          f"(OMP_NUM_THREADS {args.threads} // ranks each): every run has the same {args.threads} cores")  # fmt: skip
    best = max(rows["generate"]["true"])
    print(f"{'run':10s} {'true tokens/s (min-max)':>26s} {'vs generate()':>14s} {'best vs best':>13s} "
          f"{'reported (min-max)':>24s} {'reported/true':>14s}  tokens")  # fmt: skip
    for name, r in rows.items():
        true = statistics.median(r["true"])
        rep = statistics.median(r["reported"]) if r["reported"] else None
        over = f"{rep / true:14.2f}" if rep else f"{'-':>14s}"
        same = "differ!" if name in mismatched else "= generate()"
        print(f"{name:10s} {spread(r['true']):>26s} {true / base:13.2f}x {max(r['true']) / best:12.2f}x "
              f"{spread(r['reported']):>24s} {over}  {same}")  # fmt: skip
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
