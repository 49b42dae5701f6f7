"""A chat with a served model: a message box, the answer streaming in as its tokens arrive, its token counts and
why it stopped, and Stop generating.

The request runs on a worker thread (app.tasks); each piece of text is handed to the GUI thread with
`run_on_gui_thread`. A generation that a newer one or a new server replaced drops what still arrives for it.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app import tasks
from rigpilot.app.serving.stream import GONE, NO_ANSWER, UNTRUSTED, Access, ChatError, ChatReply, Stop, stream_chat
from rigpilot.app.widgets.icons import set_icon

# OpenAI's finish reasons, in the user's words.
DEFAULT_TEMPERATURE = 0.7
FINISH_WORDS = {"stop": "the model ended its answer", "length": "it reached the new-token limit"}


def said(error: BaseException) -> str:
    """A failed request in one line."""
    if isinstance(error, ChatError):
        if error.reason == GONE:
            return "The model is no longer served."
        if error.reason == NO_ANSWER:
            return f"The server stopped answering: {error.detail}"
        if error.reason == UNTRUSTED:
            return f"Not sent: the server is not the one its job started ({error.detail})."
        return f"The server refused the message: {error.detail}"
    return f"The message could not be sent: {error}"


def reply_line(reply: ChatReply) -> str:
    """What the status line says of a finished answer: its tokens and why it stopped."""
    if reply.prompt_tokens is not None and reply.completion_tokens is not None:
        counts = f"{reply.completion_tokens} token(s) generated for a prompt of {reply.prompt_tokens}"
    else:
        counts = "the server sent no token counts"
    if reply.stopped:
        return f"Stopped generating ({counts})."
    why = FINISH_WORDS.get(reply.finish_reason or "", reply.finish_reason or "not given")
    return f"{counts}; stopped: {why}."


class ChatPanel(QWidget):
    sig_text = Signal(str)  # a piece of the answer, as it arrived
    sig_finished = Signal(object)  # the ChatReply of an answer, or the exception that ended it

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.url: str | None = None
        self.access = Access()  # beyond loopback: the API key and the certificate to pin
        self.model: str | None = None
        self.messages: list[dict[str, str]] = []  # the conversation so far, sent whole with each message
        self._generation = 0  # which answer the arriving text belongs to
        self._stop: Stop | None = None
        self._answer = ""

        self.transcript = QPlainTextEdit()
        self.transcript.setObjectName("chatTranscript")
        self.transcript.setAccessibleName("Conversation")
        self.transcript.setReadOnly(True)
        self.transcript.setPlaceholderText("The conversation appears here.")
        self.message = QLineEdit()
        self.message.setObjectName("chatMessage")
        self.message.setAccessibleName("Message to the served model")
        self.message.setPlaceholderText("Type a message and press Enter")
        self.message.returnPressed.connect(self.send)
        label = QLabel("&Message")
        label.setBuddy(self.message)
        self.send_button = QPushButton("&Send")
        self.send_button.setObjectName("chatSend")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop &generating")
        set_icon(self.stop_button, "cancel")
        self.stop_button.setObjectName("chatStop")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        self.new_button = QPushButton("Ne&w chat")
        self.new_button.setObjectName("chatNew")
        self.new_button.setToolTip("Forget the conversation: the next message starts a new one")
        self.new_button.clicked.connect(self.new_chat)
        self.temperature = QDoubleSpinBox()
        self.temperature.setObjectName("chatTemperature")
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setValue(DEFAULT_TEMPERATURE)
        self.temperature.setToolTip("0: always the likeliest token (the same answer every time); higher: more varied")
        temperature_label = QLabel("T&emperature")
        temperature_label.setBuddy(self.temperature)
        self.max_tokens = QSpinBox()
        self.max_tokens.setObjectName("chatMaxTokens")
        self.max_tokens.setRange(0, 1_000_000)
        self.max_tokens.setSpecialValueText("server's limit")  # 0: as many as the server and the context allow
        self.max_tokens.setToolTip("Tokens an answer may have at most")
        max_label = QLabel("Ma&x tokens")
        max_label.setBuddy(self.max_tokens)
        self.status = QLabel()
        self.status.setObjectName("chatStatus")
        self.status.setWordWrap(True)
        options = QHBoxLayout()
        for w in (temperature_label, self.temperature, max_label, self.max_tokens):
            options.addWidget(w)
        options.addStretch(1)
        row = QHBoxLayout()
        row.addWidget(label)
        row.addWidget(self.message, 1)
        for b in (self.send_button, self.stop_button, self.new_button):
            row.addWidget(b)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.transcript, 1)
        layout.addLayout(row)
        layout.addLayout(options)
        layout.addWidget(self.status)
        self._set_server(None, None)

    @property
    def generating(self) -> bool:
        return self._stop is not None

    def set_server(self, url: str | None, model: str | None, access: Access | None = None) -> None:
        """Chat with `model` at `url` (…/v1), with `access` beyond loopback; None: nothing to chat with."""
        self.access = access or Access()
        if (url, model) != (self.url, self.model):
            self._set_server(url, model)

    def _set_server(self, url: str | None, model: str | None) -> None:
        self.url, self.model = url, model
        served = url is not None and model is not None
        for w in (self.message, self.new_button):
            w.setEnabled(served)
        self.new_chat()

    def new_chat(self) -> None:
        """Forget the conversation (and drop an answer still coming)."""
        self._drop_answer()
        self.messages = []
        self.transcript.clear()
        served = self.url is not None and self.model is not None
        self.status.setText(f"Chat with {self.model} at {self.url}" if served else "No served model to chat with.")

    def _drop_answer(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        self._generation += 1  # what still arrives for it is dropped
        self.stop_button.setEnabled(False)
        self.send_button.setEnabled(self.url is not None and self.model is not None)

    def send(self) -> None:
        text = self.message.text().strip()
        if not text or self.url is None or self.model is None or self.generating:
            return
        self.message.clear()
        self.messages.append({"role": "user", "content": text})
        self._append(("\n\n" if self.transcript.toPlainText() else "") + f"You: {text}\n\n{self.model}: ")
        self._generation += 1
        generation, stop = self._generation, Stop()
        self._stop, self._answer = stop, ""
        self.stop_button.setEnabled(True)
        self.send_button.setEnabled(False)
        self.status.setText("Generating…")
        url, model, messages, access = self.url, self.model, list(self.messages), self.access
        temperature, max_tokens = self.temperature.value(), self.max_tokens.value() or None

        def work() -> tuple[int, ChatReply | Exception]:
            try:
                return generation, stream_chat(
                    url, model, messages, lambda t: tasks.run_on_gui_thread(self._on_text, (generation, t)), stop,
                    max_tokens=max_tokens, temperature=temperature, access=access,
                )
            except Exception as e:  # worded on the GUI thread, with the answer it belongs to
                return generation, e

        # Bound methods: a result for a panel closed meanwhile is dropped by app.tasks.
        tasks.run_in_background(work, self._on_end)

    def stop(self) -> None:
        """Stop generating: the stream is shut at once, which frees the server's slot."""
        if self._stop is not None:
            self._stop.set()
            self.status.setText("Stopping…")

    def _on_text(self, arg: tuple[int, str]) -> None:
        generation, text = arg
        if generation == self._generation:
            self._answer += text
            self._append(text)
            self.sig_text.emit(text)

    def _on_end(self, arg: tuple[int, ChatReply | Exception]) -> None:
        generation, result = arg
        if generation != self._generation:
            return
        self._stop = None
        self.stop_button.setEnabled(False)
        self.send_button.setEnabled(True)
        if isinstance(result, ChatReply):
            self.messages.append({"role": "assistant", "content": result.text})
            self.status.setText(reply_line(result))
        else:
            self.messages.pop()  # the message that got no answer is not part of the conversation
            self.status.setText(said(result))
        self.sig_finished.emit(result)

    def _append(self, text: str) -> None:
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(text)
        self.transcript.setTextCursor(cursor)
        self.transcript.ensureCursorVisible()

    def answer(self) -> str:
        """The last answer as it streamed in."""
        return self._answer
