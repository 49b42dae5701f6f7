"""What finished jobs show on the Jobs page: inference completions, the summary, Try it, what to do with the
model, rename and delete, the settings that differ between compared runs, and readable numbers."""

from __future__ import annotations

import csv
import json
from typing import Any

import numpy as np
import pytest
from PySide6.QtCore import QRect, Qt
from PySide6.QtGui import QColor, QImage, QPainter, QPalette
from PySide6.QtWidgets import QApplication, QInputDialog, QMessageBox, QStyleFactory, QStyleOptionViewItem

from rigpilot.app.jobs.detail import CHARTS_TAB, RESULTS_TAB, SUMMARY_TAB, TRY_TAB
from rigpilot.app.jobs.model import PROGRESS
from rigpilot.app.jobs.outcome import eval_trend, load_snippets, model_of, settings_diff
from rigpilot.app.jobs.page import ProgressDelegate
from rigpilot.app.jobs.try_it import try_spec
from rigpilot.app.widgets.units import si
from rigpilot.engine.api.client import EngineError

from support.gui_fakes import FakeLink
from support.gui_jobs import GIB, FakeJobs, a_training_job, open_job, open_page, step_record
from support.gui_jobs import a_job as base_job


def a_job(job_id: str, state: str = "running", **fields: Any) -> dict[str, Any]:
    job = base_job(job_id, state)
    job.update(fields)
    return job


def an_inference_job(job_id: str, state: str = "completed") -> dict[str, Any]:
    return a_job(
        job_id, state, kind="infer", simulated=True,
        settings={"kind": "infer", "model": "/models/m", "gpus": [0, 1],
                  "infer": {"backend": "transformers", "backend_reason": "chosen automatically: simulated GPUs"}},
        output={"folder": f"/tmp/rigpilot-jobs/{job_id}/output", "model": None, "results": True},
        progress={"tokens_per_s": 14_719.0, "peak_memory_by_rank": {"0": 2 * GIB, "1": 3 * GIB}},
    )  # fmt: skip


COMPLETIONS = [
    {"index": 0, "prompt": "To be", "completion": " or not to be,\nthat is", "new_tokens": 6, "cut": False},
    {"index": 1, "prompt": 'Say "hi"', "completion": "\thi, there", "new_tokens": 3, "cut": False},
]


def serve_results(link: FakeLink, completions: list[dict[str, Any]] | BaseException = COMPLETIONS) -> None:
    def results(job: str, start: int = 0, limit: int = 1000, **_: Any) -> dict[str, Any]:
        if isinstance(completions, BaseException):
            raise completions
        page = completions[start : start + min(limit, 1)]  # one per page: the view must follow `more`
        return {"job": job, "results": page, "start": start, "more": start + len(page) < len(completions),
                "path": f"/tmp/rigpilot-jobs/{job}/output/results.jsonl", "size": 100, "state": "completed"}  # fmt: skip

    link.replies["results"] = results


# -- numbers ------------------------------------------------------------------------------------------------


def test_counts_and_rates_read_with_si_prefixes():
    assert si(14_719_000, "tokens/s") == "14.7M tokens/s"
    assert si(147_190) == "147k" and si(1234) == "1.23k" and si(950, "tokens/s") == "950 tokens/s"
    assert si(999_700) == "1M" and si(None) == "n/a"


