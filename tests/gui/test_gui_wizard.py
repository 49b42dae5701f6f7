"""The job wizard: walking its pages, inline validation, overrides re-checked live, and what it submits."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest
from PySide6.QtWidgets import QMainWindow, QWidget, QWizard

from rigpilot.app.widgets.window_size import small_screen_size
from rigpilot.app.wizard.data_check import (
    CHAT,
    INSTRUCTION,
    JSONL_TEXT,
    TEXT,
    DataReport,
    FileReport,
    inspect_dataset,
    inspect_file,
)
from rigpilot.app.wizard.page_base import DATA, GPUS, HYPER, LAUNCH, MODEL, PLAN, REVIEW, TASK
from rigpilot.app.wizard.pages_plan import FROM_PLAN
from rigpilot.app.wizard.state import (
    EXAMPLES,
    TINY_DATA,
    TINY_MODEL,
    WizardState,
    default_state,
    examples_present,
    state_from_plan,
    state_from_spec,
)
from rigpilot.app.wizard.wizard import SETTINGS_KEY, JobWizard
from rigpilot.engine.api.client import EngineError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobspec.spec import JobSpec

from support.gui_fakes import accept_submissions, focusable_widgets, make_job, real_plan_reply, tab_through
from support.gui_wizard import blocked, go_to, make_link, next_page, open_wizard, searches, settled
from support.paths import REPO

ALL_PAGES = [TASK, MODEL, DATA, GPUS, PLAN, HYPER, REVIEW, LAUNCH]


@pytest.mark.skipif(not examples_present(), reason="the shipped examples are missing")
def test_defaults_walk_every_page_and_submit_the_tiny_example(qtbot, settings):
    link, submitted = make_link()
    wizard = open_wizard(qtbot, link, settings)
    seen = [wizard.currentId()]
    with qtbot.waitSignal(wizard.sig_submitted, timeout=20000) as done:
        while wizard.currentId() != LAUNCH:
            seen.append(next_page(qtbot, wizard))
    assert seen == ALL_PAGES
    assert done.args == ["job-new"] and not wizard.isVisible()

    sent = submitted[-1]
    spec = JobSpec.from_dict(sent["spec"])
    assert spec.to_dict() == JobSpec.from_dict(spec.to_dict()).to_dict()
    assert spec.kind == "train" and spec.train.method == "scratch"
    assert spec.model == str(EXAMPLES / TINY_MODEL)
    assert spec.train.dataset == [str(EXAMPLES / TINY_DATA)]
    assert spec.train.max_steps <= 50 and spec.train.seq_len <= 256 and spec.train.precision == "fp32"
    # Two CPU ranks on a simulated machine, laid out as the plan says.
    assert spec.gpus == sent["plan"]["parallelism"]["gpu_indices"] and len(spec.gpus) == 2
    assert spec.parallelism.world_size == len(spec.gpus)
    assert spec.train.micro_batch == sent["plan"]["parallelism"]["micro_batch"]
    assert sent["cwd"]
    assert json.loads(settings.value(SETTINGS_KEY))["kind"] == "scratch"


def test_back_keeps_every_choice(qtbot, settings):
    link, _ = make_link()
    wizard = open_wizard(qtbot, link, settings, state=default_state(link.machine))
    wizard.task_page.buttons["finetune"].click()
    next_page(qtbot, wizard)
    wizard.model_page.picker.set_model("qwen2.5-0.5b")
    wizard.model_page.method.setCurrentIndex(wizard.model_page.method.findData("full"))
    go_to(qtbot, wizard, HYPER)
    wizard.hyper_page.steps.setValue(42)
    wizard.hyper_page.lr.setValue(3e-5)
    wizard.hyper_page.seed.setValue(7)
    # The example is plain text: no prompts to leave out, so the choice is not offered; chat data offers it.
    hyper = wizard.hyper_page
    assert not hyper.prompts_row.isVisibleTo(hyper)
    text_report = wizard.data_page.report
    wizard.data_page.report = DataReport([FileReport("chat.jsonl", kind=CHAT)])
    hyper.load()
    assert hyper.prompts_row.isVisibleTo(hyper)
    wizard.data_page.report = text_report
    hyper.load()
    wizard.hyper_page.keep_checkpoints.setValue(0)
    wizard.hyper_page.train_on_prompts.setChecked(True)
    assert wizard.state.train.keep_checkpoints == 0 and wizard.state.train.train_on_prompts
    words = shlex.split(wizard.state.command().splitlines()[0])
    assert "--train-on-prompts" in words and "Keep checkpoints: all" in wizard.state.command()
    for expected in (PLAN, GPUS, DATA, MODEL, TASK):
        wizard.back()
        assert wizard.currentId() == expected
    assert wizard.task_page.buttons["finetune"].isChecked()
    go_to(qtbot, wizard, MODEL)
    assert wizard.model_page.picker.model() == "qwen2.5-0.5b"
    assert wizard.model_page.method.currentData() == "full"
    go_to(qtbot, wizard, HYPER)
    assert (wizard.hyper_page.steps.value(), wizard.hyper_page.seed.value()) == (42, 7)
    assert wizard.hyper_page.train_on_prompts.isChecked() and wizard.hyper_page.keep_checkpoints.text() == "all"
    assert wizard.hyper_page.lr.value() == pytest.approx(3e-5)
    # Going back and forth with nothing changed keeps the plan: it is not asked for again.
    assert len(searches(link)) == 1


def test_model_page_blocks_with_the_reason(qtbot, settings, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    link, _ = make_link()
    wizard = open_wizard(qtbot, link, settings, state=WizardState(kind="finetune"))
    go_to(qtbot, wizard, MODEL)
    blocked(qtbot, wizard, "Choose a model")
    wizard.model_page.picker.set_model(str(tmp_path / "nowhere"))
    blocked(qtbot, wizard, "no such folder")
    empty = tmp_path / "empty-model"
    empty.mkdir()
    wizard.model_page.picker.set_model(str(empty))
    blocked(qtbot, wizard, "config.json")
    wizard.model_page.picker.set_model("llama-3.1-8b")
    page = settled(qtbot, wizard)
    assert page.isComplete() and "8.0B parameters" in wizard.model_page.about.text()


def test_data_page_blocks_with_the_reason(qtbot, settings, tmp_path):
    link, _ = make_link()
    state = default_state(link.machine)
    state.dataset = []
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, DATA)
    blocked(qtbot, wizard, "Add at least one data file")
    data = wizard.data_page
    data.add_files([str(tmp_path / "missing.txt")])
    blocked(qtbot, wizard, "does not exist")
    data.files.setCurrentRow(0)
    data.remove_button.click()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    data.add_files([str(empty)])
    blocked(qtbot, wizard, "empty.jsonl is empty")
    data.files.setCurrentRow(0)
    data.remove_button.click()
    other = tmp_path / "notes.jsonl"
    other.write_text('{"body": "hello there", "id": 1}\n{"body": "general kenobi", "id": 2}\n')
    data.add_files([str(other)])
    blocked(qtbot, wizard, "no 'text' text field")
    # The fields found are offered; picking the right one unblocks the page.
    assert data.text_field.findText("body") >= 0
    data.text_field.setCurrentText("body")
    page = settled(qtbot, wizard)
    assert page.isComplete() and wizard.state.text_field == "body"
    assert "hello there" in data.preview.toPlainText()
    assert "estimate" in data.summary.text()


def test_gpu_page_blocks_on_no_gpu_and_busy_gpus_unless_queued(qtbot, settings):
    link, _ = make_link(jobs=[make_job("j1", gpus=[0], name="bert-ft")])
    state = default_state(link.machine)
    state.gpus = [0, 1]
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, DATA)
    wizard.next()
    assert wizard.currentId() == GPUS
    blocked(qtbot, wizard, "GPU 0 runs bert-ft")
    assert "busy" in wizard.gpu_page.selector.boxes[0].text()
    wizard.gpu_page.queue.click()
    page = settled(qtbot, wizard)
    assert page.isComplete() and "waits" in page.message.text()
    wizard.gpu_page.selector.set_selected([])
    blocked(qtbot, wizard, "Select at least one GPU")
    wizard.gpu_page.selector.boxes[2].click()
    assert settled(qtbot, wizard).isComplete() and wizard.state.gpus == [2]


def test_plan_page_rechecks_overrides_and_blocks_what_does_not_fit(qtbot, settings):
    link, _ = make_link("4x-rtxa6000-bridged")
    state = default_state(link.machine)
    state.kind, state.model, state.method = "finetune", "llama-2-7b", "lora"
    state.set_precision("bf16")
    state.train.seq_len, state.global_batch, state.gpus = 2048, 16, [0, 1, 2, 3]
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, PLAN)
    plan_page = wizard.plan_page
    recommended = wizard.state.plan
    assert recommended is not None and plan_page.alternatives.count() >= 2

    plan_page.micro.setValue(64)  # far too many sequences at once
    blocked(qtbot, wizard, "Does not fit")
    # Re-checked by the engine's planner (the `plan` request's recheck), not by a second planner in the GUI.
    asked = link.requests("plan")[-1]
    assert asked["recheck"]["overrides"]["micro_batch"] == 64 and asked["recheck"]["plan"] == plan_page.base
    assert plan_page.chart.memory == wizard.state.plan["memory"]
    assert wizard.state.plan["parallelism"]["micro_batch"] == 64

    plan_page.checkpointing.setCurrentIndex(plan_page.checkpointing.findData("full"))
    plan_page.micro.setValue(1)
    page = settled(qtbot, wizard)
    assert page.isComplete() and "fit" in page.message.text()
    assert wizard.state.plan["parallelism"]["checkpointing"] == "full"

    plan_page.tp.setValue(3)
    blocked(qtbot, wizard, "GPUs, but 4 are selected")
    # Without the engine nothing is re-checked, and the page says so rather than guessing.
    link.lose_engine()
    asked = len(link.requests("plan"))
    plan_page.tp.setValue(1)
    page = settled(qtbot, wizard)
    assert "Not re-checked: the engine is not connected" in page.message.text() and len(link.requests("plan")) == asked
    link.connect_engine()
    plan_page.reset_button.click()
    assert settled(qtbot, wizard).isComplete()
    assert wizard.state.plan["parallelism"] == plan_page.base["parallelism"]

    # The hyper-parameters page re-checks its own changes with the same model.
    go_to(qtbot, wizard, HYPER)
    wizard.hyper_page.micro.setValue(64)
    blocked(qtbot, wizard, "Does not fit")
    wizard.hyper_page.micro.setValue(1)
    assert settled(qtbot, wizard).isComplete()
    assert wizard.state.train.micro_batch == 1 == wizard.state.plan["parallelism"]["micro_batch"]


def test_plan_page_blocks_when_nothing_fits(qtbot, settings):
    link, _ = make_link("1x-rtx4090")
    state = WizardState(kind="finetune", model="llama-3.1-70b", method="full", gpus=[0])
    state.dataset = [str(EXAMPLES / TINY_DATA)]
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, GPUS)
    wizard.next()
    blocked(qtbot, wizard, "Nothing fits")


def test_script_job_skips_data_and_plan(qtbot, settings, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    link, submitted = make_link()
    wizard = open_wizard(qtbot, link, settings, state=default_state(link.machine))
    wizard.task_page.buttons["script"].click()
    assert next_page(qtbot, wizard) == MODEL
    blocked(qtbot, wizard, "Choose the script")
    wizard.model_page.script.setText(str(tmp_path / "missing.py"))
    blocked(qtbot, wizard, "does not exist")
    wizard.model_page.script.setText(str(script))
    wizard.model_page.script_args.setText('--epochs 2 --name "my run')
    blocked(qtbot, wizard, "check the quotes")
    wizard.model_page.script_args.setText('--epochs 2 --name "my run"')
    assert next_page(qtbot, wizard) == GPUS
    assert next_page(qtbot, wizard) == REVIEW
    command = wizard.review_page.command.toPlainText()
    assert shlex.split(command)[-6:] == ["--", str(script), "--epochs", "2", "--name", "my run"]
    with qtbot.waitSignal(wizard.sig_submitted, timeout=10000):
        next_page(qtbot, wizard)
    spec = JobSpec.from_dict(submitted[-1]["spec"])
    assert spec.kind == "script" and spec.script == [str(script), "--epochs", "2", "--name", "my run"]
    assert submitted[-1]["plan"] is None and spec.model is None


def test_calibration_needs_only_gpus(qtbot, settings):
    link, submitted = make_link()
    wizard = open_wizard(qtbot, link, settings, state=default_state(link.machine))
    wizard.task_page.buttons["calibrate"].click()
    assert next_page(qtbot, wizard) == GPUS
    assert next_page(qtbot, wizard) == REVIEW
    with qtbot.waitSignal(wizard.sig_submitted, timeout=10000):
        next_page(qtbot, wizard)
    assert JobSpec.from_dict(submitted[-1]["spec"]).kind == "calibrate"


def test_inference_job_with_typed_prompts(qtbot, settings):
    link, submitted = make_link("2x-rtx3090-nvlink")
    state = WizardState(kind="infer", model="qwen2.5-0.5b", gpus=[0, 1])
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, DATA)
    blocked(qtbot, wizard, "Give a prompts file or type at least one prompt")
    wizard.data_page.prompts.setPlainText("Write a haiku about GPUs\n\nName three rivers")
    go_to(qtbot, wizard, HYPER)
    assert wizard.state.plan["workload"]["task"] == "infer"
    wizard.hyper_page.new_tokens.setValue(wizard.hyper_page.context.value())
    blocked(qtbot, wizard, "room for the prompt")
    wizard.hyper_page.new_tokens.setValue(48)
    with qtbot.waitSignal(wizard.sig_submitted, timeout=20000):
        go_to(qtbot, wizard, LAUNCH)
    spec = JobSpec.from_dict(submitted[-1]["spec"])
    assert spec.kind == "infer" and spec.infer.prompts == ["Write a haiku about GPUs", "Name three rivers"]
    assert spec.infer.max_new_tokens == 48 and spec.train is None


def test_the_engine_choice_of_an_inference_job_reaches_the_spec_and_the_engines_check(qtbot, settings):
    link, submitted = make_link("2x-rtx3090-nvlink")
    state = WizardState(kind="infer", model="qwen2.5-0.5b", gpus=[0, 1], prompts=["Write a haiku about GPUs"])
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, HYPER)
    engine = wizard.hyper_page.backend
    assert engine.isVisibleTo(wizard) and engine.currentData() == "auto"
    engine.setCurrentIndex(engine.findData("vllm"))
    assert wizard.state.infer.backend == "vllm" and "--backend vllm" in wizard.state.command()
    go_to(qtbot, wizard, REVIEW)
    # The engine's own check (the real submission path) refuses vLLM on simulated GPUs, in its words.
    blocked(qtbot, wizard, "backend vllm: the machine's GPUs are simulated")
    wizard.next()
    assert not submitted


def test_submit_failure_is_inline_and_can_be_retried(qtbot, settings):
    link, _ = make_link()
    link.replies["submit"] = EngineError("user_error", "data file /x.txt does not exist")
    wizard = open_wizard(qtbot, link, settings, state=WizardState(kind="calibrate", gpus=[0]))
    with qtbot.waitSignal(wizard.sig_submit_failed, timeout=10000) as failed:
        go_to(qtbot, wizard, LAUNCH)
    assert failed.args == ["data file /x.txt does not exist"]
    blocked(qtbot, wizard, "data file /x.txt does not exist")
    assert wizard.launch_page.retry.isVisible() and wizard.isVisible()
    accept_submissions(link, "job-2")
    with qtbot.waitSignal(wizard.sig_submitted, timeout=10000) as done:
        wizard.launch_page.retry.click()
    assert done.args == ["job-2"]


def test_submitting_lands_on_the_jobs_page(qtbot, settings):
    class JobsPage(QWidget):
        def __init__(self):
            super().__init__()
            self.opened: list[str] = []

        def open_job(self, job_id: str) -> None:
            self.opened.append(job_id)

    class Main(QMainWindow):
        def __init__(self):
            super().__init__()
            self.jobs = JobsPage()
            self.shown: list[str] = []
            self.setCentralWidget(QWidget())

        def show_page(self, key: str) -> QWidget:
            self.shown.append(key)
            return self.jobs

    main = Main()
    qtbot.addWidget(main)
    link, _ = make_link()
    wizard = JobWizard(link, main.centralWidget(), state=WizardState(kind="calibrate", gpus=[1]), settings=settings)
    wizard.show()
    with qtbot.waitSignal(wizard.sig_submitted, timeout=10000):
        go_to(qtbot, wizard, LAUNCH)
    assert main.shown == ["jobs"] and main.jobs.opened == ["job-new"]


def test_from_plan_and_from_job_fill_the_wizard(qtbot, settings, tmp_path):
    link, _ = make_link("8x-h100-sxm")
    plan = real_plan_reply(link.machine_obj)(
        model="qwen2.5-7b",
        workload={"task": "train", "method": "lora", "seq_len": 1024, "global_batch": 8, "lora": None},
        gpus=[4, 5, 6, 7],
    )["result"]["best"]
    wizard = JobWizard.from_plan(plan, link=link, settings=settings)
    qtbot.addWidget(wizard)
    s = wizard.state
    assert (s.kind, s.model, s.method, s.gpus, s.train.seq_len) == (
        "finetune",
        "qwen2.5-7b",
        "lora",
        [4, 5, 6, 7],
        1024,
    )
    assert s.plan == plan and s.plan_is_current()
    assert s.to_spec()["gpus"] == plan["parallelism"]["gpu_indices"]

    spec = s.to_spec()
    clone = JobWizard.from_job({"id": "abc", "spec": spec, "plan": plan}, link=link, settings=settings)
    qtbot.addWidget(clone)
    assert clone.state.to_spec() == spec

    folder = tmp_path / "jobs" / "abc"
    folder.mkdir(parents=True)
    (folder / "job.json").write_text(json.dumps({**spec, "id": "abc"}))
    (folder / "plan.json").write_text(json.dumps(plan))
    record = make_job("abc", gpus=spec["gpus"], state="failed", name=spec["name"])
    record["job_dir"] = str(folder)
    later = JobWizard.from_job(record, link=link, settings=settings)
    qtbot.addWidget(later)
    qtbot.waitUntil(lambda: later.state.model == "qwen2.5-7b")
    assert later.state.to_spec() == spec and later.state.plan == plan


def test_last_choices_are_remembered(qtbot, settings):
    link, _ = make_link()
    state = default_state(link.machine)
    state.train.max_steps, state.name = 24, "remember me"
    wizard = open_wizard(qtbot, link, settings, state=state)
    with qtbot.waitSignal(wizard.sig_submitted, timeout=30000):
        go_to(qtbot, wizard, LAUNCH)
    again = open_wizard(qtbot, link, settings)
    assert again.state.train.max_steps == 24 and again.state.name == "remember me"
    assert again.state.plan is None  # plans are made again for the machine of the day


def test_every_page_fits_the_window_and_tab_reaches_every_control(qtbot, settings):
    link, _ = make_link("8x-h100-sxm")
    state = default_state(link.machine)
    state.kind, state.method, state.model = "finetune", "lora", "qwen2.5-0.5b"
    state.dataset = [str(EXAMPLES / TINY_DATA)]
    wizard = open_wizard(qtbot, link, settings, state=state)
    while True:
        page = settled(qtbot, wizard)
        hint = wizard.minimumSizeHint()
        # It fits a 1280×800 screen with its title bar, as the main window does.
        assert hint.boundedTo(small_screen_size()) == hint, (wizard.currentId(), hint)
        expected = focusable_widgets(page)
        visited = tab_through(wizard, qtbot)
        missing = [w.objectName() or type(w).__name__ for w in expected if w not in visited]
        assert not missing, (wizard.currentId(), missing)
        if wizard.currentId() == REVIEW:
            break
        next_page(qtbot, wizard)


def test_data_formats_of_the_shipped_examples_and_jsonl_text(tmp_path):
    data = EXAMPLES / "data"
    assert inspect_file(str(data / "shakespeare.txt")).kind == TEXT
    assert inspect_file(str(data / "instructions.jsonl")).kind == INSTRUCTION
    chat = inspect_file(str(data / "chat.jsonl"))
    assert chat.kind == CHAT and chat.preview[0].startswith("user: ")
    text = tmp_path / "t.jsonl"
    text.write_text('{"text": "one"}\n{"text": "two"}\n')
    report = inspect_dataset([str(text), str(data / "shakespeare.txt")])
    assert [f.kind for f in report.files] == [JSONL_TEXT, TEXT]
    assert report.token_estimate == report.total_bytes // 4 and report.problem is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json}\n')
    assert "line 2 is not valid JSON" in inspect_file(str(bad)).problem
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n1,2\n")
    assert ".csv is not supported" in inspect_file(str(csv)).problem


def test_state_round_trips_and_the_command_line():
    state = default_state({"source": "simulated", "gpus": [{"index": 0}, {"index": 1}, {"index": 2}]})
    assert state.gpus == [0, 1]
    copy = WizardState.from_json(state.to_json())
    assert copy.to_spec() == state.to_spec()
    spec = state.to_spec()
    assert state_from_spec(spec).to_spec() == spec
    # A setting at its declared default is left to the engine: an engine from before it existed takes the job.
    assert "master_weights" not in spec["train"] and JobSpec.from_dict({"id": "", **spec}).train.master_weights == "fp32"
    state.train.master_weights = "bf16"
    assert state.to_spec()["train"]["master_weights"] == "bf16"
    state.train.master_weights = "fp32"
    words = shlex.split(state.command().splitlines()[0])
    assert words[:3] == ["rigpilot", "run", "train"]
    assert words[words.index("--steps") + 1] == str(state.train.max_steps)
    assert words[words.index("--data") + 1] == state.dataset[0]


def qlora_plan(profile: str = "1x-rtx4090", model: str = "llama-2-7b") -> dict:
    machine = load_profile(profile)
    workload = {"task": "train", "method": "qlora", "seq_len": 1024, "global_batch": 8,
                "lora": {"rank": 8, "alpha": 16, "dropout": 0.0, "targets": ["all-linear"]}}  # fmt: skip
    return real_plan_reply(machine)(model=model, workload=workload, gpus=[0])["result"]["best"]


def test_a_qlora_plan_is_launched_as_qlora_under_its_own_plan():
    plan = qlora_plan()
    state = state_from_plan(plan)
    assert (state.kind, state.method, state.model) == ("finetune", "qlora", "llama-2-7b")
    assert state.plan == plan and state.plan_is_current()
    assert state.workload_args()["method"] == "qlora" and state.workload_args()["lora"]["rank"] == 8
    assert state.to_spec()["train"]["method"] == "qlora"
    assert state_from_spec(state.to_spec()).method == "qlora"


@pytest.mark.skipif(not examples_present(), reason="the shipped examples are missing")
def test_the_wizard_submits_method_qlora_for_a_qlora_plan(qtbot, settings):
    link, submitted = make_link("1x-rtx4090")
    # The engine's own answer for QLoRA comes with the integrator's submission path; the GUI only shows it.
    link.replies["check"] = {"ok": True, "lines": ["1 rank on GPU 0", "qlora, bf16"], "would_run": {"notes": []}}
    wizard = JobWizard.from_plan(qlora_plan(), link=link, settings=settings)
    qtbot.addWidget(wizard)
    wizard.show()
    go_to(qtbot, wizard, MODEL)
    assert wizard.model_page.method.currentData() == "qlora"
    go_to(qtbot, wizard, HYPER)
    assert wizard.hyper_page.lora_rows[0].isVisibleTo(wizard.hyper_page)
    wizard.hyper_page.save_merged.setChecked(True)
    go_to(qtbot, wizard, REVIEW)
    assert "QLoRA" in wizard.review_page.summary.toPlainText()
    assert "qlora" in wizard.review_page.command.toPlainText()
    with qtbot.waitSignal(wizard.sig_submitted, timeout=20000):
        next_page(qtbot, wizard)
    spec = JobSpec.from_dict(submitted[-1]["spec"])
    assert spec.train.method == "qlora" and spec.train.save_merged and spec.train.lora_rank == 8
    assert submitted[-1]["plan"]["workload"]["method"] == "qlora"


def test_cpu_offload_and_pipeline_settings_reach_the_spec_and_the_command(qtbot, settings):
    link, submitted = make_link("4x-rtxa6000-bridged")
    state = default_state(link.machine)
    state.kind, state.model, state.method = "finetune", "llama-2-7b", "lora"
    state.set_precision("bf16")
    state.train.seq_len, state.global_batch, state.gpus = 1024, 16, [0, 1, 2, 3]
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, PLAN)
    page = wizard.plan_page
    form = page.override_form
    rows = lambda: {name: getattr(page, f"{name}_row").isVisibleTo(page)  # noqa: E731
                    for name in ("schedule", "pp_microbatches", "sequence_parallel", "cpu_offload")}  # fmt: skip
    # One GPU's data parallelism: offload applies, pipeline and sequence-parallel settings do not.
    page.tp.setValue(1)
    page.pp.setValue(1)
    page.dp.setValue(1)
    assert rows() == {"schedule": False, "pp_microbatches": False, "sequence_parallel": False, "cpu_offload": True}
    settled(qtbot, wizard)  # the engine's re-check of the single GPU
    before = wizard.state.plan["memory"][0]
    page.cpu_offload.setChecked(True)
    assert settled(qtbot, wizard).isComplete(), page.message.text()
    par = wizard.state.plan["parallelism"]
    assert par["offload_params"] and par["offload_optimizer"] and par["backend"] == "fsdp"
    assert wizard.state.plan["memory"][0] != before  # the memory model re-checked it with the offload
    assert wizard.state.parallelism().cpu_offload
    assert "offload" in wizard.state.command().lower()
    page.cpu_offload.setChecked(False)
    # Two pipeline stages over two data-parallel replicas: the schedule and micro-batches are offered.
    page.pp.setValue(2)
    page.dp.setValue(2)
    assert rows()["schedule"] and rows()["pp_microbatches"] and not rows()["cpu_offload"]
    settled(qtbot, wizard)
    assert wizard.state.parallelism().pp_microbatches >= 2  # the default: at least the stages
    page.schedule.setCurrentIndex(page.schedule.findData("gpipe"))
    page.pp_microbatches.setValue(6)
    assert settled(qtbot, wizard).isComplete(), page.message.text()
    page.tp.setValue(2)
    page.dp.setValue(1)
    assert rows()["sequence_parallel"]
    page.sequence_parallel.setChecked(True)
    assert settled(qtbot, wizard).isComplete(), page.message.text()
    assert form is page.override_form
    with qtbot.waitSignal(wizard.sig_submitted, timeout=20000):
        go_to(qtbot, wizard, LAUNCH)
    p = JobSpec.from_dict(submitted[-1]["spec"]).parallelism
    assert (p.tp, p.pp, p.pp_schedule, p.pp_microbatches, p.sequence_parallel, p.cpu_offload) == (
        2, 2, "GPipe", 6, True, False
    )


def test_review_shows_what_the_engine_would_run_and_launch_says_launch(qtbot, settings):
    link, _ = make_link()
    wizard = open_wizard(qtbot, link, settings, state=default_state(link.machine))
    go_to(qtbot, wizard, REVIEW)
    page = settled(qtbot, wizard)
    assert wizard.button(QWizard.WizardButton.NextButton).text() == "&Launch"
    assert page.isComplete() and wizard.button(QWizard.WizardButton.NextButton).isEnabled()
    checked = link.requests("check")[-1]
    assert checked["spec"] == wizard.state.to_spec() and checked["cwd"]
    shown = page.engine_view.toPlainText()
    assert f"{len(wizard.state.job_gpus())} CPU ranks" in shown and "micro-batch" in shown


def test_review_shows_the_engines_refusal_and_disables_launch(qtbot, settings, tmp_path):
    link, submitted = make_link()
    refusal = "QLoRA's 4-bit base weights cannot be split by tensor parallel: use FSDP or pipeline parallel"
    link.replies["check"] = EngineError("user_error", refusal)
    wizard = open_wizard(qtbot, link, settings, state=default_state(link.machine))
    go_to(qtbot, wizard, REVIEW)
    blocked(qtbot, wizard, refusal)
    assert refusal in wizard.review_page.engine_view.toPlainText()
    assert wizard.review_page.recheck.isVisible()
    wizard.next()
    assert wizard.currentId() == REVIEW and not submitted  # a doomed job is never started
    # The real submission path refuses too: the data file went away after the Data page read it.
    accept_submissions(link)
    data = tmp_path / "gone.txt"
    data.write_text("to be or not to be\n" * 50)
    wizard.state.dataset = [str(data)]
    data.unlink()
    wizard.review_page.recheck.click()
    blocked(qtbot, wizard, "gone.txt")
    assert not submitted


def test_an_engine_without_check_still_launches_with_a_warning(qtbot, settings):
    link, submitted = make_link()
    link.replies["check"] = EngineError("unknown_type", "unknown request type 'check'")
    wizard = open_wizard(qtbot, link, settings, state=WizardState(kind="calibrate", gpus=[0]))
    go_to(qtbot, wizard, REVIEW)
    page = settled(qtbot, wizard)
    assert page.isComplete() and "Not checked" in page.message.text()
    with qtbot.waitSignal(wizard.sig_submitted, timeout=10000):
        next_page(qtbot, wizard)
    assert submitted


def test_a_model_folder_without_weights_offers_training_from_scratch(qtbot, settings, tmp_path):
    folder = tmp_path / "tiny-config-only"
    shutil.copytree(EXAMPLES / TINY_MODEL, folder)
    link, _ = make_link()
    state = default_state(link.machine)
    state.kind, state.method, state.model = "finetune", "full", ""
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, MODEL)
    page = wizard.model_page
    page.picker.set_model(str(folder))
    blocked(qtbot, wizard, "no weights")
    assert page.scratch_button.isVisible()
    page.scratch_button.click()
    assert wizard.state.kind == "scratch" and wizard.state.train_method == "scratch"
    assert settled(qtbot, wizard).isComplete() and not page.scratch_button.isVisible()
    assert not page.method_row.isVisibleTo(page)
    # With weights beside the config it is a model to fine-tune.
    header = b'{"__metadata__": {"format": "pt"}}'
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    wizard.state.kind = "finetune"
    page.initializePage()
    assert settled(qtbot, wizard).isComplete(), page.message.text()
    assert not page.scratch_button.isVisible()


def test_the_command_line_parses_with_the_real_cli():
    from rigpilot.engine.cli.entry import build_parser

    state = state_from_plan(qlora_plan())
    state.dataset = [str(EXAMPLES / TINY_DATA)]
    state.infer.temperature = 0.7
    for kind in ("finetune", "infer"):
        state.kind = kind
        if kind == "infer":
            state.prompts = ["hello"]
        line = state.command().splitlines()[0]
        args = build_parser().parse_args(shlex.split(line)[1:])
        assert args.model == "llama-2-7b" and args.gpus == [0]
        rest = state.command()
        if kind == "finetune":
            assert "qlora" in rest  # as --method, or named among the settings with no flag
        else:
            assert "0.7" in rest


def test_the_pages_and_the_wizard_do_not_import_each_other():
    """The pages reach the wizard through app.wizard.host only: no import cycle, not even for type checking."""
    import ast

    folder = REPO / "app" / "wizard"
    for f in folder.glob("*.py"):
        if f.name == "wizard.py":
            continue
        modules = {n.module for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ImportFrom)}
        assert "rigpilot.app.wizard.wizard" not in modules, f.name


def test_a_zero2_plan_is_launched_as_fsdp2_without_resharding_as_the_engine_maps_it(settings):
    """The wizard's degrees come from the engine's mapping of a plan (a ZeRO-2 plan once launched as DDP)."""
    from rigpilot.engine.layout import Layout
    from rigpilot.engine.planner.plan import parallelism_from_dict

    link, _ = make_link("4x-rtxa6000-bridged")
    state = default_state(link.machine)
    state.plan = {"model_type": "llama", "workload": {"task": "train", "method": "full"},
                  "parallelism": {"gpu_indices": [0, 1, 2, 3], "dp": 4, "tp": 1, "pp": 1, "zero_stage": 2,
                                  "shard_degree": 4, "backend": "fsdp"}}  # fmt: skip
    state.kind = "scratch"
    p = state.parallelism()
    assert (p.dp_replicate, p.dp_shard, p.reshard_after_forward) == (1, 4, False)
    assert p == Layout.from_plan(parallelism_from_dict(state.plan["parallelism"]))


# -- settings that fit the model ----------------------------------------------------------------------------------


@pytest.mark.skipif(not examples_present(), reason="the shipped examples are missing")
def test_a_model_with_a_shorter_context_gets_a_sequence_length_within_it(qtbot, settings):
    link, _ = make_link()
    state = default_state(link.machine)
    state.train.seq_len = 2048  # left over from a bigger model: longer than tiny-llama's 256
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, MODEL)
    page = settled(qtbot, wizard)
    assert wizard.state.train.seq_len == 256 and page.isComplete()
    assert "Sequence length set to 256 tokens, the model's context (it was 2048)" in page.message.text()
    go_to(qtbot, wizard, PLAN)
    assert settled(qtbot, wizard).isComplete() and wizard.state.plan["workload"]["seq_len"] == 256


@pytest.mark.skipif(not examples_present(), reason="the shipped examples are missing")
def test_a_plan_refused_for_the_models_context_offers_the_fix(qtbot, settings):
    link, _ = make_link()
    wizard = open_wizard(qtbot, link, settings, state=default_state(link.machine))
    go_to(qtbot, wizard, GPUS)
    wizard.state.train.seq_len = 2048  # as a remembered state or a clone could bring it
    wizard.next()
    blocked(qtbot, wizard, "is longer than")
    page = wizard.plan_page
    assert page.fix_button.isVisible() and page.fix_button.text() == "Use 256 tokens (the model's context)"
    page.fix_button.click()
    assert settled(qtbot, wizard).isComplete(), page.message.text()
    assert wizard.state.train.seq_len == 256 and not page.fix_button.isVisible()
    assert searches(link)[-1]["workload"]["seq_len"] == 256


@pytest.mark.skipif(not examples_present(), reason="the shipped examples are missing")
def test_a_sequence_length_past_the_context_on_hyper_parameters_offers_the_fix(qtbot, settings):
    link, _ = make_link()
    wizard = open_wizard(qtbot, link, settings, state=default_state(link.machine))
    go_to(qtbot, wizard, HYPER)
    page = wizard.hyper_page
    page.seq_len.setValue(1024)
    blocked(qtbot, wizard, "longer than the model's 256 tokens")
    assert page.fix_button.isVisible() and "Use 256 tokens" in page.fix_button.text()
    page.fix_button.click()
    assert page.seq_len.value() == 256 and settled(qtbot, wizard).isComplete(), page.message.text()
    assert wizard.state.train.seq_len == 256 and not page.fix_button.isVisible()


def test_the_fix_reads_the_context_from_the_refusals_fields_not_its_words():
    from rigpilot.app.planner.model import context_to_fit
    from rigpilot.engine.errors import UserError

    # Whatever the line says (reworded, translated), the reason and the limit decide.
    assert context_to_fit(UserError("anything at all", reason="seq_too_long", setting="seq_len", limit=256)) == 256
    reply = {"code": "user_error", "message": "too long", "reason": "seq_too_long",
             "fields": {"setting": "train.seq_len", "value": 512, "limit": 64}}  # fmt: skip
    assert context_to_fit(EngineError.of_reply(reply)) == 64
    # Another refusal, one with no usable limit, or an older engine's reply (no reason): no fix is offered.
    assert context_to_fit(UserError("sequence length 512 is longer than the model's context of 64 tokens")) is None
    assert context_to_fit(UserError("too long", reason="seq_too_long", limit="64")) is None
    assert context_to_fit(EngineError.of_reply({"code": "user_error", "message": "context of 64 tokens"})) is None
    assert context_to_fit(None) is None and context_to_fit(RuntimeError("boom")) is None
    state = default_state(None)
    assert state.fit_to_context(None) is None and state.fit_to_context(4096) is None
    state.train.seq_len, state.infer.max_new_tokens = 512, 300
    assert state.fit_to_context(256) and (state.train.seq_len, state.infer.max_new_tokens) == (256, 128)


def test_ctrl_enter_is_next_and_launch_and_waits_for_checks(qtbot, settings):
    from PySide6.QtCore import Qt

    link, submitted = make_link()
    wizard = open_wizard(qtbot, link, settings, state=default_state(link.machine))
    wizard.activateWindow()
    qtbot.waitUntil(wizard.isActiveWindow)
    assert "Ctrl+Enter" in wizard.button(QWizard.WizardButton.NextButton).toolTip()
    qtbot.keyClick(wizard.focusWidget() or wizard, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    assert wizard.currentId() == MODEL
    page = wizard.currentPage()
    page.busy = True  # a check still running: the key must not skip it
    page.completeChanged.emit()
    qtbot.keyClick(wizard.focusWidget() or wizard, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    assert wizard.currentId() == MODEL and wizard.state.model.endswith("tiny-llama")  # nothing typed either
    page.validate()
    with qtbot.waitSignal(wizard.sig_submitted, timeout=30000):
        while wizard.currentId() != LAUNCH:
            settled(qtbot, wizard)
            qtbot.keyClick(wizard.focusWidget() or wizard, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    assert len(submitted) == 1


def test_a_declared_recipe_choice_gets_its_control_its_check_and_its_flag(qtbot, settings):
    # master_weights is declared once (engine.jobspec.spec); the hyper-parameters page, its conflict check and the
    # command preview come from that declaration.
    from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS

    link, _ = make_link()
    state = default_state(link.machine)
    state.kind, state.model, state.method = "finetune", "llama-2-7b", "full"
    state.set_precision("bf16")
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, HYPER)
    page = wizard.hyper_page
    combo = page.recipe["master_weights"]
    assert combo.objectName() == "masterWeights"
    assert [combo.itemData(i) for i in range(combo.count())] == [FROM_PLAN, "fp32", "bf16"]
    assert combo.currentIndex() == 0 and "master_weights" not in wizard.state.pinned_recipe  # the plan's, not pinned
    label = page.train_form.labelForField(combo.parentWidget())  # the row's field: the control over its tip
    assert label is not None and label.text() == TRAIN_SETTINGS["master_weights"].label
    assert combo.toolTip() == TRAIN_SETTINGS["master_weights"].help
    combo.setCurrentIndex(combo.findData("bf16"))
    assert wizard.state.train.master_weights == "bf16"
    assert "--master-weights bf16" in wizard.state.command()
    wizard.state.set_precision("fp32")
    page.validate()
    assert page.message.text() == "Master weights “bf16” needs Precision “bf16” (it is “fp32”)."
    assert page.fix_button.isVisibleTo(page) and "fp32" in page.fix_button.text()
    page.fix_button.click()
    assert wizard.state.train.master_weights == "fp32" and "needs" not in page.message.text()


def test_every_recipe_setting_has_a_control_from_the_plan_until_the_user_changes_it(qtbot, settings):
    # The hyper-parameters page offers each recipe setting (engine.recipe) from its declaration, "From the plan"
    # first: taking a plan pins nothing, a choice pins that setting alone, and "From the plan" gives it back.
    from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS
    from rigpilot.engine.recipe import RECIPE_SETTINGS

    link, _ = make_link()
    state = default_state(link.machine)
    state.kind, state.model, state.method = "finetune", "llama-2-7b", "full"
    state.set_precision("bf16")
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, HYPER)
    page, s = wizard.hyper_page, wizard.state
    assert s.plan is not None and list(page.recipe) == list(RECIPE_SETTINGS)
    planned = {name: getattr(s.train, name) for name in RECIPE_SETTINGS}
    for name, combo in page.recipe.items():
        label = page.train_form.labelForField(combo.parentWidget())
        assert label is not None and label.text() == TRAIN_SETTINGS[name].label
        assert combo.currentData() == FROM_PLAN and combo.currentText().startswith("From the plan: ")
    assert page.recipe["compile"].currentText() == "From the plan: Off"
    assert s.pinned_recipe == [] and not set(RECIPE_SETTINGS) & set(s.workload_args())
    chunks = page.recipe["loss_chunks"]
    chunks.setCurrentIndex(chunks.findData(16))
    assert s.pinned_recipe == ["loss_chunks"] and s.train.loss_chunks == 16 and s.workload_args()["loss_chunks"] == 16
    assert page.overrides().loss_chunks == 16 and page.overrides().compile is None  # only what the user changed
    compile_box = page.recipe["compile"]
    compile_box.setCurrentIndex(compile_box.findData(True))
    assert s.train.compile and "--compile" in s.command() and s.pinned_recipe == ["loss_chunks", "compile"]
    chunks.setCurrentIndex(0)  # back to the planner's choice
    assert s.pinned_recipe == ["compile"] and s.train.loss_chunks == planned["loss_chunks"]
    assert "loss_chunks" not in s.workload_args()
    # Opened again, the page shows the pin and the plan's choice as they are.
    page.initializePage()
    assert compile_box.currentData() is True and chunks.currentData() == FROM_PLAN


def test_a_plan_made_for_bf16_master_weights_opens_the_wizard_with_them(qtbot, settings):
    link, _ = make_link()
    plan = {**qlora_plan("4x-rtx4090")}
    plan["workload"] = {**plan["workload"], "method": "full", "precision": "bf16", "master_weights": "bf16"}
    state = state_from_plan(plan)
    assert state.train.master_weights == "bf16"
    plan["workload"]["master_weights"] = None  # a plan that does not say keeps the wizard's own choice
    base = default_state(link.machine)
    base.train.master_weights = "bf16"
    assert state_from_plan(plan, base).train.master_weights == "bf16"


def test_return_on_the_gpus_page_goes_next_and_space_ticks(qtbot, settings):
    from PySide6.QtCore import Qt

    link, _ = make_link()
    wizard = open_wizard(qtbot, link, settings, state=default_state(link.machine))
    go_to(qtbot, wizard, GPUS)
    graph = wizard.gpu_page.selector.graph
    graph.setFocus()
    graph.focused_gpu = 0
    chosen = list(wizard.state.gpus)
    qtbot.keyClick(graph, Qt.Key.Key_Space)  # Space ticks (or unticks) the GPU in focus, as on a check box
    assert wizard.state.gpus != chosen
    qtbot.keyClick(graph, Qt.Key.Key_Space)
    assert wizard.state.gpus == chosen
    settled(qtbot, wizard)
    qtbot.keyClick(graph, Qt.Key.Key_Return)  # Return is Next, the GPUs stay as they are
    qtbot.waitUntil(lambda: wizard.currentId() == PLAN)
    assert wizard.state.gpus == chosen
