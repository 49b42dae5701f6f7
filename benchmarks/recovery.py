"""Time from a rank's death to the job training again, with automatic recovery, in phases.

    .venv/bin/python benchmarks/recovery.py [--ranks 2] [--steps 60] [--every 5]

Trains the tiny Llama on CPU ranks under a scratch engine service (its default grace periods),
kills one rank's worker with SIGKILL right after the first checkpoint is complete, and follows the
automatic restart. Phases, each from the end of the one before:
    detect + teardown   kill -9 → the engine queued the restart (torchrun noticed, the other ranks
                        stopped, the launcher exited, the GPUs' health was asked)
    relaunch            → torchrun started again
    torchrun up         → torchrun started the ranks (its own imports, the rendezvous)
    ranks start         → the first record of the new run (the ranks' Python and torch imported, data read)
    load checkpoint     → the ranks say they resumed (model built, checkpoint loaded)
    first step          → the first training step of the new run reported
and when the engine's record said "running" again (it does once the new run reports a step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from engine_common import SHAKESPEARE, TINY_LLAMA, scratch_engine, wait


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5, help="checkpoint interval in steps")
    args = ap.parse_args()

    from rigpilot.engine.api.client import EngineClient

    train = {
        "dataset": [str(SHAKESPEARE)], "method": "scratch", "precision": "fp32", "seq_len": 32, "micro_batch": 2,
        "max_steps": args.steps, "eval_every": 0, "checkpoint_every": args.every, "warmup_steps": 2,
    }  # fmt: skip
    spec = {"kind": "train", "model": str(TINY_LLAMA), "gpus": list(range(args.ranks)), "env": {"HF_HUB_OFFLINE": "1"},
            "train": train}  # fmt: skip
    with scratch_engine(), EngineClient(autostart=False, timeout=60) as c:
        job = c.request("submit", spec=spec)["job"]
        job_dir = Path(job["job_dir"])
        wait((job_dir / "checkpoints" / f"step-{args.every}" / "COMPLETE").exists, 300, "the first checkpoint")
        rank_file = job_dir / "ranks" / f"rank{args.ranks - 1}.json"
        child = json.loads(rank_file.read_text())["child_pid"]
        os.kill(child, signal.SIGKILL)
        died = time.time()

        again = wait(lambda: (j := c.request("job", job=job["id"])["job"])["restarts"] and j, 120, "the restart", 0.02)

        wait(lambda: (j := c.request("job", job=job["id"])["job"])["run"] == 2 and j["state"] == "running", 300,
             "run 2 to be running", 0.02)  # fmt: skip
        shown_running = time.time()

        def run2(pred):
            return [r for r in c.all_metrics(job["id"])[0] if r.get("run") == 2 and pred(r)]

        first_step = wait(lambda: run2(lambda r: r.get("kind") is None and r.get("loss") is not None), 300,
                          "the first step of run 2", 0.05)[0]  # fmt: skip
        started = c.request("job", job=job["id"])["job"]["started"]
        # The rank wrappers of the new run record when torchrun started them (after its own imports and the
        # rendezvous): the share of start-up that torchrun's in-place --max-restarts would not pay again.
        ranks_up = min(json.loads(f.read_text())["started"] for f in (job_dir / "ranks").glob("rank*.json"))
        records = run2(lambda r: True)
        first_record = min(r["time"] for r in records)
        resumed = min((r["time"] for r in records if r.get("kind") == "note" and "resumed from" in str(r.get("message"))),
                      default=None)  # fmt: skip
        restart = again["restarts"][0]
        marks = [
            ("detect + teardown", restart["time"]), ("relaunch", started), ("torchrun up", ranks_up), ("ranks start", first_record),
            ("load checkpoint", resumed), ("first step", first_step["time"]),
        ]  # fmt: skip
        print(f"recovery of a {args.ranks}-rank tiny-Llama training job (CPU ranks), rank {args.ranks - 1} killed "
              f"by SIGKILL; resumed from step {restart['from_step']}")  # fmt: skip
        print(f"  cause: {restart['cause']}")
        before = died
        for name, t in marks:
            if t is None:
                print(f"  {name:<18} (not reported)")
                continue
            print(f"  {name:<18} {t - before:7.2f} s   (at {t - died:6.2f} s)")
            before = t
        print(f"death → first step after restart: {first_step['time'] - died:.2f} s "
              f"(the engine showed the job running again at {shown_running - died:.2f} s)")  # fmt: skip
        c.request("cancel", job=job["id"])


if __name__ == "__main__":
    main()
