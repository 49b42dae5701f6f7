"""The GUI's handle on one engine job: its record, its metric history and stream, its logs.

Like Frescobaldi's `Job`, a `JobHandle` mirrors something that runs elsewhere
and tells the views through signals. It keeps three cursors:

- the job record, replaced by `job` replies and merged with `sig_job` events;
- the metrics cursor (a byte offset per rank file): the full history is paged
  in with `metrics` requests, new records then come with `sig_metrics`, and
  after every reconnect the handle asks again from its cursor. The two sources
  overlap (the stream replays from wherever the link's subscription started),
  so records are deduplicated by what identifies them, and nothing is lost or
  counted twice;
- a log cursor (a byte offset into one rank's log file), for the log tail.

All requests go through `link.call`, so file reads happen in the engine and
the wait happens off the GUI thread.
"""

from __future__ import annotations

import threading
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from rigpilot.app.jobs.series import Folded, JobSeries, fold
from rigpilot.app.tasks import run_in_background
from rigpilot.engine.api.protocol import NOT_FOUND
from rigpilot.engine.jobs.store import ACTIVE_STATES, QUEUED, RESUMABLE_STATES, TERMINAL_STATES

CONNECTED = "connected"  # EngineLink's state name
# A page is decoded and folded on worker threads, but the JSON decoder holds the GIL while it runs:
# pages of 128 KiB keep each hold short when a long job's history is paged in (benchmarks/gui_charts.py,
# benchmarks/gui_job_open.py).
METRICS_PAGE_BYTES = 128 * 1024
# While records stream in, the cursor catches up this often, so a reconnect re-reads little.
CATCH_UP_MS = 30_000
LOG_TAIL_BYTES = 64 * 1024  # what a newly shown log starts with; older lines are in the file
LOG_PAGE_BYTES = 128 * 1024
LAUNCHER_RANK = -1  # the `logs` request's name for torchrun's own output
DELETED = "deleted"  # the state of the event the engine sends when a job is deleted


class RecordDeduper:
    """Remembers which metric records were taken, by (rank, kind, step, time).

    (rank, step, kind) names a record within one run; the time tells a resumed
    run's repeat of a step, and two status records of one step, apart. Only a
    hash is kept per record: a 64-bit hash per key makes a false "seen" far
    less likely than a torn line, at a third of the memory of the tuples.
    """

    def __init__(self) -> None:
        self._seen: set[int] = set()
        # History pages are sifted on a worker thread while the stream's records are on the GUI thread.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def fresh(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        with self._lock:
            seen = self._seen
            for rec in records:
                key = (rec.get("rank"), rec.get("kind"), rec.get("step"), rec.get("time"))
                try:
                    digest = hash(key)
                except TypeError:  # a script reported an odd step (report() checks values, not the step)
                    digest = hash(repr(key))
                if digest not in seen:
                    seen.add(digest)
                    out.append(rec)
        return out


