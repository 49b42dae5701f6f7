"""Serving in the app, end to end: a real engine service (a subprocess on the simulated 4×RTX 4090) serves a tiny
random Llama as a "serve" job of one CPU rank, submitted with the spec the app's Serve action sends; the Serving
page finds it through a real EngineLink, and its chat streams from the real server, held to what the official
openai client gets for the same request. Stop serving cancels the job, and the chat then says the model is gone.
"Serve this model" and Try it are tested over a FakeLink.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import openai
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from rigpilot.app.engine_link import EngineLink
from rigpilot.app.jobs.detail import TRY_TAB
from rigpilot.app.serving.chat import ChatPanel
from rigpilot.app.serving.page import ServingPage
from rigpilot.app.serving.served import Listening, serve_spec, serving_url
from rigpilot.app.serving.stream import GONE, ChatError, stream_chat
from rigpilot.engine.cli.serve import _wait_for_url

from support.engine import Engine, engine_home, leftover_job_processes
from support.gui_fakes import FakeLink
from support.gui_jobs import FakeJobs, a_job, a_training_job, open_job, open_page
from support.paths import REPO
from support.worker_jobs import save_random_llama

MESSAGE = "Say something."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{"engine", "job", "url"}: the engine's serve job of a tiny Llama, listening."""
    mp = pytest.MonkeyPatch()
    base = tmp_path_factory.mktemp("engine")
    engine_home(base, mp)
    mp.setenv("PYTHONPATH", str(REPO))
    model = save_random_llama(base / "tiny", initializer_range=0.2)
    engine = Engine(base)
    engine.start()
    try:
        spec = serve_spec(str(model), [0], "tiny")
        spec["serve"] = {"precision": "fp32", "max_batch": 4, "max_concurrent": 5, "max_new_tokens": 64}
        with engine.client() as c:
            job = c.request("submit", spec=spec, plan=None)["job"]["id"]
            serving = _wait_for_url(c, job)
        assert serving, (base / "engine.log").read_text()[-4000:]
        url = serving["url"]
        yield {"engine": engine, "job": job, "url": url}
    finally:
        engine.stop()
        for p in leftover_job_processes(base):
            p.kill()
        mp.undo()


def chat_panel(qtbot, url: str, model: str = "tiny") -> ChatPanel:
    panel = ChatPanel()
    qtbot.addWidget(panel)
    panel.set_server(url, model)
    chat_greedily(panel)
    return panel


def chat_greedily(panel: ChatPanel) -> None:
    panel.temperature.setValue(0)
    panel.max_tokens.setValue(MAX_TOKENS)


def send(qtbot, panel: ChatPanel, text: str) -> Any:
    qtbot.keyClicks(panel.message, text)
    with qtbot.waitSignal(panel.sig_finished, timeout=60_000) as finished:
        qtbot.keyClick(panel.message, Qt.Key.Key_Return)
    return finished.args[0]


@pytest.fixture
def serving_page(qtbot, served):
    link = EngineLink()
    page = ServingPage(link)
    qtbot.addWidget(page)
    page.show()
    link.start()
    try:
        qtbot.waitUntil(lambda: page.table.rowCount() == 1 and page.table.item(0, 1).text() == served["url"],
                        timeout=30_000)  # fmt: skip
        yield page
    finally:
        link.stop()


@pytest.mark.slow  # the engine and its server: a worker process importing torch and loading the model
def test_the_served_model_is_listed_and_its_chat_streams_what_the_openai_client_gets(qtbot, served, serving_page):
    page = serving_page
    assert page.table.item(0, 0).text() == "tiny"
    assert page.table.item(0, 3).text() == "serving on a CPU rank (simulated machine)"
    assert page.chat.url == served["url"] and page.chat.model == "tiny"
    chat_greedily(page.chat)
    pieces: list[str] = []
    page.chat.sig_text.connect(pieces.append)
    reply = send(qtbot, page.chat, MESSAGE)

    client = openai.OpenAI(base_url=served["url"], api_key="unused-on-loopback", max_retries=0, timeout=60)
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
    assert page.chat.transcript.toPlainText() == f"You: {MESSAGE}\n\ntiny: {text}"
    status = page.chat.status.text()
    assert f"{usage.completion_tokens} token(s) generated for a prompt of {usage.prompt_tokens}" in status
    assert page.chat.messages[-1] == {"role": "assistant", "content": text}
    assert not page.chat.generating and page.chat.send_button.isEnabled()
    page.copy_button.click()
    assert QApplication.clipboard().text() == served["url"]


