"""Multi-node cost: one training job over two engines on loopback against the same ranks on one node.

    .venv/bin/python benchmarks/multinode.py [--steps 40] [--warmup 5] [--seq 128] [--micro-batch 8]

Two throwaway engine services (their own XDG folders, each a simulated
2×RTX 3090, the second listening on loopback TCP with its token) run the tiny
Llama of examples/models/tiny-llama, data parallel over 4 CPU ranks: 2 on each
engine, one `torchrun --nnodes 2` per engine meeting at the head's c10d
endpoint. The same 4 ranks on one node: on a machine with 4 or more CPUs, one
engine on a simulated 4×RTX 4090 with --max-cpu-ranks 4; on fewer (an engine
caps its CPU ranks at the CPU count), a plain `torchrun --standalone
--nproc-per-node 4` of the same job.json. Both figures are steady steps/s after
--warmup steps, the slowest rank's (engine_overhead.step_rate); the ratio
two-engine / one-node is what spanning engines costs (on loopback: the
rendezvous, the head's pulling of the member's metrics and logs, and 4 ranks
sharing this machine's cores in either case).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_common import REPO, _kill_jobs
from engine_overhead import run_plain, step_rate

TINY_LLAMA = REPO / "examples" / "models" / "tiny-llama" / "config.json"
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(root: Path, profile: str, *extra: str) -> tuple[subprocess.Popen, dict[str, str]]:
    (root / "r").mkdir(mode=0o700, parents=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(root / "r"), "XDG_STATE_HOME": str(root / "state"),
           "XDG_CONFIG_HOME": str(root / "config"), "RIGPILOT_SIMULATE": profile}  # fmt: skip
    log = (root / "engine.out").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "rigpilot.engine.service", *extra], cwd=REPO, env=env,
                            stdout=log, stderr=log)  # fmt: skip
    deadline = time.monotonic() + 30
    while "engine service ready" not in (root / "engine.out").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((root / "engine.out").read_text())
        time.sleep(0.05)
    return proc, env


def _client(env: dict[str, str]):
    from rigpilot.engine.api.client import EngineClient

    for k in ("XDG_RUNTIME_DIR", "XDG_STATE_HOME", "XDG_CONFIG_HOME"):
        os.environ[k] = env[k]
    return EngineClient(autostart=False, timeout=60)


def _run(env: dict[str, str], spec: dict[str, Any], warmup: int, **submit: Any) -> tuple[dict[str, float], Path]:
    with _client(env) as c:
        job = c.request("submit", spec=spec, cwd=str(REPO), **submit)["job"]
        deadline = time.monotonic() + 600
        while (done := c.request("job", job=job["id"])["job"])["state"] not in ("completed", "failed", "cancelled"):
            if time.monotonic() > deadline:
                raise RuntimeError("the job did not end within 10 minutes")
            time.sleep(0.5)
        if done["state"] != "completed":
            raise RuntimeError(f"job {done['state']}: {done['exit_reason']} {done['last_log']}")
        time.sleep(1.5)  # the head's last pull of the member's records
        records, _ = c.all_metrics(job["id"])
    return step_rate(records, warmup), Path(done["job_dir"]) / "job.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs, alternating, so drift favours neither")
    args = ap.parse_args()
    spec = {
        "kind": "train", "name": "multinode-bench", "model": str(TINY_LLAMA), "gpus": [0, 1],
        "parallelism": {"dp_replicate": 4}, "env": {"HF_HUB_OFFLINE": "1"},
        "train": {"dataset": [str(SHAKESPEARE)], "method": "scratch", "max_steps": args.steps, "seq_len": args.seq,
                  "micro_batch": args.micro_batch, "eval_every": 0, "checkpoint_every": 0, "warmup_steps": 0,
                  "precision": "fp32"},
    }  # fmt: skip
    cpus = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="rpbench-nodes") as tmp:
        root = Path(tmp)
        port = _free_port()
        procs = []
        try:
            head, head_env = _start(root / "head", "2x-rtx3090-nvlink", "--max-cpu-ranks", "2")
            box2, _ = _start(root / "box2", "2x-rtx3090-nvlink", "--max-cpu-ranks", "2", "--tcp", f"127.0.0.1:{port}")
            procs += [head, box2]
            token = (root / "box2" / "config" / "rigpilot" / "engine-token").read_text().strip()
            with _client(head_env) as c:
                c.request("node_add", name="box2", address=f"127.0.0.1:{port}", token=token)
            if cpus >= 4:
                one_proc, one_env = _start(root / "one", "4x-rtx4090", "--max-cpu-ranks", "4")
                procs.append(one_proc)
                how = "one engine, 4 CPU ranks"
            else:
                how = f"plain torchrun --standalone, 4 ranks (one engine caps CPU ranks at this machine's {cpus} CPUs)"
            twos, ones = [], []
            for i in range(args.repeats):
                for which in ("two", "one") if i % 2 == 0 else ("one", "two"):
                    if which == "two":
                        two, job_json = _run(head_env, spec, args.warmup, nodes=["local", "box2"])
                        twos.append(two["steps_per_s"])
                    elif cpus >= 4:
                        ones.append(_run(one_env, {**spec, "gpus": [0, 1, 2, 3]}, args.warmup)[0]["steps_per_s"])
                    else:
                        plain_json = root / "plain.json"
                        if not plain_json.exists():
                            if not twos:
                                _, job_json = _run(head_env, spec, args.warmup, nodes=["local", "box2"])
                            plain_json.write_text(json.dumps(json.loads(job_json.read_text()), indent=2))
                        ones.append(run_plain(plain_json, 4, args.warmup)["steps_per_s"])
        finally:
            for p in procs:
                p.terminate()
                p.wait(30)
            _kill_jobs(root)
    two_s, one_s = statistics.median(twos), statistics.median(ones)
    print(f"two engines (2 nodes x 2 ranks, loopback): {two_s:.2f} steps/s (median of {', '.join(f'{x:.2f}' for x in twos)})")
    print(f"one node ({how}): {one_s:.2f} steps/s (median of {', '.join(f'{x:.2f}' for x in ones)})")
    print(f"ratio two engines / one node: {two_s / one_s:.3f}")


if __name__ == "__main__":
    main()
