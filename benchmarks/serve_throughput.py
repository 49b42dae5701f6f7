"""Serving throughput: Rigpilot's server (kind "serve") beside a naive one-request-at-a-time generate() loop and
batched generate(), at 1, 4 and 16 concurrent clients, in one run.

    .venv/bin/python benchmarks/serve_throughput.py [--model tiny|small] [--prompts 16] [--new 32]
                                                   [--clients 1,4,16] [--threads 2] [--split tp|pp]

The model: a Llama with seeded random weights (benchmarks/inference_speed.py's), fp32, greedy. The workload:
--prompts prompts, served to C closed-loop clients (client k sends prompts k, k+C, ... one after another).

  server    `python -m rigpilot.engine.workers JOB` serving on loopback (continuous batching), driven by the
            official openai client from C threads, streaming; time to first token is measured per request
            at the client, from sending to the first text; tokens from the usage counts.
  naive     generate() on one prompt at a time, in a process of its own: what a server without batching does.
            Its time to first token at C clients: the C requests of a wave arrive together and wait for the
            ones before them.
  batched   generate() on each wave of C prompts as one left-padded batch: the wave waits for its longest
            member, and nothing joins it meanwhile.

Each figure is tokens/s over the whole workload's wall time and the mean time to first token; ratios are the
server's over the other two. The server's greedy text of every prompt is checked against the naive loop's.
Both processes get --threads threads (OMP_NUM_THREADS); on a shared machine, figures move with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from inference_speed import make_prompts, save_model  # noqa: E402

GENERATE = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList
folder, prompts, new, waves = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(folder)
tok.padding_side = "left"

class FirstToken(LogitsProcessor):
    def __init__(self): self.at = None
    def __call__(self, ids, scores):
        if self.at is None: self.at = time.perf_counter()
        return scores

def run(batch):
    first = FirstToken()
    enc = tok(batch, return_tensors="pt", padding=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id,
                             logits_processor=LogitsProcessorList([first]))
    took = time.perf_counter() - t0
    rows = []
    for row in gen[:, enc["input_ids"].shape[1]:].tolist():
        rows.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return rows, took, first.at - t0

run(prompts[:1])  # warm-up, as the server has served nothing either
out = {"naive": [], "batched": {}}
for p in prompts:
    rows, took, ttft = run([p])
    out["naive"].append({"tokens": len(rows[0]), "seconds": took, "ttft": ttft,
                         "text": tok.decode(rows[0], skip_special_tokens=True)})
for c in waves:
    runs = []
    for i in range(0, len(prompts), c):
        rows, took, ttft = run(prompts[i : i + c])
        runs.append({"tokens": sum(len(r) for r in rows), "seconds": took, "ttft": ttft, "size": len(rows)})
    out["batched"][str(c)] = runs
print(json.dumps(out))
"""


def reference(folder: Path, prompts: list[str], new: int, clients: list[int], threads: int) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE, str(folder), json.dumps(prompts), str(new), json.dumps(clients)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def naive_at(naive: list[dict[str, Any]], c: int) -> tuple[float, float]:
    """tokens/s and mean time to first token of the one-at-a-time loop, serving waves of c requests."""
    seconds = sum(r["seconds"] for r in naive)
    waits = []
    for i in range(0, len(naive), c):
        before = 0.0
        for r in naive[i : i + c]:
            waits.append(before + r["ttft"])
            before += r["seconds"]
    return sum(r["tokens"] for r in naive) / seconds, sum(waits) / len(waits)


def batched_at(runs: list[dict[str, Any]]) -> tuple[float, float]:
    seconds = sum(r["seconds"] for r in runs)
    ttft = sum(r["ttft"] * r["size"] for r in runs) / sum(r["size"] for r in runs)
    return sum(r["tokens"] for r in runs) / seconds, ttft