@pytest.mark.slow
def test_a_refused_message_is_one_line_and_leaves_the_conversation_as_it_was(qtbot, served):
    panel = chat_panel(qtbot, served["url"], model="not-served")
    error = send(qtbot, panel, "Hello")
    assert isinstance(error, ChatError)
    assert panel.status.text() == ("The server refused the message: the model 'not-served' is not served here; "
                                   "this server serves 'tiny'")  # fmt: skip
    assert panel.messages == []


@pytest.mark.slow
def test_stop_generating_ends_the_answer_at_once_and_the_next_message_is_answered(qtbot, served):
    panel = chat_panel(qtbot, served["url"])
    panel.max_tokens.setValue(64)
    qtbot.keyClicks(panel.message, "Tell me a long story.")
    with qtbot.waitSignal(panel.sig_finished, timeout=60_000) as finished:
        qtbot.keyClick(panel.message, Qt.Key.Key_Return)
        panel.stop_button.click()  # before the server has had a turn to answer
    reply = finished.args[0]
    assert reply.stopped and reply.finish_reason is None
    assert panel.status.text().startswith("Stopped generating") and not panel.stop_button.isEnabled()
    panel.max_tokens.setValue(MAX_TOKENS)
    assert send(qtbot, panel, "Hi").finish_reason in ("stop", "length")  # the chat goes on


@pytest.mark.slow  # last of the engine's tests: it stops the server
def test_stop_serving_cancels_the_job_and_the_chat_then_says_the_model_is_gone(qtbot, served, serving_page):
    panel = chat_panel(qtbot, served["url"])  # still open on the old URL once the page has moved on
    serving_page.stop_button.click()
    qtbot.waitUntil(lambda: serving_page.table.rowCount() == 0, timeout=60_000)
    with served["engine"].client() as c:
        assert c.request("job", job=served["job"])["job"]["state"] == "cancelled"
    assert serving_page.empty.isVisible() and not serving_page.chat.send_button.isEnabled()
    send(qtbot, panel, "Hi")
    assert panel.status.text() == "The model is no longer served."


def test_new_chat_drops_the_answer_still_coming(qtbot):
    panel = ChatPanel()
    qtbot.addWidget(panel)
    with socket.socket() as s:  # a server that takes the request and never answers
        s.bind(("127.0.0.1", 0))
        s.listen()
        panel.set_server(f"http://127.0.0.1:{s.getsockname()[1]}/v1", "tiny")
        qtbot.keyClicks(panel.message, "Hello")
        qtbot.keyClick(panel.message, Qt.Key.Key_Return)
        assert panel.generating and panel.messages == [{"role": "user", "content": "Hello"}]
        panel.new_button.click()
        assert not panel.generating and panel.messages == [] and panel.transcript.toPlainText() == ""
        assert panel.send_button.isEnabled() and not panel.stop_button.isEnabled()
        qtbot.wait(200)  # the dropped request's end, worded nowhere
        assert panel.status.text() == f"Chat with tiny at {panel.url}" and panel.messages == []


def test_a_model_no_longer_served_is_said_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ChatError) as e:
        stream_chat(f"http://127.0.0.1:{port}/v1", "tiny", [{"role": "user", "content": "Hi"}], lambda _t: None)
    assert e.value.reason == GONE


# -- the Serving page, "Serve this model", Try it (FakeLink) ------------------------------------------------------

URL = "http://127.0.0.1:43111/v1"
MODEL = "/tmp/rigpilot-jobs/t/output"  # a_training_job("t")'s model


def a_serve_job(job_id: str = "s1", state: str = "running") -> dict[str, Any]:
    job = a_job(job_id, state)
    job.update(kind="serve", name="tiny-llama", gpus=[0], started=time.time() - 3600, settings={"kind": "serve", "model": MODEL})
    return job


def serving(link: FakeLink, jobs: FakeJobs, job_id: str = "s1") -> None:
    jobs.records[job_id] = [
        {"kind": "status", "phase": "loading model", "rank": 0, "time": 1.0},
        {"kind": "status", "phase": "serving", "url": URL, "model": "tiny-llama", "rank": 0, "time": time.time() - 150},
    ]


def test_serving_url_is_the_serving_status():
    assert serving_url([{"kind": "status", "phase": "loading model"}]) is None
    found = serving_url([{"kind": "status", "phase": "serving", "url": URL, "model": "m", "time": 5.0}])
    assert found == Listening(URL, "m", 5.0)


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
    assert page.table.item(0, 2).text() == "2 min"  # up since it listened, not since the job started an hour ago
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
    # The job by its id: the engine serves what it trained (engine.jobs.serve_source), under the job's name.
    assert submitted == [{"kind": "serve", "model": "t", "serve": {}, "gpus": [0]}]
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
