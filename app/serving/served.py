"""The models the engine serves now: its unfinished "serve" jobs, and the URL each reported once it listened.

One `ServedModels` per EngineLink (`served_models(link)`), shared by the Serving page and "Try it", so a job's
metrics are asked for once. A serve job is running once it listens (engine.jobs.following), and its first
"serving" status record carries the URL: that record is asked for when the job runs, not streamed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal

from rigpilot.app.engine_link import CONNECTED
from rigpilot.app.serving.stream import Access
from rigpilot.engine.schema import UNFINISHED_STATES, JobState
from rigpilot.engine.workers.serve_setup import serving_status

SERVE = "serve"
METRICS_PAGES = 8  # the status comes first in a server's metrics; a bound in case it never does
_UNFINISHED = {s.value for s in UNFINISHED_STATES}


@dataclass(frozen=True)
class ServedJob:
    id: str
    name: str  # the job's name
    model: str  # what it loads: a folder, a preset, a repo id ("" until the engine said)
    state: str
    started: float | None  # when the job began (seconds since the epoch)
    url: str | None  # …/v1, once it listens
    served_name: str | None  # the model name requests give
    since: float | None = None  # when it began to listen: its uptime runs from here, not from loading the model
    simulated: bool = False  # on a simulated machine: a CPU rank
    source_job: str = ""  # the training job whose model it serves, where it was started from one
    adapters: tuple[str, ...] = ()  # LoRA adapters it serves beside the base, by name
    api_key_file: str | None = None  # beyond loopback: where the job keeps its API key (on the engine's machine)
    tls_fingerprint: str | None = None  # beyond loopback: the engine's certificate, which the server presents
    gpus: tuple[int, ...] = ()  # the GPUs its ranks run on

    @property
    def listening(self) -> bool:
        return self.url is not None and self.state == JobState.RUNNING.value

    @property
    def chat_name(self) -> str:
        """The model a chat asks for: a LoRA job's tuned model (its adapter, under the job's name), else the base."""
        return self.name if self.name in self.adapters else (self.served_name or self.name)

    def access(self) -> Access:
        """What a chat sends to this server beyond loopback: its API key (read from the job's file, which a client
        of a remote engine cannot: then none, and the server answers 401) and the fingerprint to pin."""
        key = None
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).read_text().strip() or None
            except OSError:
                key = None
        return Access(key, self.tls_fingerprint)

    def serves(self, job_id: str, model: str | None) -> bool:
        """Whether this is the server of training job `job_id`, or of `model`."""
        return bool(job_id and self.source_job == job_id) or bool(model and self.model == model)


def serve_spec(model: str, gpus: list[int], name: str = "") -> dict[str, Any]:
    """The `submit` spec `rigpilot serve MODEL|JOB` sends (engine/cli/serve.py), on the first of `gpus`: `model` a
    model, or a finished training job's id (the engine serves what it trained: engine.jobs.serve_source). The
    engine picks the port, the name (a job's own) and the settings' defaults."""
    spec: dict[str, Any] = {"kind": SERVE, "model": model, "serve": {}}
    if name:
        spec["name"] = name
    if gpus:
        spec["gpus"] = gpus[:1]
    return spec


@dataclass(frozen=True)
class Listening:
    url: str
    name: str | None  # the model name requests give
    since: float | None
    adapters: tuple[str, ...] = ()
    api_key_file: str | None = None
    tls_fingerprint: str | None = None


def serving_url(records: list[dict[str, Any]]) -> Listening | None:
    """Where and since when a serve job listens, from its metric records: its "serving" status."""
    r = serving_status(records)
    if r is None:
        return None
    name, since, adapters = r.get("model"), r.get("time"), r.get("adapters")
    key_file, fingerprint = r.get("api_key_file"), r.get("tls_fingerprint")
    return Listening(r["url"], name if isinstance(name, str) else None,
                     since if isinstance(since, int | float) else None,
                     tuple(a for a in adapters.split(",") if a) if isinstance(adapters, str) else (),
                     key_file if isinstance(key_file, str) else None,
                     fingerprint if isinstance(fingerprint, str) else None)  # fmt: skip


class ServedModels(QObject):
    sig_changed = Signal()

    def __init__(self, link: Any) -> None:
        super().__init__()
        self.link = link
        self.jobs: dict[str, dict[str, Any]] = {}  # unfinished serve jobs by id
        self.urls: dict[str, Listening] = {}
        self.models: dict[str, str] = {}  # what each loads: the job list leaves a job's settings out
        self.sources: dict[str, str] = {}  # the training job each serves, where it was started from one
        self._asking: set[str] = set()
        self._asking_model: set[str] = set()
        link.sig_state.connect(self._on_state)
        link.sig_job.connect(self._on_job)
        if getattr(link, "state", None) == CONNECTED:
            self._on_state(CONNECTED, "")

    def rows(self) -> list[ServedJob]:
        out = []
        for job_id, job in self.jobs.items():
            listening = self.urls.get(job_id)
            started = job.get("started")
            out.append(ServedJob(
                id=job_id, name=str(job.get("name") or job_id), model=self.models.get(job_id, ""),
                state=str(job.get("state") or ""), started=started if isinstance(started, int | float) else None,
                url=listening.url if listening else None, served_name=listening.name if listening else None,
                since=listening.since if listening else None, simulated=bool(job.get("simulated")),
                source_job=self.sources.get(job_id, ""), adapters=listening.adapters if listening else (),
                api_key_file=listening.api_key_file if listening else None,
                tls_fingerprint=listening.tls_fingerprint if listening else None,
                gpus=tuple(g for g in job.get("gpus") or [] if isinstance(g, int)),
            ))  # fmt: skip
        return out

    # -- engine events ------------------------------------------------------------------------
    def _on_state(self, state: str, _detail: str) -> None:
        if state == CONNECTED:
            self.link.call("jobs", on_done=self._on_jobs, on_error=lambda _e: None)  # the Jobs page says why

    def _on_jobs(self, reply: dict[str, Any]) -> None:
        jobs = [j for j in reply.get("jobs") or [] if isinstance(j, dict)]
        self.jobs = {}
        for job in jobs:
            self._take(job)
        self.urls = {k: v for k, v in self.urls.items() if k in self.jobs}
        self.models = {k: v for k, v in self.models.items() if k in self.jobs}
        self.sources = {k: v for k, v in self.sources.items() if k in self.jobs}
        self.sig_changed.emit()

    def _on_job(self, job: dict[str, Any]) -> None:
        if job.get("id") in self.jobs or job.get("kind") == SERVE:
            merged = {**self.jobs.get(job["id"], {}), **job}
            self._take(merged)
            self.sig_changed.emit()

    def _take(self, job: dict[str, Any]) -> None:
        job_id = job.get("id")
        if job.get("kind") != SERVE or not isinstance(job_id, str):
            return
        if job.get("state") not in _UNFINISHED:
            self.jobs.pop(job_id, None)
            self.urls.pop(job_id, None)
            self.models.pop(job_id, None)
            self.sources.pop(job_id, None)
            return
        self.jobs[job_id] = job
        if job_id not in self.models and job_id not in self._asking_model:
            self._ask_model(job_id)
        if job.get("state") == JobState.RUNNING.value and job_id not in self.urls:
            self._ask_url(job_id, {}, 0)

    def _ask_model(self, job_id: str) -> None:
        self._asking_model.add(job_id)

        def done(reply: dict[str, Any]) -> None:
            self._asking_model.discard(job_id)
            settings = (reply.get("job") or {}).get("settings")
            model = settings.get("model") if isinstance(settings, dict) else None
            if isinstance(model, str) and job_id in self.jobs:
                self.models[job_id] = model
                source = (settings.get("serve") or {}).get("source_job") if isinstance(settings, dict) else None
                if isinstance(source, str) and source:
                    self.sources[job_id] = source
                self.sig_changed.emit()

        self.link.call("job", job=job_id, on_done=done, on_error=lambda _e: self._asking_model.discard(job_id))

    def _ask_url(self, job_id: str, cursor: dict[str, Any], pages: int) -> None:
        if job_id in self._asking and not cursor:
            return
        self._asking.add(job_id)

        def done(reply: dict[str, Any]) -> None:
            found = serving_url(reply.get("records") or [])
            if found is not None and job_id in self.jobs:
                self._asking.discard(job_id)
                self.urls[job_id] = found
                self.sig_changed.emit()
            elif reply.get("more") and isinstance(reply.get("cursor"), dict) and pages + 1 < METRICS_PAGES:
                self._ask_url(job_id, reply["cursor"], pages + 1)
            else:
                self._asking.discard(job_id)

        self.link.call("metrics", job=job_id, since_cursor=cursor, on_done=done,
                       on_error=lambda _e: self._asking.discard(job_id))  # fmt: skip


_shared: weakref.WeakKeyDictionary[Any, ServedModels] = weakref.WeakKeyDictionary()


def served_models(link: Any) -> ServedModels:
    """The one ServedModels of `link`."""
    found = _shared.get(link)
    if found is None:
        found = _shared[link] = ServedModels(link)
    return found
