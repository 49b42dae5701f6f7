"""Scaling studies: the same training workload on 1, 2, 4 … GPUs, measured against linear and against the plan.

A study is an engine feature (socket `scaling_start`, `scaling_study`, `scaling_studies`), so the CLI
(`rigpilot scaling`) and the GUI ("How does this scale?") run the same code and read the same table.
Starting one plans every point with the engine's own planner (the search `rigpilot plan` runs, for the
first n GPUs), then submits one ordinary training job per point through the supervisor with that plan:
the plan the engine would run is the plan that runs, so "measured / predicted" compares like with like.
Every point shares GPU 0, so the queue runs them one after another. The jobs are ordinary jobs, tagged
with the study's id (`JobRecord.study`); the study file (`<state dir>/scaling/<id>.json`) keeps what was
asked and predicted, and measurements are read from the jobs' own metric records whenever it is shown.

Every point trains on the same global batch (sequences per optimizer step) at the same sequence length,
precision and method; the micro-batch and accumulation are each point's plan's, because the plan's speed
was computed for them. Throughput skips the first `warmup` steps (start-up, allocator and gloo warm-up):
tokens/s = the tokens of the measured steps / their summed step time, where a step's tokens are the sum
over ranks of (tokens_per_s × step_time) (each rank reports its share, engine.report) and a step's time
is the slowest rank's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeGuard

from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import is_given_file
from rigpilot.engine.jobs.scaling_table import check_counts
from rigpilot.engine.jobs.submission import default_seq_len
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS
from rigpilot.engine.schema import TERMINAL_STATES, UNSUCCESSFUL_STATES

SCHEMA = "rigpilot.scaling/1"
DEFAULT_STEPS = 10
DEFAULT_WARMUP = 2
DEFAULT_GLOBAL_BATCH = 8
NOISY = 0.25  # step times spread wider than this (std/mean) make a point's throughput a guess
TERMINAL = TERMINAL_STATES
_TRAIN = TRAIN_SETTINGS  # the study's defaults are a training job's
# -- input --------------------------------------------------------------------------------------------------


def settings_of_job(settings: dict[str, Any] | None) -> dict[str, Any]:
    """The study settings that repeat a training job (its `job.json`): model, data and the global batch."""
    if not settings or settings.get("kind") != "train" or not settings.get("model"):
        raise UserError("a scaling study repeats a training job with a model; this job is not one")
    t = settings.get("train") or {}
    par = settings.get("parallelism") or {}
    dp = int(par.get("dp_replicate") or 1) * int(par.get("dp_shard") or 1)
    return {
        "model": settings["model"], "trust_remote_code": bool(settings.get("trust_remote_code")),
        "dataset": list(t.get("dataset") or []), "method": t.get("method") or _TRAIN["method"].default,
        "precision": t.get("precision") or _TRAIN["precision"].default,
        "seq_len": int(t.get("seq_len") or _TRAIN["seq_len"].default),
        "global_batch": int(t.get("micro_batch") or 1) * int(t.get("grad_accum") or 1) * max(dp, 1),
    }  # fmt: skip


def workload_of(s: dict[str, Any]) -> dict[str, Any]:
    """The planner's Workload for the study's settings (training from scratch costs what a full fine-tune does)."""
    method = "full" if s["method"] == "scratch" else s["method"]
    return {"task": "train", "method": method, "precision": s["precision"], "seq_len": s["seq_len"],
            "global_batch": s["global_batch"]}  # fmt: skip


def point_spec(s: dict[str, Any], study_id: str, n: int) -> dict[str, Any]:
    """The training job of one point: the study's settings on GPUs 0 … n-1, no restarts, no checkpoints."""
    return {
        "kind": "train", "model": s["model"], "gpus": list(range(n)), "trust_remote_code": s["trust_remote_code"],
        "name": f"scaling {study_id} · {n} GPU{'s' * (n != 1)}", "max_restarts": 0,
        "train": {
            "dataset": s["dataset"], "method": s["method"], "precision": s["precision"], "seq_len": s["seq_len"],
            "max_steps": s["steps"], "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0,
        },
    }  # fmt: skip


# -- measuring ----------------------------------------------------------------------------------------------


