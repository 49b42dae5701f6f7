""" "Try it": a chat with a finished job's model once it is served (app.serving), or one prompt to it run as a
small inference job, and its completion.

The inference job is built by the wizard's own spec builder (`WizardState.to_spec`), so it is
exactly what the wizard would submit for an inference job with that prompt.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from rigpilot.app.jobs.outcome import settings_of
from rigpilot.app.serving.chat import ChatPanel
from rigpilot.app.serving.served import ServedModels, served_models
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.wizard.state import INFER, WizardState
from rigpilot.engine.jobs.results import STOP_WORDS
from rigpilot.engine.jobs.store import COMPLETED, TERMINAL_STATES
from rigpilot.engine.jobspec.spec import InferSettings

MAX_NEW_TOKENS = 64


def try_spec(model: str, prompt: str, job: dict[str, Any]) -> dict[str, Any]:
    """The `submit` spec of a one-prompt inference job on `model`, on the first GPU `job` ran on."""
    settings = settings_of(job)
    precision = (settings.get("train") or settings.get("infer") or {}).get("precision") or InferSettings().precision
    state = WizardState(
        kind=INFER, model=model, prompts=[prompt], gpus=list(job.get("gpus") or [])[:1],
        name=f"try: {' '.join(prompt.split())[:40]}", trust_remote_code=bool(settings.get("trust_remote_code")),
        infer=InferSettings(max_new_tokens=MAX_NEW_TOKENS, batch_size=1, precision=precision),
    )  # fmt: skip
    return state.to_spec()


class TryIt(QWidget):
    sig_submitted = Signal(str)  # the id of the inference job a prompt started
    sig_serve = Signal()  # "Serve to chat": the page submits the serve job

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.link: Any = None
        self.model: str | None = None
        self.job: dict[str, Any] = {}
        self.running: str | None = None  # the try job we wait for
        self.last_completion = ""  # as generated (the box may mark its blank space)
        self.partial = ""  # the running job's completion so far, as streamed
        self.prompt = QLineEdit()
        self.prompt.setObjectName("tryPrompt")
        self.prompt.setAccessibleName("Try it: a prompt for this model")
        self.prompt.setPlaceholderText("Type a prompt and press Enter: a small inference job runs it on this model")
        self.prompt.returnPressed.connect(self.submit)
        label = QLabel("&Try it")
        label.setBuddy(self.prompt)
        self.status = QLabel()
        self.status.setObjectName("tryStatus")
        self.status.setWordWrap(True)
        self.output = QPlainTextEdit()
        self.output.setObjectName("tryOutput")
        self.output.setAccessibleName("Completion")
        self.output.setReadOnly(True)  # a tab of its own (the job page's "Try it"): the completion takes its height
        self.output.hide()
        # Served, the model answers in a chat, token by token; until then one prompt runs as a small job.
        self.served: ServedModels | None = None
        self.serve_line = QLabel()
        self.serve_line.setObjectName("tryServeLine")
        self.serve_line.setWordWrap(True)
        self.serve_button = QPushButton("&Serve to chat")
        set_icon(self.serve_button, "serve")
        self.serve_button.setObjectName("tryServe")
        self.serve_button.setToolTip("Serve this model through an OpenAI-compatible API on this machine")
        self.serve_button.clicked.connect(self.sig_serve.emit)
        self.chat = ChatPanel()
        self.chat.hide()
        serve_row = QHBoxLayout()
        serve_row.addWidget(self.serve_line, 1)
        serve_row.addWidget(self.serve_button)
        self.one_prompt = QWidget()
        row = QHBoxLayout(self.one_prompt)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(label)
        row.addWidget(self.prompt, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)  # a tab's page: off its edges
        layout.addLayout(serve_row)
        layout.addWidget(self.chat, 1)
        layout.addWidget(self.one_prompt)
        layout.addWidget(self.status)
        layout.addWidget(self.output, 1)
        layout.addStretch(0)  # with no completion yet, the prompt and the status stay at the top

    def set_model(self, link: Any, model: str | None, job: dict[str, Any]) -> None:
        if link is not self.link:
            if self.link is not None:
                self.link.sig_job.disconnect(self._on_job)
                self.link.sig_metrics.disconnect(self._on_metrics)
            if self.served is not None:
                self.served.sig_changed.disconnect(self._show_served)
            self.link, self.served = link, None
            if link is not None:
                link.sig_job.connect(self._on_job)
                link.sig_metrics.connect(self._on_metrics)
                self.served = served_models(link)
                self.served.sig_changed.connect(self._show_served)
        if model != self.model:
            self.running = None
            self.prompt.clear()
            self.status.setText("")
            self.output.clear()
            self.output.hide()
        self.model, self.job = model, job  # the job page shows its tab only with a model to try
        self._show_served()

    def _show_served(self) -> None:
        """The chat where this model is served; else Serve, and the one-prompt job."""
        rows = self.served.rows() if self.served is not None and self.model else []
        mine = [r for r in rows if r.serves(str(self.job.get("id") or ""), self.model)]
        listening = next((r for r in mine if r.listening), None)
        if listening is not None:
            self.chat.set_server(listening.url, listening.chat_name, listening.access())
            self.serve_line.setText(f"Served at {listening.url} (job {listening.id}; the Serving page stops it).")
        else:
            self.chat.set_server(None, None)
            self.serve_line.setText(
                f"Job {mine[0].id} is loading the model to serve it; the chat opens here once it listens." if mine
                else "Serve this model to chat with it, its answers streaming as they come."
            )  # fmt: skip
        self.serve_button.setVisible(not mine)
        self.chat.setVisible(listening is not None)
        for w in (self.one_prompt, self.status, self.output):
            w.setVisible(listening is None and (w is not self.output or bool(self.output.toPlainText())))

    def submit(self) -> None:
        text = self.prompt.text().strip()
        if not text or self.model is None or self.link is None:
            return
        if self.running:
            self.status.setText(f"Still waiting for job {self.running}; its completion comes first.")
            return
        spec = try_spec(self.model, text, self.job)
        self.status.setText("Submitting…")
        model = self.model

        def done(reply: dict[str, Any]) -> None:
            job = reply.get("job") or {}
            if model != self.model or not job.get("id"):
                return
            self.running, self.partial = job["id"], ""
            self.link.watch_metrics(job["id"])  # its completion streams in as `partial` records
            self.status.setText(
                f"Job {job['id']} generates up to {MAX_NEW_TOKENS} tokens; the completion appears here as it comes."
            )
            self.sig_submitted.emit(job["id"])

        def failed(error: BaseException) -> None:
            if model == self.model:
                self.status.setText(f"Could not run the prompt: {error}")

        self.link.call("submit", spec=spec, on_done=done, on_error=failed)

    def _on_metrics(self, job_id: str, records: list[dict[str, Any]]) -> None:
        """The completion as the worker streams it, until the job's results replace it."""
        if job_id != self.running:
            return
        grown = False
        for r in records:
            if r.get("kind") == "partial" and r.get("index") == 0 and isinstance(r.get("text"), str):
                self.partial = r["text"] if r.get("again") else self.partial + r["text"]
                grown = True
        if grown:
            shown, _ = shown_completion(self.partial, None)
            self.output.setPlainText(shown)
            self.output.show()
            self.status.setText(f"Job {job_id} is generating…")

    def _on_job(self, job: dict[str, Any]) -> None:
        if not self.running or job.get("id") != self.running or job.get("state") not in TERMINAL_STATES:
            return
        job_id, self.running = self.running, None
        self.link.unwatch_metrics(job_id)
        if job["state"] != COMPLETED:
            self.status.setText(f"Job {job_id} {job['state']}: {job.get('exit_reason') or 'see its log'}")
            return

        def done(reply: dict[str, Any]) -> None:
            results = reply.get("results") or []
            if not results:
                self.status.setText(f"Job {job_id} wrote no completion.")
                return
            result = results[0]
            completion = result.get("completion", "")
            shown, said = shown_completion(completion, result.get("new_tokens"))
            stop = STOP_WORDS.get(result.get("stop_reason") or "")
            self.status.setText(f"Completion from job {job_id}: {said}" + (f"; stopped: {stop}." if stop else ""))
            self.output.setPlainText(shown)
            self.output.show()
            self.last_completion = completion

        def failed(error: BaseException) -> None:
            self.status.setText(f"Job {job_id}: {error}")

        self.link.call("results", job=job_id, limit=1, on_done=done, on_error=failed)

    def completion(self) -> str:
        return self.last_completion if self.output.isVisible() else ""


def shown_completion(text: str, new_tokens: int | None) -> tuple[str, str]:
    """(How the box shows a completion, what the status line says of it).

    Where blank space is most of an answer ("s" and 62 line breaks), the box marks it (⏎ for a line break,
    · for a space, → for a tab) and the line counts it, so a lone letter does not read as the whole answer.
    """
    tokens = f"{new_tokens} token(s)" if isinstance(new_tokens, int) else "the completion"
    blank = sum(ch.isspace() for ch in text)
    if not text.strip():
        return _marked(text), f"{tokens} of blank space only (shown as ⏎ and ·)"
    if blank > len(text) - blank:
        letters = len(text) - blank
        breaks = text.count("\n")
        parts = [f"{letters} visible character{'s' * (letters != 1)}"]
        if breaks:
            parts.append(f"{breaks} line break{'s' * (breaks != 1)}")
        if blank - breaks:
            parts.append(f"{blank - breaks} space{'s' * (blank - breaks != 1)} or tabs")
        return _marked(text), f"{tokens}, mostly blank space: {', '.join(parts)} (shown as ⏎, · and →)"
    return text, tokens


def _marked(text: str) -> str:
    return text.replace(" ", "·").replace("\t", "→").replace("\n", "⏎\n")