@pytest.mark.parametrize("style", ["fusion", "windows"])
def test_progress_text_is_drawn_in_a_contrasting_colour_on_both_parts_of_the_bar(qtbot, monkeypatch, style):
    # Styles draw a bar's own text differently (Windows: beside the bar, out of a narrow cell): the delegate draws it.
    drawn_with = QStyleFactory.create(style)
    monkeypatch.setattr(QApplication, "style", staticmethod(lambda: drawn_with))
    link = FakeLink()
    FakeJobs(link, [a_job("a", progress={"fraction": 0.5, "step": 5, "max_steps": 10})])
    page = open_page(qtbot, link)
    index = page.proxy.index(0, PROGRESS)
    rect = QRect(0, 0, 400, 30)
    image = QImage(rect.size(), QImage.Format.Format_RGB32)
    image.fill(QColor("#808080"))
    option = QStyleOptionViewItem()
    option.rect = rect
    option.palette = QApplication.palette()
    painter = QPainter(image)
    ProgressDelegate().paint(painter, option, index)
    painter.end()
    text, on_bar = (
        option.palette.color(QPalette.ColorRole.Text),
        option.palette.color(QPalette.ColorRole.HighlightedText),
    )

    def has(color: QColor, x0: int, x1: int) -> bool:
        return any(image.pixelColor(x, y) == color for x in range(x0, x1) for y in range(rect.height()))

    # "50 % (5/10)" is centred, so it crosses the edge of the filled half: each part draws its own colour.
    assert has(on_bar, 150, 198) and has(text, 202, 250) and not has(text, 150, 198)

    def bluish(x0: int, x1: int, y: int) -> bool:
        return any((c := image.pixelColor(x, y)).blue() > c.red() + 40 for x in range(x0, x1))

    # Filled from the left, top to bottom (an upright bar fills from the bottom, under the text's top half).
    assert bluish(20, 60, 7) and bluish(20, 60, 23) and not bluish(340, 380, 7) and not bluish(340, 380, 23)


# -- inference ------------------------------------------------------------------------------------------------


def test_an_inference_job_shows_its_completions_speed_and_memory_not_training_charts(qtbot, tmp_path):
    link = FakeLink()
    jobs = FakeJobs(link, [a_training_job("t"), an_inference_job("i")])
    jobs.records["t"] = [step_record(s) for s in range(1, 6)]
    serve_results(link)
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    x, _ = page.detail.charts.loss_raw.getData()
    assert x is not None and len(x) == 5
    open_job(qtbot, page, "i")
    tabs = page.detail.tabs
    assert not tabs.isTabVisible(CHARTS_TAB) and tabs.isTabVisible(RESULTS_TAB) and tabs.currentIndex() == RESULTS_TAB
    x, _ = page.detail.charts.loss_raw.getData()
    assert x is None or len(x) == 0  # nothing of the training job stays behind
    view = page.detail.results
    qtbot.waitUntil(lambda: view.model.rowCount() == 2)
    assert [a["start"] for a in link.requests("results")] == [0, 1]
    assert "2 completions" in view.status.text()
    speed = view.speed.text()
    assert "14.7k tokens/s" in speed and "CPU rank 0 2.00 GiB" in speed and "CPU rank 1 3.00 GiB" in speed
    assert view.backend.text() == "Backend: transformers (Rigpilot's own generator) — chosen automatically: simulated GPUs"
    assert view.model.index(0, 2).data() == " or not to be,\nthat is"

    view.table.setFocus()
    view.table.selectRow(1)
    qtbot.keyClick(view.table, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier)
    copied = QApplication.clipboard().text()
    assert copied.splitlines()[0] == "#\tPrompt\tCompletion\tNew tokens"
    assert copied.splitlines()[1] == '2\t"Say ""hi"""\t"\thi, there"\t3'  # quoted: tabs stay inside the cell

    written = view.export("csv", str(tmp_path / "c.csv"))
    with written.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["index", "prompt", "completion", "new_tokens"] and rows[1][2] == " or not to be,\nthat is"
    written = view.export("jsonl", str(tmp_path / "c.jsonl"))
    back = [json.loads(line) for line in written.read_text().splitlines()]
    assert [b["completion"] for b in back] == [c["completion"] for c in COMPLETIONS]
    assert view.export("jsonl", str(tmp_path / "missing" / "c.jsonl")) is None  # one line, no traceback
    assert "Could not write" in page.status.text()


def test_completions_that_cannot_be_read_say_why_in_one_line(qtbot):
    link = FakeLink()
    FakeJobs(link, [an_inference_job("i")])
    serve_results(link, EngineError("user_error", "output/results.jsonl: line 3 is not valid JSON"))
    page = open_page(qtbot, link)
    open_job(qtbot, page, "i")
    status = page.detail.results.status
    qtbot.waitUntil(lambda: "line 3 is not valid JSON" in status.text())
    assert status.text().startswith("No completions to show:") and "\n" not in status.text()


