"""Serving in the app: the chat panel against a real served tiny Llama (one serve worker for the module, as
tests/workers/test_serve.py starts it), held to what the official openai client gets for the same request; and the
Serving page, "Serve this model" and "Try it" over a FakeLink.
"""

from __future__ import annotations

import socket
from typing import Any

import openai
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from rigpilot.app.jobs.detail import TRY_TAB
from rigpilot.app.serving.chat import ChatPanel
from rigpilot.app.serving.page import ServingPage
from rigpilot.app.serving.served import serving_url
from rigpilot.app.serving.stream import GONE, ChatError, stream_chat

from support.gui_fakes import FakeLink
from support.gui_jobs import FakeJobs, a_job, a_training_job, open_job, open_page
from support.served import serve_worker
from support.worker_jobs import save_random_llama

MESSAGE = "Say something."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_random_llama(tmp_path_factory.mktemp("served") / "tiny", initializer_range=0.2)
    serve = {"precision": "fp32", "max_batch": 4, "max_concurrent": 5, "max_new_tokens": 64}
    with serve_worker(tmp_path_factory.mktemp("jobs") / "serve1", model, **serve) as served:
        yield served


def chat_panel(qtbot, url: str, model: str = "tiny") -> ChatPanel:
    panel = ChatPanel()
    qtbot.addWidget(panel)
    panel.set_server(url, model)
    panel.temperature.setValue(0)
    panel.max_tokens.setValue(MAX_TOKENS)
    return panel


def send(qtbot, panel: ChatPanel, text: str) -> Any:
    qtbot.keyClicks(panel.message, text)
    with qtbot.waitSignal(panel.sig_finished, timeout=60_000) as finished:
        qtbot.keyClick(panel.message, Qt.Key.Key_Return)
    return finished.args[0]


@pytest.mark.slow  # the server's start: a worker process importing torch and loading the model
def test_the_chat_streams_tokens_with_the_counts_and_stop_reason_the_openai_client_gets(qtbot, server):
    panel = chat_panel(qtbot, server["url"])
    pieces: list[str] = []
    panel.sig_text.connect(pieces.append)
    reply = send(qtbot, panel, MESSAGE)

    client = openai.OpenAI(base_url=server["url"], api_key="unused-on-loopback", max_retries=0, timeout=60)
    messages: Any = [{"role": "user", "content": MESSAGE}]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    usage = chunks[-1].usage
    assert len(pieces) > 1 and "".join(pieces) == reply.text == text  # streamed, a piece at a time
    assert (reply.prompt_tokens, reply.completion_tokens, reply.finish_reason) == (
        usage.prompt_tokens, usage.completion_tokens, finish,
    )  # fmt: skip
    assert panel.transcript.toPlainText() == f"You: {MESSAGE}\n\ntiny: {text}"
    assert f"{usage.completion_tokens} token(s) generated for a prompt of {usage.prompt_tokens}" in panel.status.text()
    assert panel.messages[-1] == {"role": "assistant", "content": text}
    assert not panel.generating and panel.send_button.isEnabled()


@pytest.mark.slow
def test_a_refused_message_is_one_line_and_leaves_the_conversation_as_it_was(qtbot, server):
    panel = chat_panel(qtbot, server["url"], model="not-served")
    error = send(qtbot, panel, "Hello")
    assert isinstance(error, ChatError)
    assert panel.status.text() == ("The server refused the message: the model 'not-served' is not served here; "
                                   "this server serves 'tiny'")  # fmt: skip
    assert panel.messages == []


@pytest.mark.slow
def test_stopping_before_the_first_token_closes_the_stream(server):
    reply = stream_chat(server["url"], "tiny", [{"role": "user", "content": "Hi"}], lambda _t: None, lambda: True)
    assert reply.stopped and reply.text == "" and reply.finish_reason is None


def test_a_model_no_longer_served_is_said_so(qtbot):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ChatError) as e:
        stream_chat(f"http://127.0.0.1:{port}/v1", "tiny", [{"role": "user", "content": "Hi"}], lambda _t: None)
    assert e.value.reason == GONE
    panel = chat_panel(qtbot, f"http://127.0.0.1:{port}/v1")
    send(qtbot, panel, "Hi")
    assert panel.status.text() == "The model is no longer served."