def start_server(folder: Path, root: Path, threads: int, max_batch: int, split: str | None) -> tuple[subprocess.Popen, str]:
    """The server on one rank, or on two split by `split` ("tp" or "pp"), its ranks sharing the threads."""
    from rigpilot.engine.jobspec.spec import JobSpec

    job = root / "serve"
    ranks = 2 if split else 1
    JobSpec.from_dict({"id": "serve", "kind": "serve", "model": str(folder), "gpus": list(range(ranks)),
                       "parallelism": {split: 2} if split else {},
                       "serve": {"precision": "fp32", "max_batch": max_batch}}).write(job)  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(max(1, threads // ranks)))  # fmt: skip
    env["RIGPILOT_METRICS_DIR"] = str(job / "metrics")
    log = (root / "serve.log").open("w")
    cmd = [sys.executable, "-m", "rigpilot.engine.workers", str(job)]
    if split:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *cmd[1:]]
    # A session of its own: the end of the run stops torchrun and every rank together.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    metrics = job / "metrics" / "rank0.jsonl"
    while proc.poll() is None:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("phase") == "serving":
                    return proc, rec["url"]
        time.sleep(0.2)
    raise SystemExit(f"the server exited {proc.returncode}: see {root / 'serve.log'}")


def drive(url: str, prompts: list[str], new: int, c: int) -> dict[str, Any]:
    """C closed-loop clients over the prompts; tokens/s, mean time to first token, each prompt's text."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="loopback", max_retries=0, timeout=600)
    texts: list[str] = [""] * len(prompts)
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def one_client(k: int) -> None:
        for i in range(k, len(prompts), c):
            t0 = time.perf_counter()
            first = None
            stream = client.completions.create(model="serve-bench", prompt=prompts[i], max_tokens=new, temperature=0,
                                               stream=True, stream_options={"include_usage": True})  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text and first is None:
                    first = time.perf_counter() - t0
                if chunk.choices:
                    texts[i] += chunk.choices[0].text
                if chunk.usage is not None:
                    with lock:
                        tokens[0] += chunk.usage.completion_tokens
            with lock:
                ttfts.append(first if first is not None else time.perf_counter() - t0)

    t0 = time.perf_counter()
    workers = [threading.Thread(target=one_client, args=(k,)) for k in range(c)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens[0] / wall, "ttft": sum(ttfts) / len(ttfts), "texts": texts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("small", "tiny"), default="tiny")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--split", choices=("tp", "pp"), help="serve on two ranks split this way (they share --threads)")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    prompts = make_prompts(args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = save_model(root / "model", args.model)
        (root / "model" / "config.json").exists()
        ref = reference(folder, prompts, args.new, clients, args.threads)
        # The served name is the job's model folder's name.
        renamed = folder.rename(root / "serve-bench")
        proc, url = start_server(renamed, root, args.threads, max(clients), args.split)
        try:
            drive(url, prompts[:1], args.new, 1)  # warm-up
            rows = []
            same = True
            for c in clients:
                got = drive(url, prompts, args.new, c)
                same &= got["texts"] == [r["text"] for r in ref["naive"]]
                rows.append((c, got, naive_at(ref["naive"], c), batched_at(ref["batched"][str(c)])))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    layout = f"server on 2 ranks split by {args.split.upper()}" if args.split else "server on 1 rank"
    print(f"model {args.model}, {layout}, {args.prompts} prompts, up to {args.new} new tokens, fp32, greedy, "
          f"{args.threads} threads; tokens/s (higher is better), mean time to first token in ms (lower is better)")  # fmt: skip
    head = f"{'clients':>7} | {'server':>8} {'naive':>8} {'batched':>8} | {'×naive':>6} {'×batched':>8} | "
    head += f"{'TTFT server':>11} {'naive':>8} {'batched':>8}"
    print(head)
    print("-" * len(head))
    for c, got, (n_tps, n_ttft), (b_tps, b_ttft) in rows:
        print(f"{c:>7} | {got['tokens_per_s']:>8.1f} {n_tps:>8.1f} {b_tps:>8.1f} | {got['tokens_per_s'] / n_tps:>6.2f} "
              f"{got['tokens_per_s'] / b_tps:>8.2f} | {got['ttft'] * 1e3:>11.0f} {n_ttft * 1e3:>8.0f} "
              f"{b_ttft * 1e3:>8.0f}")  # fmt: skip
    print(f"greedy text of every prompt equal to generate()'s: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