def test_a_running_inference_job_waits_for_its_completions(qtbot):
    link = FakeLink()
    FakeJobs(link, [an_inference_job("i", "running")])
    serve_results(link)
    page = open_page(qtbot, link)
    open_job(qtbot, page, "i")
    assert "when the job has finished" in page.detail.results.status.text() and not link.requests("results")
    link.push_job({**link.jobs[0], "state": "completed"})
    qtbot.waitUntil(lambda: page.detail.results.model.rowCount() == 2)


# -- the summary ------------------------------------------------------------------------------------------------


def test_a_job_that_finishes_while_open_shows_what_it_saved(qtbot):
    # While it ran its output folder held no model; the `job` event of its end does not carry the folder.
    link = FakeLink()
    running = {**a_training_job("t"), "state": "running", "output": {"folder": "/tmp/o", "model": None}}
    FakeJobs(link, [running])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    assert "no model" in page.detail.summary_panel.model_note.text() or not page.detail.tabs.isTabVisible(SUMMARY_TAB)
    link.jobs[0] = a_training_job("t")  # what the engine's `job` answer says once it has ended
    link.sig_job.emit({"id": "t", "state": "completed"})  # the event alone, as the engine sends it
    qtbot.waitUntil(lambda: page.detail.tabs.isTabVisible(SUMMARY_TAB))
    qtbot.waitUntil(lambda: page.detail.tabs.isTabVisible(TRY_TAB))
    assert "/tmp/rigpilot-jobs/t/output" in page.detail.summary_panel.rows()["Saved to"]


def test_a_restarted_jobs_wall_time_adds_up_its_runs(qtbot):
    link = FakeLink()
    job = a_training_job("t")
    job["run"], job["wall_s"] = 2, 3720.0  # the engine's sum of both runs
    FakeJobs(link, [job])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    assert page.detail.summary_panel.rows()["Wall time"] == "1 h 02 min in 2 runs"


def test_eval_trend_flags_a_sustained_rise_only():
    steps = np.array([10.0, 20, 30, 40, 50])
    assert eval_trend(steps, np.array([2.0, 1.5, 1.4, 1.3, 1.25])) is None  # falling
    assert eval_trend(steps, np.array([2.0, 1.5, 1.4, 1.5, 1.35])) is None  # one bump, then better again
    assert eval_trend(steps, np.array([2.0, 1.5, 1.4, 1.41, 1.415])) is None  # within the margin: noise
    line = eval_trend(steps, np.array([2.0, 1.5, 1.4, 1.5, 1.6]))
    assert line is not None and "rising" in line and "best 1.4000 at step 30" in line and "14 %" in line
    assert eval_trend(steps[:2], np.array([1.0, 2.0])) is None  # too few evals to call it


