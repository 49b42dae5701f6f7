"""A training job filling a small disk: seconds from its failed checkpoint write to the failed job, and its resume.

    sudo .venv/bin/python benchmarks/disk_full.py [--ranks 2] [--steps 40] [--every 4] [--disk 64m]

Mounts a tmpfs (root only) as a scratch engine's whole state folder (jobs, database, logs), trains the
tiny Llama on CPU ranks, and once its first checkpoint is complete fills the disk but for half a
checkpoint. The next checkpoint cannot be written; printed:
    failed write → job failed   the error record's time of the failed write (taken on the rank) to the
                                engine's record of the job ending failed
    the job's one line, and the one line a new submission gets while the disk is full
then the filler goes, the job is resumed by hand, and its per-step losses (every step, those after the
resume included) are compared with an uninterrupted run's of the same seed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine_common import REPO, SHAKESPEARE, TINY_LLAMA, _kill_jobs, wait


def losses(c, job_id: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in c.all_metrics(job_id)[0]:
        if r.get("rank") == 0 and r.get("kind") is None and r.get("loss") is not None:
            out[r["step"]] = r["loss"]  # the latest run's, where a resume trained a step again
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=4, help="checkpoint interval in steps")
    ap.add_argument("--disk", default="64m", help="size of the tmpfs the engine's state folder lives on")
    args = ap.parse_args()

    from rigpilot.engine.api.client import EngineClient, EngineError
    from rigpilot.engine.diskspace import free_bytes

    train = {
        "dataset": [str(SHAKESPEARE)], "method": "scratch", "precision": "fp32", "seq_len": 32, "micro_batch": 2,
        "grad_accum": 2, "max_steps": args.steps, "learning_rate": 1e-2, "warmup_steps": 2, "eval_every": 0,
        "checkpoint_every": args.every, "seed": 1234,
    }  # fmt: skip
    spec = {"kind": "train", "model": str(TINY_LLAMA), "env": {"HF_HUB_OFFLINE": "1"}, "train": train}
    with tempfile.TemporaryDirectory(prefix="rpdisk") as tmp:
        root = Path(tmp)
        state = root / "state"
        state.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.disk},mode=0700", "tmpfs", str(state)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode:
            raise SystemExit(f"mounting a tmpfs needs root: {r.stderr.strip()}")
        (root / "r").mkdir(mode=0o700)
        os.environ.update(XDG_RUNTIME_DIR=str(root / "r"), XDG_STATE_HOME=str(state),
                          XDG_CONFIG_HOME=str(root / "config"), RIGPILOT_SIMULATE="4x-rtx4090")  # fmt: skip
        log = (root / "engine.log").open("ab")
        engine = subprocess.Popen([sys.executable, "-m", "rigpilot.engine.service"], cwd=REPO, stdout=log, stderr=log)
        try:
            c = wait(lambda: _connect(EngineClient), 30, "the engine to start", 0.1)
            gpus = list(range(args.ranks))
            reference = c.request("submit", spec={**spec, "gpus": gpus, "name": "uninterrupted"})["job"]
            wait(lambda: c.request("job", job=reference["id"])["job"]["state"] == "completed", 300, "the reference run")

            job = c.request("submit", spec={**spec, "gpus": gpus, "name": "disk-full", "max_restarts": 0})["job"]
            first = Path(job["job_dir"]) / "checkpoints" / f"step-{args.every}"
            wait((first / "COMPLETE").exists, 300, "the first checkpoint")
            size = sum(f.stat().st_size for f in first.iterdir())
            filler = state / "filler"
            with open(filler, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, (free_bytes(state) or 0) - size // 2)
            failed = wait(lambda: (j := c.request("job", job=job["id"])["job"])["state"] == "failed" and j, 120,
                          "the job to fail")  # fmt: skip
            seconds = failed["ended"] - failed["error"]["failed_at"]
            print(f"checkpoint size            {size / 2**20:.2f} MiB; free when it was written: {size // 2 / 2**20:.2f} MiB")
            print(f"failed write → job failed  {seconds:.2f} s")
            print(f"the job's line             {failed['exit_reason']}")
            try:
                c.request("submit", spec={**spec, "gpus": gpus})
                print("a new submission           accepted (unexpected)")
            except EngineError as e:
                print(f"a new submission           refused ({e.code}): {e}")
            filler.unlink()
            t0 = time.monotonic()
            again = c.request("resume", job=job["id"])["job"]
            done = wait(lambda: (j := c.request("job", job=job["id"])["job"])["state"] in ("completed", "failed") and j,
                        300, "the resumed run")  # fmt: skip
            print(f"resumed from               {again['resumes_from']['name']}; {done['state']} in {time.monotonic() - t0:.1f} s")
            mine, theirs = losses(c, job["id"]), losses(c, reference["id"])
            after = [s for s in sorted(mine) if s > again["resumes_from"]["step"]]
            worst = max((abs(mine[s] - theirs[s]) for s in after), default=float("nan"))
            print(f"losses after the resume    {len(after)} steps, largest difference from the uninterrupted run "
                  f"{worst:.3g}; every step equal: {mine == theirs}")  # fmt: skip
            c.close()
        finally:
            engine.terminate()
            engine.wait(30)
            _kill_jobs(root)
            subprocess.run(["umount", "-l", str(state)], check=False)


def _connect(client_class):
    try:
        c = client_class(autostart=False, timeout=60)
        c.connect()
        return c
    except Exception:
        return None


if __name__ == "__main__":
    main()