def measure(records: list[dict[str, Any]], warmup: int) -> dict[str, Any] | None:
    """Throughput over the steps after the first `warmup`, from training step records; None before any."""
    steps: dict[int, dict[int, tuple[float, float]]] = {}
    for r in records:
        step, tps, dt = r.get("step"), r.get("tokens_per_s"), r.get("step_time")
        if r.get("kind") is not None or not isinstance(step, int) or not _positive(tps) or not _positive(dt):
            continue
        steps.setdefault(step, {})[int(r.get("rank") or 0)] = (float(tps), float(dt))
    measured = [s for s in sorted(steps) if s > warmup]
    if not measured:
        return None
    times = [max(dt for _, dt in steps[s].values()) for s in measured]
    seconds = sum(times)
    tokens = sum(tps * dt for s in measured for tps, dt in steps[s].values())
    mean = seconds / len(times)
    spread = math.sqrt(sum((t - mean) ** 2 for t in times) / len(times)) / mean
    return {
        "steps": len(measured), "first_step": measured[0], "last_step": measured[-1], "seconds": seconds,
        "tokens": tokens, "tokens_per_s": tokens / seconds, "steps_per_s": len(measured) / seconds,
        "step_time_spread": spread,  # standard deviation of the step times over their mean
    }  # fmt: skip