def test_a_completed_training_job_summarises_its_run_and_how_to_load_its_model(qtbot):
    link = FakeLink()
    jobs = FakeJobs(link, [a_training_job("t")])
    evals = [(2, 2.0), (4, 1.5), (6, 1.4), (8, 1.5), (10, 1.6)]
    jobs.records["t"] = [step_record(s) for s in range(1, 11)] + [
        {"time": 1_700_000_000.0 + s + 0.5, "rank": 0, "step": s, "kind": "eval", "eval_loss": v} for s, v in evals
    ]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    detail = page.detail
    assert detail.tabs.isTabVisible(SUMMARY_TAB) and not detail.tabs.isTabVisible(RESULTS_TAB)
    rows = detail.summary_panel.rows()
    assert rows["Final eval loss"] == "1.6000 (step 10)" and rows["Best eval loss"] == "1.4000 (step 6)"
    assert rows["Held-out perplexity"] == "4.953 (step 10)"  # exp(1.6)
    assert not detail.compare_base.isHidden()  # "Compare with base model" is offered for a completed training job
    scratch = a_training_job("t", method="scratch")
    detail.compare_base.show_job(page.link, scratch)
    assert detail.compare_base.isHidden()  # trained from scratch: no base model to compare with
    detail.compare_base.show_job(page.link, a_training_job("t"))
    assert rows["Final train loss"].endswith("(step 10)")
    # 10 steps × micro-batch 2 × accumulation 4 × 2 data-parallel ranks × 64 tokens
    assert rows["Tokens processed"] == "10.2k (10 steps)"
    assert rows["Wall time"] == "1 h 02 min" and rows["Speed"] == "14.7M tokens/s"
    assert rows["Saved to"] == "/tmp/rigpilot-jobs/t/output"
    assert detail.summary_panel.warning.isVisibleTo(detail.summary_panel)
    assert "Eval loss is rising" in detail.summary_panel.warning.text()
    (snippet,) = [s.toPlainText() for s in detail.summary_panel.snippets]
    assert 'AutoModelForCausalLM.from_pretrained("/tmp/rigpilot-jobs/t/output")' in snippet
    compile(snippet, "snippet", "exec")


def test_load_snippets_match_what_the_engine_saved():
    lora = a_training_job("l", output="lora", merged=True, method="lora")
    (peft_title, peft), (_, merged) = load_snippets(lora)
    assert "peft" in peft_title and 'base = AutoModelForCausalLM.from_pretrained("org/base")' in peft
    assert 'PeftModel.from_pretrained(base, "/tmp/rigpilot-jobs/l/output")' in peft
    assert '"/tmp/rigpilot-jobs/l/output/merged"' in merged
    for code in (peft, merged):
        compile(code, "snippet", "exec")
    masked = a_training_job("m")
    masked["output"]["architectures"] = ["BertForMaskedLM"]
    assert "AutoModelForMaskedLM" in load_snippets(masked)[0][1]
    assert load_snippets(a_training_job("n", output=None)) == []


def test_the_model_a_job_offers_is_one_that_can_be_loaded():
    assert model_of(a_training_job("t")).path == "/tmp/rigpilot-jobs/t/output"
    assert model_of(a_training_job("m", output="lora", merged=True)).path == "/tmp/rigpilot-jobs/m/output/merged"
    adapter_only = model_of(a_training_job("l", output="lora"))
    assert adapter_only.path is None and "only its LoRA adapter" in adapter_only.why
    assert model_of(an_inference_job("i")).path == "/models/m"
    assert model_of(an_inference_job("r", "running")).path is None


# -- Try it and the model's actions ---------------------------------------------------------------------------------


def test_try_it_runs_one_prompt_on_the_trained_model_and_shows_the_completion(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_training_job("t")])
    submitted = []

    def submit(spec: dict[str, Any], **_: Any) -> dict[str, Any]:
        submitted.append(spec)
        return {"job": a_job("try1", "queued", kind="infer")}

    link.replies["submit"] = submit
    serve_results(link, [{"index": 0, "prompt": "Hello", "completion": " world", "new_tokens": 1, "cut": False}])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    box = page.detail.try_it
    assert page.detail.tabs.isTabVisible(TRY_TAB)
    page.detail.tabs.setCurrentIndex(TRY_TAB)
    assert box.isVisibleTo(page)
    qtbot.keyClicks(box.prompt, "Hello")
    qtbot.keyClick(box.prompt, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: box.running == "try1")
    (spec,) = submitted
    assert spec == try_spec("/tmp/rigpilot-jobs/t/output", "Hello", link.jobs[0])  # the wizard's own builder
    assert spec["kind"] == "infer" and spec["model"] == "/tmp/rigpilot-jobs/t/output"
    assert spec["infer"]["prompts"] == ["Hello"] and spec["gpus"] == [0] and spec["infer"]["precision"] == "fp32"
    link.push_job(a_job("try1", "completed", kind="infer"))
    qtbot.waitUntil(lambda: box.completion() == " world")
    assert link.requests("results")[-1]["job"] == "try1"


