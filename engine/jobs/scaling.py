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
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeGuard

from rigpilot.engine.errors import UserError, jsonable
from rigpilot.engine.given_path import is_given_file
from rigpilot.engine.jobs import scaling_words
from rigpilot.engine.jobs.scaling_table import ACTIVE, check_counts
from rigpilot.engine.jobs.submission import default_seq_len
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS
from rigpilot.engine.schema import TERMINAL_STATES, UNSUCCESSFUL_STATES

log = logging.getLogger(__name__)

SCHEMA = "rigpilot.scaling/1"
DEFAULT_STEPS = 10
DEFAULT_WARMUP = 2
DEFAULT_GLOBAL_BATCH = 8
NOISY = 0.25  # step times spread wider than this (std/mean) make a point's throughput a guess
MIN_STEPS = 3  # fewer measured steps than this give a spread that means nothing
# More than this times linear from the smallest point is not scaling: one of the two was measured while
# something else slowed it (CPU ranks sharing cores, another job), so the ratio is not shown as a result.
IMPLAUSIBLE = 1.5
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
    base_noise = noise(base.get("measured"))
    rows = []
    for p in points:
        m, pred, n = p.get("measured") or {}, p.get("predicted") or {}, p["gpus"]
        tps, ptps = m.get("tokens_per_s"), pred.get("tokens_per_s")
        speedup = tps / base_tps if tps and base_tps else None
        why = noise(p.get("measured"))
        if why is None and speedup is not None and p is not base:
            if base_noise is not None:
                why = f"measured against the {base_n}-GPU point, which is noise: {base_noise}"
            elif speedup / (n / base_n) > IMPLAUSIBLE:
                why = f"{speedup / (n / base_n):.1f}× linear is not scaling: a point was slowed by something else"
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
            "noise": why,  # why this row's speed-up and efficiency mean nothing; None where they do
        })  # fmt: skip
    return rows


def noise(measured: dict[str, Any] | None) -> str | None:
    """Why a point's measurement is too noisy to compare (too few steps, step times spread too wide), or None."""
    if not measured:
        return None
    steps, spread = measured.get("steps"), measured.get("step_time_spread")
    if steps is not None and steps < MIN_STEPS:
        return f"only {steps} step{'s' * (steps != 1)} measured (at least {MIN_STEPS} needed)"
    if spread is not None and spread > NOISY:
        return f"step times varied by {spread:.0%} (more than {NOISY:.0%})"
    return None


def notes(study: dict[str, Any]) -> list[str]:
    """What the numbers are: the workload every point shares, and on a simulated machine what measured them."""
    s = study["settings"]
    if not study["points"]:
        return []
    out = [
        f"every point trains on the same global batch of {s['global_batch']} sequences × {s['seq_len']} tokens at "
        f"micro-batch {s.get('micro_batch')} ({s['precision']}, {s['method']}); each point runs the planner's best "
        "plan for its GPU count at that micro-batch, and accumulates what its replicas do not hold at once",
        f"throughput from steps {s['warmup'] + 1}–{s['steps']} of each job (the first {s['warmup']} are warm-up); "
        f"speed-up and efficiency against the {study['points'][0]['gpus']}-GPU point",
    ]
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


class _Cancelled(Exception):
    """The user cancelled a study while it was planned."""