# -- the Serving page, "Serve this model", Try it (FakeLink) ------------------------------------------------------

URL = "http://127.0.0.1:43111/v1"
MODEL = "/tmp/rigpilot-jobs/t/output"  # a_training_job("t")'s model


def a_serve_job(job_id: str = "s1", state: str = "running") -> dict[str, Any]:
    job = a_job(job_id, state)
    job.update(kind="serve", name="tiny-llama", gpus=[0], started=1000.0, settings={"kind": "serve", "model": MODEL})
    return job


def serving(link: FakeLink, jobs: FakeJobs, job_id: str = "s1") -> None:
    jobs.records[job_id] = [
        {"kind": "status", "phase": "loading model", "rank": 0, "time": 1.0},
        {"kind": "status", "phase": "serving", "url": URL, "model": "tiny-llama", "rank": 0, "time": 2.0},
    ]


def test_serving_url_is_the_serving_status():
    assert serving_url([{"kind": "status", "phase": "loading model"}]) is None
    assert serving_url([{"kind": "status", "phase": "serving", "url": URL, "model": "m"}]) == (URL, "m")


def test_the_serving_page_lists_what_is_served_copies_its_url_and_stops_it(qtbot):
    link = FakeLink()
    jobs = FakeJobs(link, [a_training_job("t"), a_serve_job()])
    serving(link, jobs)
    page = ServingPage(link)
    qtbot.addWidget(page)
    page.show()
    assert page.empty.isVisible() and not page.chat.send_button.isEnabled()  # nothing to chat with yet
    link.connect_engine()
    qtbot.waitUntil(lambda: page.table.rowCount() == 1 and page.table.item(0, 1).text() == URL)
    assert page.table.item(0, 0).text() == "tiny-llama" and page.table.item(0, 3).text() == "serving on a CPU rank (simulated machine)"
    assert page.table.item(0, 2).text().endswith(("d", "h", "min"))  # up since `started`
    assert page.chat.url == URL and page.chat.model == "tiny-llama" and page.chat.message.isEnabled()
    page.copy_button.click()
    assert QApplication.clipboard().text() == URL
    page.stop_button.click()
    qtbot.waitUntil(lambda: bool(link.requests("cancel")))
    assert link.requests("cancel")[-1]["job"] == "s1"
    link.push_job({**a_serve_job(), "state": "cancelled"})
    qtbot.waitUntil(lambda: page.table.rowCount() == 0)
    assert page.empty.isVisible() and page.chat.url is None and not page.chat.message.isEnabled()


def test_serve_this_model_submits_a_serve_job_and_try_it_chats_once_it_listens(qtbot):
    link = FakeLink()
    jobs = FakeJobs(link, [a_training_job("t")])
    submitted: list[dict[str, Any]] = []

    def submit(spec: dict[str, Any], **_: Any) -> dict[str, Any]:
        submitted.append(spec)
        job = a_serve_job("s1", "starting")
        link.jobs.append(job)
        return {"job": job}

    link.replies["submit"] = submit
    page = open_page(qtbot, link)
    opened: list[str] = []
    page.sig_serving.connect(opened.append)
    open_job(qtbot, page, "t")
    page.detail.tabs.setCurrentIndex(TRY_TAB)
    box = page.detail.try_it
    assert box.serve_button.isVisible() and box.one_prompt.isVisible() and not box.chat.isVisible()
    assert page.detail.serve_action.isEnabled()
    page.detail.serve_action.trigger()
    qtbot.waitUntil(lambda: opened == ["s1"])
    assert submitted == [{"kind": "serve", "model": MODEL, "serve": {}, "name": "run t", "gpus": [0]}]
    link.push_job(a_serve_job("s1", "starting"))
    qtbot.waitUntil(lambda: "loading the model" in box.serve_line.text())
    assert not box.serve_button.isVisible()
    serving(link, jobs)
    link.push_job(a_serve_job("s1", "running"))
    qtbot.waitUntil(lambda: box.chat.isVisible())
    assert box.chat.url == URL and box.chat.model == "tiny-llama" and not box.one_prompt.isVisible()
    assert URL in box.serve_line.text()
    page.detail.serve_action.trigger()  # served already: its row, not a second server
    qtbot.waitUntil(lambda: opened == ["s1", "s1"])
    assert len(submitted) == 1
