"""The Jobs page over canned engine replies: job records, metric records, and the page opened on them."""

from __future__ import annotations

import json
from typing import Any

from rigpilot.app.jobs.page import JobsPage
from rigpilot.engine.api.client import EngineError

from support.gui_fakes import FakeLink, make_job

T0 = 1_700_000_000.0


GIB = 1024**3


def step_record(step: int, rank: int = 0, loss: float | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "time": T0 + step + rank * 1e-3, "rank": rank, "step": step,
        "loss": 4.0 / (1 + 0.1 * step) if loss is None else loss, "lr": 3e-4, "grad_norm": 1.0,
        "tokens_per_s": 1000.0 + step, "step_time": 0.5, "mfu": 0.4, "peak_memory": (10 + rank) * GIB, **extra,
    }  # fmt: skip


class FakeJobs:
    """The engine's job requests (metrics, logs, cancel, resume, job) over canned data, in server.py's shapes.

    Metric cursors count records per rank, standing in for the byte offsets the engine uses;
    pages hold at most `page_records` records of each rank, so a test decides how many pages there are.
    """

    def __init__(self, link: FakeLink, jobs: list[dict[str, Any]], page_records: int = 10):
        self.link = link
        self.page_records = page_records
        self.records: dict[str, list[dict[str, Any]]] = {}
        self.logs: dict[tuple[str, int], str] = {}
        link.jobs = jobs
        link.replies.update(
            job=self.job, metrics=self.metrics, logs=self.log, cancel=self.cancel, resume=self.resume,
            telemetry_history=lambda **_: {"samples": [], "more": False, "next_since": None},
        )  # fmt: skip

    def record(self, job_id: str) -> dict[str, Any]:
        return next(j for j in self.link.jobs if j["id"] == job_id)

    def job(self, job: str) -> dict[str, Any]:
        if not any(j["id"] == job for j in self.link.jobs):
            raise EngineError("not_found", f"no job {job!r}")
        return {"job": self.record(job)}

    def metrics(self, job: str, since_cursor: dict[str, int] | None = None, max_bytes: int = 0) -> dict[str, Any]:
        cursor = dict(since_cursor or {})
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for rec in self.records.get(job, []):
            by_rank.setdefault(rec["rank"], []).append(rec)
        out, more = [], False
        for rank, recs in sorted(by_rank.items()):
            start = cursor.get(str(rank), 0)
            page = recs[start : start + self.page_records]
            out += page
            cursor[str(rank)] = start + len(page)
            more = more or cursor[str(rank)] < len(recs)
        out.sort(key=lambda r: (r["time"], r["rank"]))
        return {"job": job, "records": out, "cursor": cursor, "more": more, "state": self.record(job)["state"]}

    def log(self, job: str, rank: int | None = None, since_offset: int = 0, max_bytes: int = 1 << 20) -> dict[str, Any]:
        rank = 0 if rank is None else rank
        data = self.logs.get((job, rank), "").encode()
        size = len(data)
        start = max(size + since_offset, 0) if since_offset < 0 else min(since_offset, size)
        chunk = data[start : start + max_bytes]
        end = start + len(chunk)
        return {
            "job": job, "rank": rank, "ranks": sorted({r for j, r in self.logs if j == job and r >= 0}),
            "path": f"/jobs/{job}/logs/rank{rank}.log", "offset": start, "next_offset": end, "size": size,
            "more": end < size, "text": chunk.decode(), "state": self.record(job)["state"],
        }  # fmt: skip

    def cancel(self, job: str) -> dict[str, Any]:
        rec = self.record(job)
        rec["cancel_requested"] = True
        return {"job": rec}

    def resume(self, job: str) -> dict[str, Any]:
        rec = self.record(job)
        rec.update(state="queued", run=rec.get("run", 1) + 1, exit_reason=None, failed_rank=None, last_log=[])
        return {"job": rec}


def a_job(job_id: str, state: str = "running", **fields: Any) -> dict[str, Any]:
    job = make_job(job_id, gpus=[0, 1], state=state, name=f"run {job_id}")
    job.update(job_dir=f"/tmp/rigpilot-jobs/{job_id}", run=1, cancel_requested=False, progress=None, **fields)
    return job


def open_page(qtbot, link: FakeLink) -> JobsPage:
    page = JobsPage(link)
    qtbot.addWidget(page)
    page.resize(1280, 1000)
    page.show()
    qtbot.waitExposed(page)
    link.connect_engine()
    qtbot.waitUntil(lambda: page.model.rowCount() == len(link.jobs))
    return page


def open_job(qtbot, page: JobsPage, job_id: str) -> None:
    page.open_job(job_id)
    handle = page.current_handle
    assert handle is not None
    # The pane shows a piece per event-loop turn after the click: wait for the last one too.
    qtbot.waitUntil(lambda: handle.history_loaded and handle.record.get("state") is not None)
    qtbot.waitUntil(lambda: not page.detail.settling)
    page.refresh(force=True)


TRAIN = {
    "kind": "train", "model": "examples/models/tiny-llama", "gpus": [0, 1], "spec_version": 1,
    "parallelism": {"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 1},
    "train": {"method": "full", "dataset": ["shakespeare.txt"], "learning_rate": 2e-4, "micro_batch": 2,
              "grad_accum": 4, "seq_len": 64, "max_steps": 10, "precision": "fp32"},
}  # fmt: skip


def a_training_job(job_id: str, *, output: str | None = "full", merged: bool = False, **train: Any) -> dict[str, Any]:
    folder = f"/tmp/rigpilot-jobs/{job_id}/output"
    settings = json.loads(json.dumps(TRAIN))
    settings["train"].update(train)
    job = a_job(job_id, "completed")
    job.update(
        kind="train", started=1000.0, ended=1000.0 + 3725, wall_s=3725.0, settings=settings,
        output={"folder": folder, "model": output, "merged": f"{folder}/merged" if merged else None, "results": False,
                "architectures": ["LlamaForCausalLM"], "base_model": "org/base" if output == "lora" else None},
        progress={"fraction": 1.0, "step": 10, "max_steps": 10, "tokens_per_s": 14_719_000.0,
                  "steady_tokens_per_s": 14_719_000.0},
    )  # fmt: skip
    return job
