"""Serving in the app, end to end: a real engine service (a subprocess on the simulated 4×RTX 4090) serves a tiny
random Llama as a "serve" job of one CPU rank, submitted with the spec the app's Serve action sends; the Serving
page finds it through a real EngineLink, and its chat streams from the real server, held to what the official
openai client gets for the same request. Stop serving cancels the job, and the chat then says the model is gone.
"Serve this model" and Try it are tested over a FakeLink.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import replace
from typing import Any

import numpy as np
import openai
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from rigpilot.app.engine_link import EngineLink
from rigpilot.app.jobs.detail import TRY_TAB
from rigpilot.app.jobs.serve_series import SERVE_FIELDS, with_idle
from rigpilot.app.serving.chat import ChatPanel
from rigpilot.app.serving.load import NO_REQUESTS, NOTHING_SELECTED, where
from rigpilot.app.serving.page import ServingPage
from rigpilot.app.serving.served import Listening, ServedJob, serve_spec, serving_url
from rigpilot.app.serving.stream import GONE, ChatError, stream_chat
from rigpilot.engine.cli.serve_wait import wait_for_url

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
            serving = wait_for_url(c, job)
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
    # The two answers show in the Load area: the server's "serve" records, read through the engine.
    qtbot.waitUntil(lambda: page.load.readout.text().startswith("Requests served: 2"), timeout=30_000)
    assert page.load.box.isVisible() and page.load.title.text() == "Load of tiny — simulated (CPU rank)"
    t, (tokens,) = page.load.charts["serveTokensChart"].data()
    assert len(t) and max(tokens) > 0


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


# -- the Load area: the selected served model's "serve" records as charts (FakeLink) ----------------------------


def load_record(t: float, requests: int, **figures: Any) -> dict[str, Any]:
    """A "serve" record as engine.workers.serve._Meter writes it."""
    rec = {"kind": "serve", "rank": 0, "run": 1, "step": None, "time": t, "requests": requests, "requests_per_s": 0.5,
           "tokens_per_s": 40.0, "time_to_first_token": 0.25, "queue_depth": 1, "running": 2, "dropped": 0,
           "kv_cache_bytes": 48 * 2**20, "peak_memory": 2**30}  # fmt: skip
    rec.update(figures)
    return rec


def test_idle_gaps_are_drawn_as_idle_and_a_server_idle_since_its_last_record_too():
    times = np.array([100.0, 102.0, 110.0])
    values = np.array([[1.0, 2.0, 3.0], [0.3, 0.2, 0.1]] * 3)[: len(SERVE_FIELDS)]
    t, v = with_idle(times, values, every=2.0)
    assert t.tolist() == [100.0, 102.0, 104.0, 108.0, 110.0]
    assert v[0].tolist() == [1.0, 2.0, 0.0, 0.0, 3.0]
    ttft = v[SERVE_FIELDS.index("time_to_first_token")]
    assert np.isnan(ttft[2])  # no request: no time to its token
    assert ttft[3:].tolist() == [3.0, 3.0]  # the mean over the period before 110: from its start, a line
    t, v = with_idle(times[:2], values[:, :2], until=120.0, every=2.0)
    assert t.tolist() == [100.0, 102.0, 104.0, 120.0] and v[0].tolist() == [1.0, 2.0, 0.0, 0.0]
    assert with_idle(times[:2], values[:, :2], until=103.0, every=2.0)[0].tolist() == [100.0, 102.0]


def test_the_load_says_where_the_model_runs():
    row = ServedJob("s1", "m", "", "running", None, URL, "m")
    assert where(replace(row, gpus=(1,))) == "GPU 1" and where(replace(row, gpus=(0, 1))) == "GPUs 0, 1"
    assert where(replace(row, gpus=(0,), simulated=True)) == "simulated (CPU rank)"


def load_page(qtbot, jobs_records: dict[str, list[dict[str, Any]]]) -> tuple[ServingPage, FakeLink]:
    link = FakeLink()
    serve_jobs = [a_serve_job(job_id) for job_id in jobs_records]
    jobs = FakeJobs(link, serve_jobs, page_records=2)  # several pages of history
    for job_id, records in jobs_records.items():
        serving(link, jobs, job_id)
        jobs.records[job_id] += records
    page = ServingPage(link)
    qtbot.addWidget(page)
    page.resize(1280, 800)
    page.show()
    link.connect_engine()
    qtbot.waitUntil(lambda: page.table.rowCount() == len(jobs_records) and page.selected() is not None
                    and page.selected().listening)  # fmt: skip
    return page, link


def chart(page: ServingPage, name: str) -> tuple[list[float], list[list[float]]]:
    t, values = page.load.charts[name].data()
    return t.tolist(), values.tolist()


def test_the_load_charts_show_the_history_then_append_live_records(qtbot):
    t0 = time.time() - 6
    history = [load_record(t0, 3, tokens_per_s=30.0, time_to_first_token=0.2),
               load_record(t0 + 2, 5, tokens_per_s=50.0, time_to_first_token=None, queue_depth=0, running=1),
               load_record(t0 + 4, 9, tokens_per_s=70.0, time_to_first_token=0.4, dropped=1, kv_cache_bytes=3 * 2**30)]  # fmt: skip
    page, link = load_page(qtbot, {"s1": history})
    load = page.load
    qtbot.waitUntil(lambda: len(chart(page, "serveTokensChart")[0]) == 3)
    assert link.watched == {"s1"} and load.box.isVisible() and not load.empty.isVisible()
    assert load.title.text() == "Load of tiny-llama — simulated (CPU rank)"
    t, (tokens,) = chart(page, "serveTokensChart")
    assert t == [t0, t0 + 2, t0 + 4] and tokens == [30.0, 50.0, 70.0]
    _, (ttft,) = chart(page, "serveTtftChart")
    assert ttft[0] == pytest.approx(200.0) and math.isnan(ttft[1]) and ttft[2] == pytest.approx(400.0)  # ms
    assert chart(page, "serveQueueChart")[1] == [[1.0, 0.0, 1.0], [2.0, 1.0, 2.0]]  # queued, running
    assert load.readout.text().startswith("Requests served: 9   dropped: 1   KV cache: 3.0 GiB")

    link.push_metrics("s1", [load_record(t0 + 6, 12, tokens_per_s=90.0)])
    qtbot.waitUntil(lambda: len(chart(page, "serveTokensChart")[0]) == 4)
    assert chart(page, "serveTokensChart")[1] == [[30.0, 50.0, 70.0, 90.0]]
    assert "Requests served: 12" in load.readout.text() and "KV cache: 48 MiB" in load.readout.text()


def test_selecting_another_served_model_switches_the_job_watched(qtbot):
    now = time.time()
    page, link = load_page(qtbot, {"s1": [load_record(now - 2, 1, tokens_per_s=11.0)],
                                   "s2": [load_record(now - 2, 4, tokens_per_s=22.0)]})  # fmt: skip
    qtbot.waitUntil(lambda: page.load.handle is not None and page.load.handle.history_loaded)
    first = page.load.handle.id
    other = "s2" if first == "s1" else "s1"
    assert link.watched == {first}
    page.select_job(other)
    assert link.watched == {other} and chart(page, "serveTokensChart")[0] == []  # the old job's points are gone
    qtbot.waitUntil(lambda: bool(chart(page, "serveTokensChart")[0]))
    assert chart(page, "serveTokensChart")[1][0][0] == (22.0 if other == "s2" else 11.0)
    link.push_metrics(first, [load_record(now, 2, tokens_per_s=99.0)])  # the old job's stream: not shown
    qtbot.wait(10)
    assert 99.0 not in chart(page, "serveTokensChart")[1][0]


def test_a_served_model_with_no_requests_yet_says_so_instead_of_empty_axes(qtbot):
    page, link = load_page(qtbot, {"s1": []})
    qtbot.waitUntil(lambda: page.load.empty.text() == NO_REQUESTS)
    assert page.load.empty.isVisible() and not page.load.box.isVisible() and not page.load.readout.isVisible()
    link.push_job({**a_serve_job(), "state": "cancelled"})
    qtbot.waitUntil(lambda: page.table.rowCount() == 0)
    assert page.load.empty.text() == NOTHING_SELECTED and link.watched == set()