def _positive(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def table(study: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per point: measured, speed-up against the smallest point, efficiency against linear, predicted."""
    points = study.get("points") or []
    base = points[0] if points else {}
    base_n = base.get("gpus") or 1
    base_tps = (base.get("measured") or {}).get("tokens_per_s")
    base_pred = (base.get("predicted") or {}).get("tokens_per_s")
    rows = []
    for p in points:
        m, pred, n = p.get("measured") or {}, p.get("predicted") or {}, p["gpus"]
        tps, ptps = m.get("tokens_per_s"), pred.get("tokens_per_s")
        speedup = tps / base_tps if tps and base_tps else None
        rows.append({
            "gpus": n, "ranks": p.get("ranks"), "job": p.get("job"), "state": p.get("state"),
            "layout": (p.get("plan") or {}).get("layout"), "micro_batch": (p.get("plan") or {}).get("micro_batch"),
            "grad_accum": (p.get("plan") or {}).get("grad_accum"), "measured_steps": m.get("steps"),
            "tokens_per_s": tps, "steps_per_s": m.get("steps_per_s"), "speedup": speedup,
            # Linear scaling from the smallest point: n / base_n times its throughput.
            "efficiency": speedup / (n / base_n) if speedup is not None else None,
            "predicted_tokens_per_s": ptps,
            "predicted_speedup": ptps / base_pred if ptps and base_pred else None,
            "measured_vs_predicted": tps / ptps if tps and ptps else None,
        })  # fmt: skip
    return rows


def notes(study: dict[str, Any]) -> list[str]:
    """What the numbers are: the workload every point shares, and on a simulated machine what measured them."""
    s = study["settings"]
    out = [
        f"every point trains on the same global batch of {s['global_batch']} sequences × {s['seq_len']} tokens at "
        f"micro-batch {s.get('micro_batch')} ({s['precision']}, {s['method']}); each point runs the planner's best "
        "plan for its GPU count at that micro-batch, and accumulates what its replicas do not hold at once",
        f"throughput from steps {s['warmup'] + 1}–{s['steps']} of each job (the first {s['warmup']} are warm-up); "
        f"speed-up and efficiency against the {study['points'][0]['gpus']}-GPU point",
    ]
    noisy = [p["gpus"] for p in study["points"] if ((p.get("measured") or {}).get("step_time_spread") or 0) > NOISY]
    if noisy:
        out.append(
            f"step times varied by more than {NOISY:.0%} at {', '.join(map(str, noisy))} GPU(s): something else was "
            "using this machine, or too few steps were measured; repeat with more --steps before trusting the speed-up"
        )
    if study.get("simulated"):
        cores = study.get("cpu_cores") or 1
        out.append(
            f"simulated machine: measured on CPU ranks (this computer's {cores} CPU core{'s' * (cores != 1)}); "
            f"predicted figures are the planner's for real GPUs ({study.get('machine')}), so measured/predicted "
            "says nothing about the GPUs"
        )
        most = max((p.get("ranks") or 0 for p in study["points"]), default=0)
        if most > cores:
            out.append(
                f"{most} CPU ranks on {cores} cores cannot run faster than {cores}: points past {cores} ranks share "
                "the cores, so their speed-up is not a measure of anything but that"
            )
    return out


def layout_of(par: dict[str, Any]) -> str:
    parts = [f"dp {par.get('dp', 1)}"]
    if (par.get("tp") or 1) > 1:
        parts.append(f"tp {par['tp']}")
    if (par.get("pp") or 1) > 1:
        parts.append(f"pp {par['pp']}")
    zero = par.get("zero_stage") or 0
    text = " × ".join(parts) + (f", ZeRO-{zero}" if zero and (par.get("dp") or 1) > 1 else "")
    text += f", micro-batch {par.get('micro_batch', 1)} × {par.get('grad_accum', 1)} accumulation"
    if par.get("checkpointing", "none") != "none":
        text += f", {par['checkpointing']} checkpointing"
    return text


# -- the engine's side --------------------------------------------------------------------------------------


class Studies:
    """The engine's scaling studies: started here, run as ordinary jobs, stored as one JSON file each."""

    def __init__(self, root: Path, supervisor: Any, plan: Callable[[dict[str, Any]], dict[str, Any]],
                 write: Callable[[Path, str], None]):  # fmt: skip
        self.root = root
        self.supervisor = supervisor
        self.plan = plan  # planner request args → SearchResult dict (the engine's planner pool)
        self.write = write
        self._lock = threading.Lock()

    def start(self, request: dict[str, Any], cwd: str | None) -> dict[str, Any]:
        sup = self.supervisor
        counts = check_counts(list(request.get("gpus") or []), len(sup.machine.gpus))
        steps = int(request.get("steps") or DEFAULT_STEPS)
        warmup = int(request["warmup"]) if request.get("warmup") is not None else DEFAULT_WARMUP
        if steps < 1 or warmup < 0 or steps <= warmup:
            raise UserError(f"{steps} steps leave nothing to measure after {warmup} warm-up steps; give more --steps")
        if request.get("job"):
            job = sup.detail(request["job"])
            if job.get("kind") != "train":
                raise UserError(f"job {job['id']} is a {job.get('kind')} job; a scaling study repeats a training job")
            settings = settings_of_job(job.get("settings"))
            cwd = cwd or job.get("cwd")
        else:
            if not request.get("model"):
                raise UserError("which model? give --model (or --job to repeat a training job)")
            settings = {
                "model": request["model"], "trust_remote_code": bool(request.get("trust_remote_code")),
                "dataset": list(request.get("dataset") or []), "method": request.get("method") or _TRAIN["method"].default,
                "precision": request.get("precision") or _TRAIN["precision"].default,
                # As `run train` does: without --seq, the model's context where it is shorter than the default.
                "seq_len": int(request.get("seq_len") or default_seq_len(request["model"], cwd)),
                "global_batch": int(request.get("global_batch") or DEFAULT_GLOBAL_BATCH),
            }  # fmt: skip
        settings.update(steps=steps, warmup=warmup)
        study_id = self._new_id()
        micro = request.get("micro_batch")
        if micro is None:
            # The micro-batch the most GPUs' plan picks fits every smaller count's replicas (they hold more
            # sequences each), so every point runs it, with more accumulation on fewer GPUs.
            micro = self._best(settings, counts[-1], None)["parallelism"]["micro_batch"]
        settings["micro_batch"] = micro
        # Plan and check every point before submitting any: a study that cannot run leaves no job behind.
        points = []
        # Two at a time: the engine keeps two planner processes.
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="scaling-plan") as pool:
            results = list(pool.map(lambda n: self._plan_result(settings, n, micro), counts))
        for n, result in zip(counts, results, strict=True):
            best = result["best"]
            spec = point_spec(settings, study_id, n)
            sup.check(spec, result, cwd)
            par = best.get("parallelism") or {}
            timing = best.get("timing") or {}
            points.append({
                "gpus": n, "gpu_indices": list(range(n)), "spec": spec, "result": result,
                "plan": {"layout": layout_of(par), "micro_batch": par.get("micro_batch"),
                         "grad_accum": par.get("grad_accum"), "dp": par.get("dp"), "tp": par.get("tp"),
                         "pp": par.get("pp"), "zero_stage": par.get("zero_stage")},
                "predicted": {"tokens_per_s": timing.get("tokens_per_s"), "step_s": timing.get("step_s")},
            })  # fmt: skip
        study = {
            "schema": SCHEMA, "id": study_id, "created": time.time(), "model": settings["model"],
            "from_job": (request.get("job") and job["id"]) or None, "settings": settings,
            "machine": sup.machine.label, "simulated": sup.machine.simulated, "cpu_cores": _cpu_cores(),
            "points": [],
        }  # fmt: skip
        with self._lock:
            for p in points:
                view = sup.submit(p.pop("spec"), p.pop("result"), cwd)
                self._tag(view["id"], study_id)
                p["job"] = view["id"]
                study["points"].append(p)
                self._save(study)  # after each job, so a failure half-way leaves a study that names its jobs
        return self.show(study)

    def _plan_result(self, settings: dict[str, Any], n: int, micro: int | None) -> dict[str, Any]:
        """The engine planner's search for GPUs 0 … n-1 (at micro-batch `micro` when given); one line if none fits."""
        options: dict[str, Any] = {"suggest": False}
        if micro is not None:
            options["micro_batch"] = micro
        result = self.plan({
            "model": _planner_model(settings["model"]), "workload": workload_of(settings), "gpus": list(range(n)),
            "trust_remote_code": settings["trust_remote_code"], "options": options,
        })  # fmt: skip
        if not result.get("best"):
            at = f" at micro-batch {micro}" if micro is not None else ""
            why = next((r.get("reason") for r in result.get("rejected") or [] if r.get("reason")), None)
            raise UserError(
                f"no plan fits on {n} GPU{'s' * (n != 1)}{at}" + (f": {why}" if why else "")
                + ("; try another --micro-batch or --global-batch" if micro is not None else "")
            )  # fmt: skip
        return result

    def _best(self, settings: dict[str, Any], n: int, micro: int | None) -> dict[str, Any]:
        return self._plan_result(settings, n, micro)["best"]

    def _tag(self, job_id: str, study_id: str) -> None:
        self.supervisor.tag_study(job_id, study_id)

    def _new_id(self) -> str:
        while True:
            sid = "s" + secrets.token_hex(3)
            if not (self.root / f"{sid}.json").exists():
                return sid

    def _save(self, study: dict[str, Any]) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        stored = {k: v for k, v in study.items() if k not in ("table", "notes", "state", "current")}
        stored["points"] = [{k: v for k, v in p.items() if k not in ("measured", "state", "ranks", "error")}
                            for p in study["points"]]  # fmt: skip
        self.write(self.root / f"{study['id']}.json", json.dumps(stored, indent=1))

    def load(self, ref: str) -> dict[str, Any]:
        # A study id is short and plain (s1a2b3c): anything else is no study, and never a file name to try.
        if not (len(ref) <= 64 and ref.isascii() and ref.replace("-", "").isalnum()):
            raise UserError(f"no scaling study {ref[:64]!r} (see 'rigpilot scaling --list')")
        path = self.root / f"{ref}.json"
        if not path.is_file():
            raise UserError(f"no scaling study {ref!r} (see 'rigpilot scaling --list')")
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"scaling study {ref} is unreadable: {e}") from None

    def get(self, ref: str) -> dict[str, Any]:
        return self.show(self.load(ref))

    def list(self, job: str | None = None) -> list[dict[str, Any]]:
        out = []
        for f in (
            sorted(self.root.glob("*.json"), key=lambda f: f.stat().st_mtime, reverse=True)
            if self.root.is_dir()
            else []
        ):
            try:
                study = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if job is not None and study.get("from_job") != job:
                continue
            out.append(self.show(study))
        return out

    def cancel(self, ref: str) -> dict[str, Any]:
        """Cancel the study's jobs that have not ended; the points measured so far stay in its table."""
        study = self.load(ref)
        for p in study["points"]:
            rec = self.supervisor.store.get(p["job"])
            if rec is not None and rec.state not in TERMINAL:
                with contextlib.suppress(UserError):  # it ended meanwhile
                    self.supervisor.cancel(rec.id)
        return self.show(study)

    def show(self, study: dict[str, Any]) -> dict[str, Any]:
        """The study with each point's job state and measurement, its table and notes."""
        from rigpilot.engine.jobs.metrics import read_records

        sup = self.supervisor
        study = dict(study)
        points = []
        for p in study["points"]:
            p = dict(p)
            rec = sup.store.get(p["job"])
            if rec is None:
                p.update(state="deleted", ranks=None, measured=None)
            else:
                records: list[dict[str, Any]] = []
                cursor: dict[str, int] = {}
                while True:
                    more_records, cursor, more = read_records(sup.job_dir(rec.id) / "metrics", cursor)
                    records += more_records
                    if not more:
                        break
                p.update(state=rec.state, ranks=rec.ranks, measured=measure(records, study["settings"]["warmup"]))
                if rec.state in UNSUCCESSFUL_STATES:
                    p["error"] = f"job {rec.id} {rec.state}: {rec.exit_reason or 'no reason recorded'}"
            points.append(p)
        study["points"] = points
        return summarize(study)


def summarize(study: dict[str, Any]) -> dict[str, Any]:
    """Fill in the study's `state`, `current`, `table` and `notes` from its points' states and measurements."""
    points = study["points"]
    states = [p["state"] for p in points]
    if all(s == "completed" for s in states):
        study["state"] = "completed"
    elif all(s in (*TERMINAL, "deleted") for s in states):
        # Cancelled by the user where nothing failed: the points it measured are still its results.
        study["state"] = "cancelled" if "cancelled" in states and "failed" not in states else "failed"
    else:
        study["state"] = "running"
    study["current"] = next((p["gpus"] for p in points if p["state"] in ("starting", "running")), None)
    study["table"] = table(study)
    study["notes"] = notes(study)
    return study


def _cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _planner_model(model: str) -> str:
    # A job trains from scratch on a config.json; the planner reads the folder that holds it.
    path = Path(model)
    return str(path.parent) if path.name == "config.json" and is_given_file(path) else model
