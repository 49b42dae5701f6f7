"""The GUI's connection to the engine service, as Qt signals.

One `EngineLink` per window. A stream thread holds a subscription connection
(telemetry, job changes, metrics of the jobs on screen) and turns pushed
events into `sig_*` signals on the GUI thread; when the service goes away it
says so (`sig_state("lost", why)`) and reconnects with backoff, starting the
service again if it is local; once Rigpilot itself has been uninstalled under
the window, it says so (`sig_state("gone", why)`) and stops. Requests go through `call()`, which runs them on
a worker thread with its own client and hands the result back on the GUI
thread. Nothing here blocks the GUI thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, Signal

from rigpilot.app.tasks import report_error, run_in_background
from rigpilot.engine.api.client import EngineClient, EngineRemoved

log = logging.getLogger(__name__)

CONNECTING, CONNECTED, LOST = "connecting", "connected", "lost"
# Rigpilot was uninstalled under the open window: no engine can start again, so the link stops trying.
GONE = "gone"


class EngineLink(QObject):
    sig_state = Signal(str, str)  # CONNECTING | CONNECTED | LOST | GONE, and a detail ("local", the error)
    sig_hello = Signal(dict)
    sig_machine = Signal(dict)  # Machine.to_dict(): on connecting, and whenever the engine switches machines
    sig_telemetry = Signal(dict)  # TelemetrySample.to_dict()
    sig_job = Signal(dict)  # a job record whose state or progress changed
    sig_metrics = Signal(str, list)  # job id, new metric records
    # What the engine did by itself that the user should hear of (protocol "notices": a damaged job
    # database rebuilt from the job folders, say), once each, whichever connection brought it.
    sig_notice = Signal(dict)

    def __init__(
        self,
        *,
        tcp: str | None = None,
        token: str | None = None,
        client_factory: Callable[..., EngineClient] | None = None,
    ):
        super().__init__()
        self._factory = client_factory or (lambda **kw: EngineClient(tcp=tcp, token=token, **kw))
        self.remote = tcp
        self.state = CONNECTING
        self.machine: dict[str, Any] | None = None
        self.notes: list[str] = []  # e.g. why a simulated machine stands in, in plain words
        self.details: list[str] = []  # the technical causes behind the notes (for a tooltip)
        self._restarting = threading.Event()  # the stream waits for restart_engine instead of starting a service
        self._stop = threading.Event()  # set once, by stop(): the link is closed for good
        self._thread: threading.Thread | None = None
        self._local = threading.local()
        self._clients: list[EngineClient] = []  # every request thread's client, to disarm them on stop()
        self._stream_client: EngineClient | None = None
        self._lock = threading.Lock()
        self._watched: dict[str, dict[str, int] | None] = {}  # job id -> metrics cursor to resume from
        self._pending: list[tuple[str, str]] = []  # ("subscribe" | "unsubscribe", topic)
        self._noticed: set[tuple[Any, ...]] = set()

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._stream, name="engine-stream", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Close the link for good: no more events, no new requests, and no answers to requests in flight.

        The window that owned it is closing; a late answer must not reach its deleted widgets, and a
        late request must not start an engine service nobody will look at.
        """
        self._stop.set()
        with self._lock:
            clients = [*self._clients, self._stream_client]
        for client in filter(None, clients):
            # A request still in flight that loses its engine must not start a new one on reconnecting:
            # by then the user (or a test) may have moved on to another engine.
            client.autostart = False
        if self._thread is not None:
            self._thread.join(timeout=3)
            self._thread = None

    @property
    def _closed(self) -> bool:
        return self._stop.is_set()

    # -- requests ---------------------------------------------------------------
    def call(
        self,
        rtype: str,
        on_done: Callable[[Any], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        **args: Any,
    ) -> None:
        """Send one request off the GUI thread; `on_done(result)` runs back on it.

        After `stop()` nothing is sent, and answers that arrive after it are dropped.
        """
        if self._closed:
            log.debug("engine link closed: %s not sent", rtype)
            return

        self._in_background(lambda: self._client().request(rtype, **args), on_done, on_error)

    def with_client(
        self, work: Callable[[EngineClient], Any], on_done: Callable[[Any], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:  # fmt: skip
        """`work(client)` off the GUI thread on a client of its own, closed after: for an exchange of several
        requests and events (a comparison that serves models and waits for them), which must not leave
        subscriptions on the thread's shared client. Its answer comes back as `call`'s does."""
        if self._closed:
            return

        def run() -> Any:
            with self._factory(client_name="gui", on_notice=self._on_notice) as client:
                return work(client)

        self._in_background(run, on_done, on_error)

    def _in_background(
        self, work: Callable[[], Any], on_done: Callable[[Any], None] | None,
        on_error: Callable[[BaseException], None] | None,
    ) -> None:  # fmt: skip
        """`work` off the GUI thread; its answer (or error) back on it, unless the link was stopped meanwhile."""

        def done(result: Any) -> None:
            if not self._closed and on_done is not None:
                on_done(result)

        def failed(error: BaseException) -> None:
            if not self._closed:
                (on_error or report_error)(error)

        run_in_background(work, done, failed)

    def _client(self) -> EngineClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._factory(client_name="gui", on_notice=self._on_notice)
            with self._lock:
                self._clients.append(client)
                if self._closed:
                    client.autostart = False
        return client

    def _on_notice(self, notice: dict[str, Any]) -> None:
        """From any client's thread: the engine tells each client name once, and the link has two names."""
        key = (notice.get("code"), notice.get("time"), notice.get("message"))
        with self._lock:
            if key in self._noticed:
                return
            self._noticed.add(key)
        if not self._closed:
            self.sig_notice.emit(notice)

    # -- metrics of the jobs on screen ------------------------------------------
    def watch_metrics(self, job_id: str) -> None:
        """Stream new metric records of `job_id` (the history comes from a `metrics` request)."""
        with self._lock:
            if job_id not in self._watched:
                self._watched[job_id] = None
                self._pending.append(("subscribe", f"metrics:{job_id}"))

    def unwatch_metrics(self, job_id: str) -> None:
        with self._lock:
            if self._watched.pop(job_id, "absent") != "absent":
                self._pending.append(("unsubscribe", f"metrics:{job_id}"))

    # -- the stream thread --------------------------------------------------------
    def _set_state(self, state: str, detail: str) -> None:
        self.state = state
        if not self._closed:
            self.sig_state.emit(state, detail)

    def _stream(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            self._set_state(CONNECTING, self.remote or "local")
            client = None
            try:
                client = self._factory(client_name="gui-stream", on_notice=self._on_notice)
                with self._lock:
                    self._stream_client = client
                    if self._closed:
                        client.autostart = False
                self.sig_hello.emit(client.connect())
                self._set_machine(client.request("machine"))
                with self._lock:
                    self._pending.clear()
                    topics = ["telemetry", "jobs", *(f"metrics:{j}" for j in self._watched)]
                    cursors = {j: c for j, c in self._watched.items() if c}
                client.request("subscribe", topics=topics, metrics_cursors=cursors)
                self._set_state(CONNECTED, f"remote {self.remote}" if self.remote else "local")
                backoff = 0.5
                while not self._stop.is_set():
                    self._apply_pending(client)
                    ev = client.next_event(timeout=0.2)
                    if ev is not None:
                        self._dispatch(ev)
            except EngineRemoved as e:  # retrying cannot help: say so once, and stop
                log.info("engine gone: %s", e)
                self._set_state(GONE, str(e))
                break
            except Exception as e:  # any failure means: say so, then reconnect
                if self._stop.is_set():
                    break
                log.info("engine connection lost: %s", e)
                self._set_state(LOST, str(e) or type(e).__name__)
                self._stop.wait(backoff)
                while self._restarting.is_set() and not self._stop.wait(0.1):
                    pass  # restart_engine starts the new service; a second start here would only race it
                backoff = min(backoff * 2, 5.0)
            finally:
                if client is not None:
                    client.close()

    def _set_machine(self, message: dict[str, Any]) -> None:
        self.machine = message["machine"]
        self.notes, self.details = list(message.get("notes") or []), list(message.get("details") or [])
        if not self._closed:
            self.sig_machine.emit(self.machine)

    # -- restarting the engine ----------------------------------------------------
    def restart_engine(
        self, on_done: Callable[[Any], None] | None = None, on_error: Callable[[BaseException], None] | None = None
    ) -> None:
        """Stop the local engine service, wait for it to be gone, start a new one; the stream reconnects.

        Jobs keep running through it (the engine's `shutdown`); the new service re-adopts them.
        """
        if self._closed:
            return
        if self.remote:
            raise ValueError("a remote engine is restarted on its own computer")
        self._restarting.set()

        def work() -> dict[str, Any]:
            import psutil

            try:
                old = self._factory(client_name="gui-restart", autostart=False)
                try:
                    pid = old.connect()["pid"]
                    old.request("shutdown")
                finally:
                    old.close()
                deadline = time.monotonic() + 60  # the supervisor takes up to 10 s to let go of its jobs
                while time.monotonic() < deadline:
                    try:
                        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                            break
                    except psutil.NoSuchProcess:
                        break
                    time.sleep(0.1)
                else:
                    raise TimeoutError(f"the engine service (pid {pid}) did not stop within a minute")
                new = self._factory(client_name="gui-restart")
                try:
                    return new.connect()
                finally:
                    new.close()
            finally:
                self._restarting.clear()

        self._in_background(work, on_done, on_error)

    def _apply_pending(self, client: EngineClient) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for action, topic in pending:
            client.request(action, topics=[topic])

    def _dispatch(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        if self._closed:
            return
        if kind == "telemetry":
            self.sig_telemetry.emit(ev["sample"])
        elif kind == "job":
            self.sig_job.emit(ev["job"])
        elif kind == "machine":
            self._set_machine(ev)
        elif kind == "metrics":
            job = ev["job"]
            with self._lock:
                if job in self._watched:
                    # After a reconnect, the subscription resumes here: no record is lost or repeated.
                    self._watched[job] = ev.get("cursor")
            self.sig_metrics.emit(job, ev.get("records", []))