class JobHandle(QObject):
    sig_record = Signal(dict)  # the job record changed (state, progress, failure cause)
    sig_metrics = Signal(int)  # new records were added to `series`: how many
    sig_history_loaded = Signal(int)  # the paged history is in: records received in all its pages
    sig_log = Signal(int, str, bool)  # rank, whole lines, whether they replace what is shown
    sig_error = Signal(str)  # a request failed, in words for the user

    def __init__(self, link: Any, job_id: str, record: dict[str, Any] | None = None):
        super().__init__()
        self.link = link
        self.id = job_id
        self.record: dict[str, Any] = dict(record or {"id": job_id})
        self.series = JobSeries()
        self.metrics_cursor: dict[str, int] = {}
        self.history_loaded = False
        self.pages = 0  # `metrics` replies received
        self._dedupe = RecordDeduper()
        self._history_received = 0
        self._metrics_busy = False
        self._metrics_again = False
        self._open = False
        self.log_rank: int | None = None
        self.log_offset: int | None = None  # None: start at the tail
        self._log_partial = ""
        self._log_busy = False
        self._log_serial = 0
        self._catch_up = QTimer(self)
        self._catch_up.setSingleShot(True)
        self._catch_up.setInterval(CATCH_UP_MS)
        self._catch_up.timeout.connect(self.fetch_metrics)

    # -- lifetime -------------------------------------------------------------------------
    def open(self) -> None:
        """Start mirroring: record, full metric history, then the live stream."""
        if self._open:
            return
        self._open = True
        self.link.sig_metrics.connect(self._on_stream)
        self.link.sig_job.connect(self._on_job_event)
        self.link.sig_state.connect(self._on_link_state)
        self.link.watch_metrics(self.id)
        self.refresh_record()
        self.fetch_metrics()

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        self._catch_up.stop()
        self.link.unwatch_metrics(self.id)
        self.link.sig_metrics.disconnect(self._on_stream)
        self.link.sig_job.disconnect(self._on_job_event)
        self.link.sig_state.disconnect(self._on_link_state)

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def loading_history(self) -> bool:
        """The paged history is on its way (False once it is in, or once asking for it failed)."""
        return self._open and self._metrics_busy and not self.history_loaded

    # -- the record -------------------------------------------------------------------------
    @property
    def state(self) -> str | None:
        return self.record.get("state")

    @property
    def name(self) -> str:
        return self.record.get("name") or self.id

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES or self.state == QUEUED

    @property
    def can_cancel(self) -> bool:
        return self.active and not self.record.get("cancel_requested")

    @property
    def can_resume(self) -> bool:
        return self.state in RESUMABLE_STATES

    def refresh_record(self) -> None:
        self.link.call("job", job=self.id, on_done=self._on_job_reply, on_error=self._on_record_error)

    def _on_record_error(self, error: BaseException) -> None:
        self._on_error(error)
        if self._open and getattr(error, "code", None) == NOT_FOUND:
            self._set_record({"id": self.id, "state": DELETED}, replace=True)  # deleted while we were away

    def _on_job_reply(self, reply: dict[str, Any]) -> None:
        if self._open and isinstance(reply.get("job"), dict):
            self._set_record(reply["job"], replace=True)

    def _on_job_event(self, job: dict[str, Any]) -> None:
        if job.get("id") == self.id:
            before = self.state
            self._set_record(job, replace=False)
            if self._open and job.get("state") != before and job.get("state") in TERMINAL_STATES:
                # What the job saved and its measured figures are final only now; events leave them out.
                self.refresh_record()

    def _set_record(self, job: dict[str, Any], *, replace: bool) -> None:
        # List events leave out the detail (predicted vs measured); keep what the last `job` reply said.
        self.record = dict(job) if replace else {**self.record, **job}
        self.sig_record.emit(self.record)

    def cancel(self) -> None:
        self.link.call("cancel", job=self.id, on_done=self._on_job_reply, on_error=self._on_error)

    def resume(self) -> None:
        # A resumed run appends to the same log files; the tail carries on where it is.
        self.link.call("resume", job=self.id, on_done=self._on_job_reply, on_error=self._on_error)

    # -- metrics ------------------------------------------------------------------------------
    def fetch_metrics(self) -> None:
        """Page in every record after the cursor; a call while a page is out asks once more after it."""
        if self._metrics_busy:
            self._metrics_again = True
            return
        self._metrics_busy = True
        self._request_page()

    def _request_page(self) -> None:
        self.link.call(
            "metrics",
            job=self.id,
            since_cursor=dict(self.metrics_cursor),
            max_bytes=METRICS_PAGE_BYTES,
            on_done=self._on_page,
            on_error=self._on_page_error,
        )

    def _on_page(self, reply: dict[str, Any]) -> None:
        if not self._open:
            self._metrics_busy = False
            return
        records = reply.get("records") or []
        cursor = reply.get("cursor")
        moved = isinstance(cursor, dict) and cursor != self.metrics_cursor
        if isinstance(cursor, dict):
            self.metrics_cursor = dict(cursor)
        self.pages += 1
        self._history_received += len(records)
        more = bool(reply.get("more") and (records or moved))
        # Sifting and folding a page of thousands of records takes the GUI thread tens of milliseconds
        # on a busy machine: a worker does it, and the GUI thread merges the arrays it makes.
        run_in_background(
            lambda: fold(self._dedupe.fresh(records)),
            lambda folded: self._on_page_folded(folded, more),
            self._on_page_error,
        )

    def _on_page_folded(self, folded: Folded, more: bool) -> None:
        if not self._open:
            self._metrics_busy = False
            return
        if folded.records:
            self.series.apply(folded)
            self.sig_metrics.emit(folded.records)
        if more:
            self._request_page()
            return
        self._metrics_busy = False
        if not self.history_loaded:
            self.history_loaded = True
            self.sig_history_loaded.emit(self._history_received)
        if self._metrics_again:
            self._metrics_again = False
            self.fetch_metrics()

    def _on_page_error(self, error: BaseException) -> None:
        # The cursor stays where the last page left it; the next reconnect asks again from there.
        self._metrics_busy = self._metrics_again = False
        self._on_error(error)

    def _on_stream(self, job_id: str, records: list[dict[str, Any]]) -> None:
        if job_id != self.id:
            return
        self._take(records)
        # The stream's own cursor stays inside the link; ours follows it now and then through `metrics`
        # (records it brings again are dropped), so the request after a reconnect stays small.
        if records and not self._catch_up.isActive():
            self._catch_up.start()

    def _take(self, records: list[dict[str, Any]]) -> None:
        fresh = self._dedupe.fresh(records)
        if fresh:
            self.series.add(fresh)
            self.sig_metrics.emit(len(fresh))

    def _on_link_state(self, state: str, detail: str) -> None:
        if state == CONNECTED and self._open:
            # Whatever happened while the link was down is in the files: catch up from our cursors.
            self.refresh_record()
            self.fetch_metrics()

    # -- logs -----------------------------------------------------------------------------------
    def fetch_log(self, rank: int) -> None:
        """Ask for the next lines of `rank`'s log (LAUNCHER_RANK: torchrun's); a new rank starts at its tail."""
        if rank != self.log_rank:
            self.log_rank = rank
            self.log_offset = None
            self._log_partial = ""
            self._log_busy = False  # a reply for the old rank is dropped by its serial
        if self._log_busy:
            return
        self._log_busy = True
        self._log_serial += 1
        serial = self._log_serial
        since = -LOG_TAIL_BYTES if self.log_offset is None else self.log_offset
        self.link.call(
            "logs",
            job=self.id,
            rank=rank,
            since_offset=since,
            max_bytes=LOG_PAGE_BYTES,
            on_done=lambda reply: self._on_log(serial, rank, reply),
            on_error=lambda e: self._on_log_error(serial, e),
        )

    def _on_log(self, serial: int, rank: int, reply: dict[str, Any]) -> None:
        if serial != self._log_serial or not self._open:
            return
        self._log_busy = False
        first = self.log_offset is None
        text = reply.get("text") or ""
        if first and (reply.get("offset") or 0) > 0 and "\n" in text:
            text = text[text.index("\n") + 1 :]  # the tail starts mid-line
        self.log_offset = reply.get("next_offset", (self.log_offset or 0) + len(text.encode()))
        text = self._log_partial + text
        cut = text.rfind("\n") + 1
        self._log_partial = text[cut:]
        whole = text[:cut]
        if not reply.get("more") and not self.active and self._log_partial:
            whole, self._log_partial = whole + self._log_partial + "\n", ""  # the job ended: no more to wait for
        if whole or first:
            self.sig_log.emit(rank, whole, first)
        if reply.get("more"):
            self.fetch_log(rank)

    def _on_log_error(self, serial: int, error: BaseException) -> None:
        if serial == self._log_serial:
            self._log_busy = False
            self._on_error(error)

    # -- errors -----------------------------------------------------------------------------------
    def _on_error(self, error: BaseException) -> None:
        if self._open:
            self.sig_error.emit(f"Job {self.id}: {error}")