def try_hi(qtbot, completion: dict[str, Any]) -> tuple[Any, Any, FakeLink]:
    """The Try it tab of a finished training job, "Hi" sent and its job (try1) running; `completion` its result."""
    link = FakeLink()
    FakeJobs(link, [a_training_job("t")])
    link.replies["submit"] = lambda spec, **_: {"job": a_job("try1", "queued", kind="infer")}
    serve_results(link, [{"index": 0, "prompt": "Hi", "cut": False, **completion}])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    box = page.detail.try_it
    page.detail.tabs.setCurrentIndex(TRY_TAB)
    qtbot.keyClicks(box.prompt, "Hi")
    qtbot.keyClick(box.prompt, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: box.running == "try1")
    return page, box, link


def test_try_it_says_so_when_the_model_answers_with_blank_space_only(qtbot):
    page, box, link = try_hi(qtbot, {"completion": "\n\n ", "new_tokens": 3})
    link.push_job(a_job("try1", "completed", kind="infer"))
    qtbot.waitUntil(lambda: box.output.isVisibleTo(page))
    assert "3 token(s) of blank space only" in box.status.text()
    assert box.output.toPlainText() == "⏎\n⏎\n·"


def test_try_it_marks_an_answer_that_is_mostly_blank_space_and_says_why_it_stopped(qtbot):
    from rigpilot.app.jobs.try_it import shown_completion

    answer = "s" + "\n" * 62
    page, box, link = try_hi(qtbot, {"completion": answer, "new_tokens": 63, "stop_reason": "max_tokens"})
    link.push_job(a_job("try1", "completed", kind="infer"))
    qtbot.waitUntil(lambda: box.output.isVisibleTo(page))
    assert box.status.text() == (
        "Completion from job try1: 63 token(s), mostly blank space: 1 visible character, 62 line breaks "
        "(shown as ⏎, · and →); stopped: it reached the new-token limit."
    )
    assert box.output.toPlainText() == "s" + "⏎\n" * 62 and box.completion() == answer
    # An ordinary answer is shown as it is; an old engine's result without a stop reason says none.
    assert shown_completion("To be, or not to be", 6) == ("To be, or not to be", "6 token(s)")


def test_try_it_shows_the_completion_as_it_streams_then_the_final_one(qtbot):
    _, box, link = try_hi(qtbot, {"completion": " there, friend", "new_tokens": 4, "stop_reason": "end_of_sequence"})
    assert "try1" in link.watched  # its metrics stream in
    link.push_metrics("try1", [{"kind": "partial", "index": 0, "text": " there"}, {"kind": "status", "phase": "x"}])
    assert box.output.toPlainText() == " there" and "generating" in box.status.text()
    link.push_metrics("other", [{"kind": "partial", "index": 0, "text": "!!"}])  # another job's: not ours
    link.push_metrics("try1", [{"kind": "partial", "index": 0, "text": ","}])
    link.push_metrics("try1", [{"kind": "partial", "index": 0, "text": " there, fr", "again": True}])
    assert box.output.toPlainText() == " there, fr"
    link.push_job(a_job("try1", "completed", kind="infer"))
    qtbot.waitUntil(lambda: box.completion() == " there, friend")
    assert "try1" not in link.watched and box.status.text().endswith("stopped: the model ended its answer.")


def test_try_it_is_offered_only_for_a_model_that_can_run(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_training_job("l", output="lora"), a_job("r", "running", kind="train")])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "l")
    assert not page.detail.tabs.isTabVisible(TRY_TAB) and not page.detail.use_button.isEnabled()
    assert "only its LoRA adapter" in page.detail.use_button.toolTip()