def _point(n: int, spec: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """One point of a study: its job's spec and plan (until submitted), the plan's layout and prediction."""
    best = result["best"]
    par, timing = best.get("parallelism") or {}, best.get("timing") or {}
    # The communication most of the step waits on: its GPUs are where the study's words look for the link.
    comm = max(timing.get("comm") or [], key=lambda c: c.get("exposed_seconds") or 0.0, default=None)
    return {
        "gpus": n, "gpu_indices": list(range(n)), "spec": spec, "result": result,
        "plan": {"layout": layout_of(par), "micro_batch": par.get("micro_batch"), "grad_accum": par.get("grad_accum"),
                 "dp": par.get("dp"), "tp": par.get("tp"), "pp": par.get("pp"), "zero_stage": par.get("zero_stage")},
        "predicted": {"tokens_per_s": timing.get("tokens_per_s"), "step_s": timing.get("step_s"),
                      "exposed_comm_s": timing.get("exposed_comm_s"), "comm_group": (comm or {}).get("group")},
    }  # fmt: skip


# -- the engine's side --------------------------------------------------------------------------------------


class Studies:
    """The engine's scaling studies: started here, run as ordinary jobs, stored as one JSON file each."""

    def __init__(self, root: Path, supervisor: Any, plan: Callable[[dict[str, Any]], dict[str, Any]],
                 write: Callable[[Path, str], None]):  # fmt: skip
        self.root = root
        self.supervisor = supervisor
        self.plan = plan  # planner request args → SearchResult dict (the engine's planner pool)
        self.write = write
        self._lock = threading.RLock()
        # Studies this engine is planning and submitting, by id: the very dicts their thread works on, read under
        # the lock. A file that says "planning" with no entry here was planned by an engine that stopped.
        self._live: dict[str, dict[str, Any]] = {}

    def start(self, request: dict[str, Any], cwd: str | None) -> dict[str, Any]:
        """Check the request, store the study and answer at once; its points are planned and submitted in
        the background (planning every count takes a minute on a busy machine), as `show` then tells."""
        sup = self.supervisor
        counts = check_counts(list(request.get("gpus") or []), len(sup.machine.gpus))
        steps = int(request.get("steps") or DEFAULT_STEPS)
        warmup = int(request["warmup"]) if request.get("warmup") is not None else DEFAULT_WARMUP
        if steps < 1 or warmup < 0 or steps <= warmup:
            raise UserError(f"{steps} steps leave nothing to measure after {warmup} warm-up steps; give more --steps")
        job = None
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
        settings.update(steps=steps, warmup=warmup, micro_batch=request.get("micro_batch"))
        # Its model, data and folder are checked now, as a job's are when submitted: a bad path is refused in one
        # line and leaves no study behind; only the planning, which takes long, waits for the thread.
        sup.check(point_spec(settings, "check", counts[0]), None, cwd)
        with self._lock:
            if job is not None:
                self._refuse_a_second(job["id"])
            study = {
                "schema": SCHEMA, "id": self._new_id(), "created": time.time(), "model": settings["model"],
                "from_job": job["id"] if job else None, "settings": settings, "counts": counts,
                "machine": sup.machine.label, "simulated": sup.machine.simulated, "cpu_cores": _cpu_cores(),
                "points": [], "phase": "planning", "planned": 0,
            }  # fmt: skip
            self._live[study["id"]] = study
            self._save(study)
            # The answer is made before the thread starts: once it plans, its submissions hold the lock.
            answer = self.show(self.load(study["id"]))
        threading.Thread(
            target=self._plan_and_submit, args=(study, cwd), name=f"scaling-{study['id']}", daemon=True
        ).start()
        return answer

    def _refuse_a_second(self, job_id: str) -> None:
        for other in self.list(job_id):
            if other["state"] in ACTIVE:  # one cancelled while it plans shows as cancelled at once
                raise UserError(
                    f"scaling study {other['id']} of job {job_id} is still {other['state']}: wait for it or cancel it "
                    "first",
                    reason="study_running", study=other["id"], job=job_id,
                )  # fmt: skip

    def _plan_and_submit(self, study: dict[str, Any], cwd: str | None) -> None:
        """Plan every point, check each, then submit one job per point; a refusal fails the study in one line,
        a cancel stops it before its next count is planned and before any job is submitted."""
        sid, settings, counts = study["id"], study["settings"], study["counts"]
        try:
            if settings["micro_batch"] is None:
                # The micro-batch the most GPUs' plan picks fits every smaller count's replicas (they hold
                # more sequences each), so every point runs it, with more accumulation on fewer GPUs.
                settings["micro_batch"] = self._best(settings, counts[-1], None)["parallelism"]["micro_batch"]
            micro = settings["micro_batch"]

            def planned(n: int) -> dict[str, Any]:
                self._stop_if_cancelled(study)
                result = self._plan_result(settings, n, micro)
                with self._lock:
                    study["planned"] += 1
                return result

            # Plan and check every point before submitting any: a study that cannot run leaves no job behind.
            with ThreadPoolExecutor(max_workers=2, thread_name_prefix="scaling-plan") as pool:  # the planner pool's 2
                results = list(pool.map(planned, counts))
            points = []
            for n, result in zip(counts, results, strict=True):
                spec = point_spec(settings, sid, n)
                self.supervisor.check(spec, result, cwd)
                points.append(_point(n, spec, result))
            with self._lock:
                self._stop_if_cancelled(study)
                for p in points:
                    view = self.supervisor.submit(p.pop("spec"), p.pop("result"), cwd)
                    self._tag(view["id"], sid)
                    p["job"] = view["id"]
                    study["points"].append(p)
                    self._save(study)  # after each job, so a failure half-way leaves a study that names its jobs
                self._end_planning(study)
        except _Cancelled:
            self._end_planning(study)
        except UserError as e:
            self._fail(study, {"code": e.reason, "message": str(e), **e.fields})
        except Exception:  # a bug must not leave the study planning for ever: it fails, the log says why
            log.exception("scaling study %s: planning failed", sid)
            self._fail(study, {"code": "internal", "message": "planning the study failed; the engine log says why"})

    def _stop_if_cancelled(self, study: dict[str, Any]) -> None:
        with self._lock:
            if study.get("cancelled"):
                raise _Cancelled

    def _end_planning(self, study: dict[str, Any]) -> None:
        """The study's planning is over (its jobs submitted, or cancelled first): stored so, and no longer live."""
        with self._lock:
            study.pop("phase", None)
            self._save(study)
            self._live.pop(study["id"], None)

    def _fail(self, study: dict[str, Any], error: dict[str, Any]) -> None:
        with self._lock:
            if not study.get("cancelled"):  # a failure after the user cancelled is the cancel's
                study["error"] = jsonable(error)
            self._end_planning(study)
        for p in study["points"]:  # submitted before a later point's submission failed: they measure nothing now
            with contextlib.suppress(UserError):
                self.supervisor.cancel(p["job"])

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
        stored = {k: v for k, v in study.items() if k not in ("table", "notes", "state", "current", "planned")}
        stored["points"] = [{k: v for k, v in p.items() if k not in ("measured", "state", "ranks", "error", "step")}
                            for p in study["points"]]  # fmt: skip
        self.write(self.root / f"{study['id']}.json", json.dumps(stored, indent=1))

    def load(self, ref: str) -> dict[str, Any]:
        with self._lock:
            live = self._live.get(ref)
            if live is not None:  # as its thread has it now, not as last saved
                return {**live, "settings": dict(live["settings"]), "points": [dict(p) for p in live["points"]]}
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
                study = self.load(f.stem) if f.stem in self._live else json.loads(f.read_text())
            except (OSError, ValueError, UserError):
                continue
            if job is not None and study.get("from_job") != job:
                continue
            out.append(self.show(study))
        return out

    def cancel(self, ref: str) -> dict[str, Any]:
        """Cancel the study's jobs that have not ended; the points measured so far stay in its table."""
        with self._lock:
            live = self._live.get(ref)
            if live is not None and not live["points"]:  # still planning: it stops before submitting any job
                live["cancelled"] = True
                return self.show(self.load(ref))
            study = self.load(ref)  # under the lock: a submission in progress has ended, its jobs are named
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
        if study.get("phase") == "planning":
            with self._lock:
                live = study["id"] in self._live
            if not live:  # planned by an engine that stopped before it submitted the jobs
                study.pop("phase")
                study["error"] = {"code": "study_interrupted",
                                  "message": "the engine stopped while it planned this study; start it again"}  # fmt: skip
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
                p.update(state=rec.state, ranks=rec.ranks, measured=measure(records, study["settings"]["warmup"]),
                         step=max((r["step"] for r in records if r.get("kind") is None and isinstance(r.get("step"), int)),
                                  default=None))  # fmt: skip
                if rec.state in UNSUCCESSFUL_STATES:
                    p["error"] = f"job {rec.id} {rec.state}: {rec.exit_reason or 'no reason recorded'}"
            points.append(p)
        study["points"] = points
        study = summarize(study)
        study["words"] = scaling_words.of_study(study, sup.machine, sup.stored_check(sup.machine))
        return study


def summarize(study: dict[str, Any]) -> dict[str, Any]:
    """Fill in the study's `state`, `current`, `table` and `notes` from its points' states and measurements."""
    points = study["points"]
    states = [p["state"] for p in points]
    if study.get("error"):
        study["state"] = "failed"
    elif study.get("cancelled") and not points:
        study["state"] = "cancelled"  # while it planned: no job was submitted
    elif study.get("phase") == "planning":
        study["state"] = "planning"
    elif not points:
        study["state"] = "failed"  # stored with neither jobs nor an error: nothing will measure it
    elif all(s == "completed" for s in states):
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