def test_plan_infer_and_finetune_from_the_model(qtbot, monkeypatch):
    link = FakeLink()
    FakeJobs(link, [a_training_job("t", method="scratch")])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    planned = []
    page.sig_plan_model.connect(planned.append)
    page.detail.plan_action.trigger()
    assert planned == ["/tmp/rigpilot-jobs/t/output"]
    opened = []
    monkeypatch.setattr(page, "_open_wizard", opened.append)
    page.detail.infer_action.trigger()
    page.detail.finetune_action.trigger()
    infer, train = opened
    assert (infer["kind"], infer["model"], infer["gpus"]) == ("infer", "/tmp/rigpilot-jobs/t/output", [0, 1])
    assert train["kind"] == "train" and train["model"] == "/tmp/rigpilot-jobs/t/output"
    assert train["train"]["method"] == "lora" and train["train"]["dataset"] == ["shakespeare.txt"]


def test_the_wizard_opens_preset_with_the_model(qtbot, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    from rigpilot.app.wizard.state import FINETUNE, INFER

    link = FakeLink()
    FakeJobs(link, [a_training_job("t")])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    page.detail.finetune_action.trigger()
    wizard = page._wizard
    assert wizard is not None
    qtbot.addWidget(wizard)
    assert (wizard.state.kind, wizard.state.model) == (FINETUNE, "/tmp/rigpilot-jobs/t/output")
    assert wizard.state.method == "full" and wizard.state.dataset == ["shakespeare.txt"]
    page.detail.infer_action.trigger()
    qtbot.addWidget(page._wizard)
    assert (page._wizard.state.kind, page._wizard.state.model) == (INFER, "/tmp/rigpilot-jobs/t/output")


def test_main_window_routes_plan_from_this_model_to_the_planner(qtbot, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    from rigpilot.app.main_window import MainWindow

    link = FakeLink()
    window = MainWindow(link)
    qtbot.addWidget(window)
    window.pages["jobs"].sig_plan_model.emit("/tmp/some/model")
    assert window.current_page_key() == "planner"
    assert window.pages["planner"].picker.model() == "/tmp/some/model"


# -- rename, delete, the context menu, keys ----------------------------------------------------------------------


def test_rename_by_f2_shows_the_new_name_everywhere(qtbot, monkeypatch):
    link = FakeLink()
    FakeJobs(link, [a_training_job("t"), a_training_job("u")])

    def rename(job: str, name: str) -> dict[str, Any]:
        rec = next(j for j in link.jobs if j["id"] == job)
        rec["name"] = name
        return {"job": rec}

    link.replies["rename"] = rename
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("  baseline  ", True))
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    page.compare_with("u")
    page.table.setFocus()
    qtbot.keyClick(page.table, Qt.Key.Key_F2)
    assert link.requests("rename") == [{"job": "t", "name": "baseline"}]
    qtbot.waitUntil(lambda: page.detail.title.text().startswith("baseline"))
    row = page.model.row_of("t")
    assert page.model.index(row, 0).data() == "baseline  (t)"
    page.open_job("u")
    box = page.detail.compare.box
    assert box.findText("baseline (t)") >= 0


def test_rename_refused_by_the_engine_says_why(qtbot, monkeypatch):
    link = FakeLink()
    FakeJobs(link, [a_training_job("t")])
    link.replies["rename"] = EngineError("user_error", "a job's name is one line of printable characters")
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("x", True))
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    page.rename_job()
    qtbot.waitUntil(lambda: "one line of printable" in page.status.text())
    assert page.status.text().startswith("Could not rename job t:")


@pytest.mark.parametrize("answer", [QMessageBox.StandardButton.Yes, QMessageBox.StandardButton.Cancel])
def test_delete_key_asks_then_deletes(qtbot, monkeypatch, answer):
    link = FakeLink()
    FakeJobs(link, [a_training_job("t"), a_job("r", "running")])
    link.replies["delete"] = lambda job: {"id": job, "deleted": True}
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: answer)
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    page.table.setFocus()
    qtbot.keyClick(page.table, Qt.Key.Key_Delete)
    if answer == QMessageBox.StandardButton.Yes:
        qtbot.waitUntil(lambda: page.model.row_of("t") is None)
        assert link.requests("delete") == [{"job": "t"}] and page.current_job_id is None
    else:
        assert not link.requests("delete") and page.model.row_of("t") is not None
    open_job(qtbot, page, "r")
    assert not page.detail.delete_button.isEnabled()
    page.delete_job()  # a running job: one line, nothing asked of the engine
    assert "cancel it before deleting it" in page.status.text()


def test_context_menu_offers_the_jobs_actions(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_training_job("t"), a_job("r", "running")])
    page = open_page(qtbot, link)
    menu = page.context_menu("t")
    assert page.current_job_id == "t"
    actions = {a.text().split("\t")[0]: a.isEnabled() for a in menu.actions() if a.text()}
    assert actions["&Plan from this model"] and actions["&Infer from this model…"] and actions["Re&name…"]
    assert actions["&Delete…"] and not actions["&Cancel job"]
    menu = page.context_menu("r")
    actions = {a.text().split("\t")[0]: a.isEnabled() for a in menu.actions() if a.text()}
    assert actions["&Cancel job"] and not actions["&Delete…"] and not actions["&Plan from this model"]


def test_enter_in_the_list_opens_the_job(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_training_job("t"), a_training_job("u")])
    page = open_page(qtbot, link)
    page._selecting = True  # move the cursor without opening, as a keyboard user's arrows might while busy
    page.table.setCurrentIndex(page.proxy.mapFromSource(page.model.index(page.model.row_of("u"), 0)))
    page._selecting = False
    page.table.setFocus()
    qtbot.keyClick(page.table, Qt.Key.Key_Return)
    assert page.current_job_id == "u"


# -- comparing ---------------------------------------------------------------------------------------------------


def test_comparing_runs_shows_only_the_settings_that_differ(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_training_job("a"), a_training_job("b", learning_rate=1e-4, seq_len=128)])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "a")
    assert not page.detail.diff.isVisibleTo(page)
    assert page.compare_with("b")
    diff = page.detail.diff
    qtbot.waitUntil(lambda: diff.rowCount() == 2)
    labels = [diff.verticalHeaderItem(r).text() for r in range(diff.rowCount())]
    assert labels == ["Sequence length", "Learning rate"]  # in the order the settings are declared
    assert [diff.item(1, c).text() for c in range(2)] == ["0.0002", "0.0001"]
    assert diff.horizontalHeaderItem(1).text() == "run b (b)"
    page.compare_with(None)
    assert not diff.isVisibleTo(page)


def test_three_runs_compared_by_the_context_menu(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_training_job("a"), a_training_job("b", seq_len=128), a_training_job("c", method="lora")])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "a")
    for job_id in ("b", "c"):
        menu = page.context_menu(job_id)
        page.open_job("a")  # the menu opened b or c; the comparison is of the shown job with the added ones
        next(a for a in menu.actions() if a.text() == "Add to settings co&mparison").trigger()
    diff = page.detail.diff
    qtbot.waitUntil(lambda: diff.columnCount() == 3)
    labels = [diff.verticalHeaderItem(r).text() for r in range(diff.rowCount())]
    assert labels == ["Method", "Sequence length"]
    assert [diff.item(1, c).text() for c in range(3)] == ["64", "128", "64"]
    page.clear_comparison()
    assert not diff.isVisibleTo(page)


def test_settings_diff_of_three_runs_and_layouts():
    runs = [a_training_job("a"), a_training_job("b"), a_training_job("c", method="lora")]
    runs[1]["settings"]["parallelism"] = {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1}
    diff = dict(settings_diff(runs))
    assert diff == {"Method": ["full", "full", "lora"], "Layout": ["DP 2", "FSDP 2", "DP 2"]}
    assert settings_diff(runs[:1] * 2) == []


def test_a_new_declared_setting_is_compared_and_an_older_job_reads_as_its_default():
    runs = [a_training_job("a"), a_training_job("b")]
    runs[1]["settings"]["train"]["master_weights"] = "bf16"
    runs[0]["settings"]["train"].pop("master_weights", None)  # a job from before the setting existed
    assert dict(settings_diff(runs)) == {"Master weights": ["fp32", "bf16"]}
