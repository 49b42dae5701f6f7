"""The Planner page: plans from the real planner through a fake engine link, the memory chart, exports, hub search."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from PySide6.QtCore import QPointF, QSettings, Qt
from PySide6.QtWidgets import QFileDialog, QFormLayout

from rigpilot.app.planner import hub_search
from rigpilot.app.planner.exports import EXPORT_TARGETS, plan_sidecar
from rigpilot.app.planner.model import (
    FORCE_TP_TEXT,
    GIB,
    MEMORY_PARTS,
    PlanRequest,
    planner_text,
    plans_of,
    summary_lines,
)
from rigpilot.app.planner.page import TABLE_COLUMNS, PlannerPage
from rigpilot.app.topology.imported import ImportedMachines
from rigpilot.engine.api.client import EngineError
from rigpilot.engine.hardware.importers import import_machine
from rigpilot.engine.hardware.simulated import list_profiles
from rigpilot.engine.planner.plan import Plan
from rigpilot.engine.planner.settings import PLAN_SETTINGS

from support.gui_fakes import (
    FakeLink,
    focusable_widgets,
    isolated_config,
    make_job,
    make_machine,
    real_plan_reply,
    tab_through,
)
from support.gui_planner import PRESET_7B, open_page, plan_for

PROFILES = [p["id"] for p in list_profiles()]
SMI_Q = "case21_smiq_4xA100_sxm4_80gb_nvidia-smi-q.txt"


# The engine's plain recipe pinned in the form: the cases written before the planner chose the recipe.
PLAIN = {"master_weights": "fp32", "optimizer": "adamw", "loss_chunks": 1, "optimizer_in_backward": False,
         "activation_offload": False}  # fmt: skip


@pytest.fixture(autouse=True)
def _private_settings(tmp_path, monkeypatch):
    # The page keeps imported machines in QSettings: never the user's, never another test's.
    yield from isolated_config(tmp_path, monkeypatch)


@pytest.mark.parametrize("profile", PROFILES)
def test_renders_every_profile_and_plans_a_7b_preset(qtbot, profile):
    page, link = open_page(qtbot, profile)
    gpus = [g.index for g in link.machine_obj.gpus]
    assert sorted(page.gpus.boxes) == gpus
    assert page.gpus.selected() == gpus  # every free GPU, to start with
    result = plan_for(qtbot, page)
    assert link.requests("plan")[-1]["model"] == PRESET_7B
    assert link.requests("plan")[-1]["gpus"] == gpus
    plans = plans_of(result)
    assert page.table.rowCount() == len(plans)
    assert not page.message.isVisible()
    if plans:
        best = plans[0]
        assert page.plan == best
        assert Plan.from_dict(best).parallelism.describe() in page.summary.text()
        assert page.chart.heights("weights") == pytest.approx([m["weights"] / GIB for m in best["memory"]])
        assert page.launch_button.isEnabled()
    else:
        # Full fine-tuning of 7B does not fit here: say so, and offer the changes that would.
        assert "Nothing fits" in page.summary.text()
        assert page.suggestions.count() == len(result["suggestions"]) > 0
        assert not page.launch_button.isEnabled()
    assert page.explanation.toPlainText().startswith("• ")


def test_memory_chart_stacks_equal_the_plans_breakdown(qtbot):
    page, _ = open_page(qtbot, "8x-a100-pcie")
    plan_for(qtbot, page)
    for row in range(page.table.rowCount()):
        page.table.selectRow(row)
        memory = page.plan["memory"]
        bottom = [0.0] * len(memory)
        for key, _ in MEMORY_PARTS:
            assert page.chart.heights(key) == pytest.approx([m[key] / GIB for m in memory])
            assert page.chart.bottoms(key) == pytest.approx(bottom)
            bottom = [b + m[key] / GIB for b, m in zip(bottom, memory, strict=True)]
        # The stack's top is the predicted total; each GPU's capacity line sits over its own bar.
        assert bottom == pytest.approx([m["total"] / GIB for m in memory], rel=1e-6)
        xs, ys = page.chart.capacity.getData()
        assert list(ys[::2]) == pytest.approx([m["capacity"] / GIB for m in memory])
        assert list((xs[::2] + xs[1::2]) / 2) == pytest.approx(list(range(len(memory))))


def test_runner_up_rows_show_their_own_plan(qtbot):
    page, _ = open_page(qtbot, "8x-h100-sxm")
    result = plan_for(qtbot, page)
    plans = plans_of(result)
    assert len(plans) > 1
    page.table.selectRow(1)
    assert page.plan == plans[1]
    assert page.exports.plan == plans[1]


def test_the_status_words_the_memory_trace_from_its_numbers(qtbot):
    page, link = open_page(qtbot, "8x-h100-sxm")
    plain = link.replies["plan"]
    link.replies["plan"] = lambda **r: {**(reply := plain(**r)),
                                        "result": {**reply["result"], "trace": {"traced": 3, "tried": 4, "seconds": 2.5},
                                                   "notes": []}}  # fmt: skip
    plan_for(qtbot, page)
    assert page.status.text().endswith("Memory traced for 3 of 4 plan(s) in 2.5 s.")
    link.replies["plan"] = plain
    plan_for(qtbot, page)
    assert "traced" not in page.status.text()


def test_unknown_model_and_engine_errors_are_one_inline_line(qtbot):
    page, link = open_page(qtbot)
    page.picker.set_model("no/such/model/anywhere", chosen=False)
    with qtbot.waitSignal(page.sig_plan_failed, timeout=10000) as failed:
        page.plan_button.click()
    assert "no such folder" in failed.args[0]
    assert page.message.isVisible() and page.message.text() == failed.args[0]
    assert page.table.rowCount() == 0 and not page.launch_button.isEnabled()

    link.replies["plan"] = EngineError("user_error", "the planner is out of ideas")  # a refusal with no fix
    page.picker.set_model(PRESET_7B, chosen=False)
    with qtbot.waitSignal(page.sig_plan_failed, timeout=10000) as failed:
        page.plan_button.click()
    assert failed.args[0] == "the planner is out of ideas" and not page.fix_button.isVisibleTo(page)

    # A good plan afterwards clears the message.
    link.replies["plan"] = real_plan_reply(link.machine_obj)
    plan_for(qtbot, page)
    assert not page.message.isVisible()


def test_missing_model_or_gpus_asks_before_planning(qtbot):
    page, link = open_page(qtbot)
    page.picker.set_model("", chosen=False)
    page.plan_button.click()
    assert page.message.text().startswith("Choose a model")
    page.picker.set_model(PRESET_7B, chosen=False)
    page.gpus.set_selected([])
    page.plan_button.click()
    assert page.message.text() == "Select at least one GPU."
    assert link.requests("plan") == []


def test_busy_gpus_are_marked_and_left_out_at_first(qtbot):
    page, _ = open_page(qtbot, "4x-rtx4090", jobs=[make_job("j1", gpus=[1], name="bert-ft")])
    qtbot.waitUntil(lambda: "busy" in page.gpus.boxes[1].text())
    assert "bert-ft" in page.gpus.boxes[1].text()
    assert "busy" not in page.gpus.boxes[0].text()
    assert page.gpus.free() == [0, 2, 3]
    assert page.gpus.selected() == [0, 2, 3]
    # Once the user picks, a busy GPU may be chosen on purpose (the planner plans for it).
    page.gpus.boxes[1].click()
    assert page.gpus.selected() == [0, 1, 2, 3]
    assert page.plan_request().gpus == [0, 1, 2, 3]


def test_plans_come_from_the_engine_only_and_wait_for_it(qtbot):
    page, link = open_page(qtbot, "4x-rtxa6000-bridged", connect=False)
    page.on_machine(link.machine_obj.to_dict())  # known from an earlier connection
    page.gpus.set_selected([0, 1])
    page.picker.set_model("qwen2.5-0.5b", chosen=False)
    page.plan_button.click()
    # No second planner in the GUI: it says so in one line, and plans once the engine is there.
    assert link.requests("plan") == [] and page.plan_button.isEnabled()
    assert page.message.isVisible() and "Not connected to the engine" in page.message.text()
    link.connect_engine()
    result = plan_for(qtbot, page, "qwen2.5-0.5b")
    assert len(link.requests("plan")) == 1 and not page.message.isVisible()
    assert result["gpu_indices"] == [0, 1] and result["best"] is not None


def test_a_token_budget_gives_a_time_to_finish(qtbot):
    page, link = open_page(qtbot, "8x-h100-sxm")
    result = plan_for(qtbot, page, token_budget=2 * 10**9)
    assert link.requests("plan")[-1]["workload"]["token_budget"] == 2 * 10**9
    best = result["best"]
    assert best["timing"]["time_to_budget_s"] > 0
    assert "to train on the token budget" in page.summary.text()
    assert page.table.item(0, TABLE_COLUMNS.index("To finish")).text() not in ("", "—")


def test_inference_and_lora_requests(qtbot):
    page, link = open_page(qtbot, "2x-rtx3090-nvlink")
    page.task.setCurrentIndex(page.task.findData("infer"))
    assert page.workload_form.isRowVisible(page.new_tokens) and not page.workload_form.isRowVisible(page.method)
    result = plan_for(qtbot, page, "mistral-7b", seq_len=4096, batch=4, new_tokens=512, weight_bits=8)
    sent = link.requests("plan")[-1]["workload"]
    assert sent["task"] == "infer" and sent["weight_bits"] == 8 and sent["new_tokens"] == 512
    assert result["best"]["workload"]["task"] == "infer"
    # Accelerate and DeepSpeed configs describe training: not offered for an inference plan.
    assert not page.exports.buttons["accelerate"].isEnabled() and page.exports.buttons["torchrun"].isEnabled()

    page.task.setCurrentIndex(page.task.findData("train"))
    page.method.setCurrentIndex(page.method.findData("qlora"))
    assert page.workload_form.isRowVisible(page.lora_rank)
    plan_for(qtbot, page, "mistral-7b", lora_rank=32, seq_len=2048)
    sent = link.requests("plan")[-1]["workload"]
    assert sent["method"] == "qlora" and sent["lora"]["rank"] == 32


def test_applying_a_suggestion_plans_again_and_fits(qtbot):
    page, link = open_page(qtbot, "1x-rtx4090")
    result = plan_for(qtbot, page, **PLAIN)  # full fine-tuning of 7B on one 24 GB card in the plain recipe: nothing fits
    assert result["best"] is None
    kinds = [s["kind"] for s in result["suggestions"]]
    row = next(i for i, k in enumerate(kinds) if k in ("method", "quantize", "seq", "batch", "gpus"))
    page.suggestions.setCurrentRow(row)
    assert page.apply_button.isEnabled()
    assert page.plan == result["suggestions"][row]["plan"]  # the chart previews the change
    with qtbot.waitSignal(page.sig_plan_ready, timeout=20000) as ready:
        page.apply_button.click()
    assert ready.args[0]["best"] is not None
    assert len(link.requests("plan")) == 2


def test_exports_write_valid_files(qtbot, tmp_path):
    page, _ = open_page(qtbot, "8x-h100-sxm")
    plan_for(qtbot, page)
    plan = page.plan
    assert plan["parallelism"]["pp"] == plan["parallelism"]["tp"] == 1  # every launcher can run it
    assert all(b.isEnabled() for b in page.exports.buttons.values())
    for t in EXPORT_TARGETS:
        path = tmp_path / t.default_name
        with qtbot.waitSignal(page.exports.sig_exported, timeout=10000) as done:
            page.exports.export_to(t.key, str(path))
        assert done.args[0] == t.key and done.args[1][0] == str(path)
        text = path.read_text()
        if t.key == "json":
            assert Plan.from_json(text).to_dict() == Plan.from_dict(plan).to_dict()
        elif t.key == "deepspeed":
            config = json.loads(text)
            assert config["train_micro_batch_size_per_gpu"] == plan["parallelism"]["micro_batch"]
        elif t.key == "accelerate":
            assert isinstance(yaml.safe_load(text), dict)
        else:
            # Launchers read the plan from a file written beside them.
            sidecar = plan_sidecar(path)
            assert done.args[1] == [str(path), str(sidecar)]
            assert f"--plan {sidecar.name}" in text
            assert Plan.from_json(sidecar.read_text()).parallelism.world_size == plan["parallelism"]["world_size"]
            assert text.startswith("#!/bin/sh" if t.key == "torchrun" else "#!/bin/bash")
    assert page.export_note.text().startswith("Saved ")


def test_exports_a_launcher_cannot_express_are_disabled_with_the_reason(qtbot):
    page, _ = open_page(qtbot, "8x-a100-pcie")
    plan_for(qtbot, page)
    assert page.plan["parallelism"]["pp"] > 1  # pipeline stages over NVLink pairs win here
    button = page.exports.buttons["accelerate"]
    assert not button.isEnabled() and "pipeline" in button.toolTip()
    assert page.exports.buttons["torchrun"].isEnabled() and page.exports.buttons["json"].isEnabled()


def test_export_button_asks_where_and_failures_are_inline(qtbot, tmp_path, monkeypatch):
    page, _ = open_page(qtbot, "4x-rtxa6000-bridged")
    plan_for(qtbot, page, "qwen2.5-1.5b")
    target = tmp_path / "chosen.json"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(target), ""))
    with qtbot.waitSignal(page.exports.sig_exported, timeout=10000):
        page.exports.buttons["json"].click()
    assert Plan.from_json(target.read_text())

    with qtbot.waitSignal(page.exports.sig_export_failed, timeout=10000):
        page.exports.export_to("json", str(tmp_path / "no-such-folder" / "plan.json"))
    assert page.message.isVisible() and "Could not export JSON" in page.message.text()


def test_offline_hub_search_says_so_and_offers_cache_and_presets(qtbot, tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    repo = cache / "models--acme--llama-mini"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    (repo / "blobs").mkdir()
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    page, _ = open_page(qtbot)
    page.picker.edit.setText("llama")
    with qtbot.waitSignal(page.picker.sig_hub_results, timeout=10000) as found:
        page.picker.search_button.click()
    results = found.args[0]
    assert results.offline and results.hub == []
    assert page.picker.message.isVisible() and "Offline" in page.picker.message.text()
    refs = [page.picker.results.item(i).data(256) for i in range(page.picker.results.count())]
    assert "acme/llama-mini" in refs and PRESET_7B in refs
    page.picker.results.setCurrentRow(refs.index("acme/llama-mini"))
    page.picker._result_chosen(page.picker.results.currentItem())
    assert page.picker.model() == "acme/llama-mini"


def test_hub_search_online_and_when_the_hub_fails(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as read at import (tests/conftest.py sets it)
    monkeypatch.setattr(hub_search, "cached_models", lambda q="": [])

    class Model:
        def __init__(self, id: str):
            self.id = id

    asked = {}

    def list_models(**kw):
        asked.update(kw)
        return [Model(f"org/llama-{i}") for i in range(25)]

    r = hub_search.search_hub("llama", list_models=list_models, reachable=lambda: True)
    assert asked["search"] == "llama" and asked["limit"] == 20
    assert r.hub[:2] == ["org/llama-0", "org/llama-1"] and len(r.hub) == 20 and not r.message

    def broken(**kw):
        raise OSError("connection reset by peer")

    r = hub_search.search_hub("llama", list_models=broken, reachable=lambda: True)
    assert r.offline and "connection reset by peer" in r.message and "llama-2-7b" in r.presets
    r = hub_search.search_hub("llama", list_models=broken, reachable=lambda: False)
    assert r.offline and "cannot be reached" in r.message


def test_launch_opens_the_wizard_filled_from_the_plan(qtbot):
    page, _ = open_page(qtbot, "4x-rtxa6000-bridged")
    page.gpus.set_selected([0, 1])
    plan_for(qtbot, page, "qwen2.5-0.5b")
    plan = page.plan
    with qtbot.waitSignal(page.sig_wizard_opened) as opened:
        page.launch_button.click()
    wizard = opened.args[0]
    qtbot.addWidget(wizard)
    assert wizard.state.model == "qwen2.5-0.5b"
    assert wizard.state.gpus == sorted(plan["parallelism"]["gpu_indices"])
    assert wizard.state.plan == plan and wizard.state.plan_is_current()
    wizard.reject()


def test_keyboard_reaches_every_control(qtbot):
    page, _ = open_page(qtbot, "4x-rtx4090")
    plan_for(qtbot, page, "qwen2.5-0.5b")
    expected = focusable_widgets(page)
    visited = tab_through(page, qtbot)
    assert not [w.objectName() or type(w).__name__ for w in expected if w not in visited]
    names = {w.objectName() for w in visited}
    assert {"modelEdit", "planButton", "planTable", "export-json", "launchPlan", "gpu-0"} <= names


def test_form_is_saved_and_restored(qtbot, tmp_path):
    page, _ = open_page(qtbot)
    page.set_request(
        PlanRequest(model="mixtral-8x7b", task="train", method="lora", seq_len=4096, batch=32, lora_rank=8)
    )
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    page.save_state(settings, "pages/planner")
    other, _ = open_page(qtbot)
    other.restore_state(settings, "pages/planner")
    r = other.plan_request()
    assert (r.model, r.method, r.seq_len, r.batch, r.lora_rank) == ("mixtral-8x7b", "lora", 4096, 32, 8)
    assert r.master_weights is None  # left open, as it was
    page.set_request(PlanRequest(model="mixtral-8x7b", master_weights="bf16"))
    page.save_state(settings, "pages/planner")
    other.restore_state(settings, "pages/planner")
    assert other.plan_request().master_weights == "bf16"


def test_the_plans_table_fits_its_rows_until_the_splitter_is_dragged(qtbot, tmp_path):
    from rigpilot.app.planner.page import RESULTS_SPLITTER_KEY

    page, _ = open_page(qtbot, "4x-rtx4090")
    plan_for(qtbot, page, method="full")
    results = page.results
    qtbot.waitUntil(lambda: results.results_splitter.sizes()[0] == results.table_height())
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    page.save_state(settings, "pages/planner")
    assert not settings.contains(f"pages/planner/{RESULTS_SPLITTER_KEY}")  # it follows the rows and the window
    results.results_splitter.moveSplitter(80, 1)  # as a drag of the handle does
    page.save_state(settings, "pages/planner")
    other, _ = open_page(qtbot, "4x-rtx4090")
    other.restore_state(settings, "pages/planner")
    assert other.results.sized_by_user
    plan_for(qtbot, other, method="full")
    qtbot.wait(50)
    assert other.results.results_splitter.sizes()[0] < other.results.table_height()  # the user's height stays


def test_a_plan_the_engine_does_not_run_says_why_and_cannot_be_launched(qtbot):
    page, link = open_page(qtbot, "4x-rtx4090")
    planner = real_plan_reply(link.machine_obj)
    reason = "tensor parallel runs Llama-style decoders (llama, mistral, qwen2, qwen3); model type 'gpt2' is not one of them"

    def plan_with_an_unrunnable_runner_up(**request):
        reply = planner(**request)
        result = reply["result"]
        result["best"] = {**result["best"], "runs_here": True, "runs_here_reason": ""}
        result["runners_up"][0] = {**result["runners_up"][0], "runs_here": False, "runs_here_reason": reason}
        return reply

    link.replies["plan"] = plan_with_an_unrunnable_runner_up
    page.picker.set_model("qwen2.5-0.5b", chosen=False)
    with qtbot.waitSignal(page.sig_plan_ready, timeout=20000):
        page.plan_button.click()
    column = TABLE_COLUMNS.index("Runs here")
    assert page.table.item(0, column).text() == "yes"
    cell = page.table.item(1, column)
    # "no" in the table, the reason on hover and, once the plan is shown, in full beside the Launch button.
    assert cell.text() == "no" and reason in cell.toolTip()
    assert page.launch_button.isEnabled() and not page.launch_note.isVisible()
    page.table.selectRow(1)
    assert page.plan["runs_here"] is False
    assert not page.launch_button.isEnabled()
    assert reason in page.launch_button.toolTip() and reason in page.launch_note.text() and page.launch_note.isVisible()
    page.table.selectRow(0)
    assert page.launch_button.isEnabled() and not page.launch_note.isVisible()


def test_a_new_result_shows_its_own_best_plan_in_the_headline_and_the_chart(qtbot):
    """Planning llama-2-7b then mistral-7b: row 0 stays selected, and everything shown must follow it."""
    page, _ = open_page(qtbot, "4x-rtx4090")
    first = plan_for(qtbot, page, PRESET_7B, method="lora")["best"]
    page.chart._hover(page.chart.plot.getPlotItem().vb.mapViewToScene(QPointF(0, 1)))
    second = plan_for(qtbot, page, "mistral-7b", method="lora")["best"]
    assert summary_lines(first)[1] != summary_lines(second)[1]  # the two answers differ where the headline shows
    assert page.table.selectionModel().selectedRows()[0].row() == 0
    assert page.plan == second and page.exports.plan == second
    for line in summary_lines(second)[1:]:
        assert line in page.summary.text()
    assert summary_lines(first)[1] not in page.summary.text()
    assert page.chart.memory == second["memory"]
    assert page.chart.heights("weights") == pytest.approx([m["weights"] / GIB for m in second["memory"]])
    # Hovering reads the new plan's parts.
    page.chart._hover(page.chart.plot.getPlotItem().vb.mapViewToScene(QPointF(0, 1)))
    m = second["memory"][0]
    assert page.chart.readout.text().startswith(f"GPU {m['gpu']}: ")
    assert f"total {m['total'] / GIB:.2f}" in page.chart.readout.text()


def test_plans_for_a_simulated_profile_through_the_engine(qtbot, tmp_path):
    page, link = open_page(qtbot, "4x-rtx4090")
    profiles = [page.target.itemData(i) for i in range(page.target.count())]
    assert profiles[0] == "here" and {f"profile:{p}" for p in PROFILES} <= set(profiles)
    assert page.target.itemText(0) == f"This machine ({link.machine_obj.label})"
    assert page.select_machine("profile:8x-h100-sxm")
    assert sorted(page.gpus.boxes) == list(range(8)) and page.gpus.selected() == list(range(8))
    result = plan_for(qtbot, page)
    sent = link.requests("plan")[-1]
    assert sent["machine"] == "8x-h100-sxm" and sent["gpus"] == list(range(8))
    assert len(result["best"]["parallelism"]["gpu_indices"]) == 8
    assert "H100" in page.summary.text() and page.target_note.isVisible()
    # Exports work for the machine planned for; a job launches only on the engine's.
    assert page.exports.plan == result["best"] and page.exports.buttons["torchrun"].isEnabled()
    with qtbot.waitSignal(page.exports.sig_exported, timeout=10000) as done:
        page.exports.export_to("torchrun", str(tmp_path / "launch.sh"))
    assert "--nproc-per-node=8" in (tmp_path / "launch.sh").read_text()
    assert Plan.from_json(Path(done.args[1][1]).read_text()).parallelism.world_size == 8
    assert not page.launch_button.isEnabled() and page.launch_note.isVisible()
    assert page.table.horizontalHeaderItem(TABLE_COLUMNS.index("Runs here")).text() == "Rigpilot runs it"
    assert page.launch_note.text() == (
        f"Planned for another machine: jobs launch only on this one ({link.machine_obj.label}). Export the plan instead."
    )
    assert page.summary.text().startswith("<b>Plan for simulated: 8×H100")
    # Back to this machine: no machine argument, launch offered again.
    assert page.select_machine("here")
    plan_for(qtbot, page)
    assert "machine" not in link.requests("plan")[-1]
    assert page.launch_button.isEnabled() and not page.target_note.isVisible()


def test_plans_for_an_imported_machine_from_the_shared_list(qtbot, tmp_path, smi_data):
    machines = ImportedMachines(QSettings(str(tmp_path / "m.ini"), QSettings.Format.IniFormat))
    imported = import_machine(smi_data / SMI_Q).to_dict()
    topo_only = import_machine(smi_data / "case08_4xRTX6000Ada_dual_socket_genoa_4nics.txt").to_dict()
    entry = machines.add(imported)
    link = FakeLink("1x-rtx4090")
    link.replies["plan"] = real_plan_reply(link.machine_obj)
    page = PlannerPage(link, machines=machines)
    qtbot.addWidget(page)
    page.show()
    link.connect_engine()
    assert page.select_machine(entry.key)  # the key the Topology page names it by
    assert sorted(page.gpus.boxes) == [0, 1, 2, 3] and "A100" in page.gpus.boxes[0].text()
    result = plan_for(qtbot, page, method="lora")
    assert link.requests("plan")[-1]["machine"] == imported
    assert result["best"] is not None and "A100" in page.explanation.toPlainText()
    assert not page.launch_button.isEnabled()
    assert "Plan for imported: 4×A100-SXM4-80GB:" in page.summary.text() and SMI_Q not in page.summary.text()
    # An import made later (on the Topology page) shows up at once; one with no GPU memory cannot be chosen.
    blocked = machines.add(topo_only)
    index = page.target.findData("import:" + blocked.key)
    assert index > 0 and not page.target.model().item(index).isEnabled()
    assert "nvidia-smi -q" in page.target.itemData(index, Qt.ItemDataRole.ToolTipRole)
    assert page.target_key() == "import:" + entry.key  # the choice stayed
    # Forgotten while chosen: back to this machine.
    machines.forget(entry.key)
    assert page.target_key() == "here" and sorted(page.gpus.boxes) == [0]


def test_the_engine_refusing_a_machine_is_one_inline_line(qtbot):
    page, link = open_page(qtbot, "4x-rtx4090")
    planner = real_plan_reply(link.machine_obj)
    link.replies["plan"] = lambda **r: planner(**{**r, "machine": {"source": "imported", "gpus": []}})
    page.picker.set_model(PRESET_7B, chosen=False)
    with qtbot.waitSignal(page.sig_plan_failed, timeout=20000) as failed:
        page.plan_button.click()
    assert failed.args[0] == "plan.machine.gpus: expected a list of at least one GPU"
    assert "\n" not in page.message.text() and page.message.isVisible()


def test_every_suggestion_has_a_control_and_is_worded_for_it(qtbot):
    """Explanations name the Planner's controls, never `rigpilot plan` flags; the controls exist and work."""
    page, link = open_page(qtbot, "4x-rtx4090")
    page.offload.setCurrentIndex(page.offload.findData("off"))
    result = plan_for(qtbot, page, **PLAIN)  # full fine-tuning of 7B in the plain recipe, no offload: nothing fits
    assert link.requests("plan")[-1]["options"] == {"offload": "off"}
    assert result["best"] is None
    raw = "\n".join(result["explanation"] + [s["change"] for s in result["suggestions"]])
    assert "--force-tp" in raw and "--method qlora" in raw  # the planner's own words, for the CLI
    shown = [page.explanation.toPlainText(), page.message.text()]
    shown += [page.suggestions.item(i).text() for i in range(page.suggestions.count())]
    shown += [page.rejected.item(r, 1).text() for r in range(page.rejected.rowCount())]
    assert not [t for t in shown if "--" in t]
    text = "\n".join(shown)
    assert f"“{FORCE_TP_TEXT}”" in text and page.force_tp.text() == FORCE_TP_TEXT
    assert "Method “QLoRA (4-bit base)”" in text and page.method.findText("QLoRA (4-bit base)") >= 0
    assert "CPU offload is turned off" in text
    # Each control reaches the planner.
    page.force_tp.setChecked(True)
    page.offload.setCurrentIndex(page.offload.findData("on"))
    page.method.setCurrentIndex(page.method.findData("qlora"))
    result = plan_for(qtbot, page)
    sent = link.requests("plan")[-1]
    assert sent["options"] == {"force_tp": True, "offload": "on"} and sent["workload"]["method"] == "qlora"
    assert not [line for line in result["explanation"] if "tensor parallelism was left out" in line]


def test_the_settings_the_planner_names_are_the_pages_controls_by_their_labels(qtbot):
    """The app words the planner's sentences with each setting's declared label: each is a control here."""
    page, _ = open_page(qtbot, "4x-rtx4090")
    rows = [page.workload_form, page.nodes_form]
    labels = {form.itemAt(r, QFormLayout.ItemRole.LabelRole).widget().text()
              for form in rows for r in range(form.rowCount())
              if form.itemAt(r, QFormLayout.ItemRole.LabelRole) is not None}  # fmt: skip
    for name in ("seq_len", "batch", "method", "quant", "precision", "offload", "lora_rank", "new_tokens", "tokens",
                 "nodes", "internode"):  # fmt: skip
        label = PLAN_SETTINGS[name].label  # "Batch" reads "Batch (sequences per step)" while training
        assert any(t == label or t.startswith(f"{label} (") for t in labels), f"no control here is labelled {label}"
    assert page.force_tp.text() == PLAN_SETTINGS["force_tp"].label
    for box, name in ((page.method, "method"), (page.offload, "offload")):
        words = {box.itemText(i) for i in range(box.count())}
        assert {PLAN_SETTINGS[name].choice_word(box.itemData(i)) for i in range(box.count())} == words
    # An older engine's sentence, without terms, is shown as it came.
    assert planner_text("use --seq 512", None) == "use --seq 512"


def test_a_refusal_names_the_control_to_change_not_the_flag(qtbot):
    """The engine's refusal carries its terms (fields.terms) through the error reply; the page words them."""
    page, _ = open_page(qtbot, "4x-rtx4090")
    page.method.setCurrentIndex(page.method.findData("qlora"))
    page.precision.setCurrentIndex(page.precision.findData("fp32"))
    page.picker.set_model(PRESET_7B, chosen=False)
    with qtbot.waitSignal(page.sig_plan_failed, timeout=20000) as failed:
        page.plan_button.click()
    assert failed.args[0] == "QLoRA computes in bf16 or fp16; use Precision “bf16”"


def test_train_on_says_what_not_set_means(qtbot):
    page, _ = open_page(qtbot, "8x-h100-sxm")
    assert page.tokens.value() == 0 and page.tokens.text() == "not set: no time to finish"
    assert "time to finish" in page.tokens.toolTip()
    plan_for(qtbot, page, "qwen2.5-0.5b")
    assert page.table.item(0, TABLE_COLUMNS.index("To finish")).text() == "—"
    speed = TABLE_COLUMNS.index("Tokens/s")  # the unit in the header, the figure in the cell
    assert page.table.horizontalHeaderItem(speed).text() == "Tokens/s"
    assert page.table.item(0, speed).text()[0].isdigit()
    assert page.table.isColumnHidden(TABLE_COLUMNS.index("To finish"))  # no token budget: no time to finish
    page.tokens.setValue(1.5)
    assert page.tokens.text() == "1.50 billion tokens"


def test_the_machine_planned_for_and_the_options_are_restored(qtbot, tmp_path):
    page, _ = open_page(qtbot)
    page.select_machine("profile:2x-rtx3090-nvlink")
    page.force_tp.setChecked(True)
    page.offload.setCurrentIndex(page.offload.findData("off"))
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    page.save_state(settings, "pages/planner")
    other, other_link = open_page(qtbot)
    other.restore_state(settings, "pages/planner")
    assert other.target_key() == "profile:2x-rtx3090-nvlink" and sorted(other.gpus.boxes) == [0, 1]
    assert other_link.requests("plan") == []  # restored, not planned: starting the app asks nothing
    r = other.plan_request()
    assert r.force_tp and r.offload == "off"


def test_speeds_read_in_k_and_m_never_thousands_of_k():
    from rigpilot.app.planner.model import tokens_per_s

    # The Planner words speeds with the GUI's one formatter, as the Jobs page does.
    assert tokens_per_s(14_719_000) == "14.7M tokens/s"
    assert tokens_per_s(4_200_000, training=False) == "4.2M generated tokens/s"
    assert tokens_per_s(14_719) == "14.7k tokens/s" and tokens_per_s(3_900) == "3.9k tokens/s"
    assert tokens_per_s(None) == tokens_per_s(0) == "n/a"


def test_a_sequence_longer_than_the_models_context_is_fixed_in_one_click(qtbot):
    # Planned by the real planner: its own refusal carries the context the fix uses.
    from rigpilot.app.wizard.state import EXAMPLES, TINY_MODEL

    page, _ = open_page(qtbot)
    page.seq_len.setValue(2048)
    page.picker.set_model(str(EXAMPLES / TINY_MODEL), chosen=False)
    with qtbot.waitSignal(page.sig_plan_failed, timeout=20000) as failed:
        page.plan_button.click()
    assert "context of 256 tokens" in failed.args[0]
    assert page.fix_button.isVisibleTo(page) and page.fix_button.text() == "Use 256 tokens (the model's context)"
    with qtbot.waitSignal(page.sig_plan_ready, timeout=20000):
        page.fix_button.click()
    assert page.seq_len.value() == 256 and not page.fix_button.isVisibleTo(page) and not page.message.isVisibleTo(page)
    assert page.plan is not None and page.plan["workload"]["seq_len"] == 256


def test_search_time_reads_in_milliseconds_below_a_second():
    from rigpilot.app.planner.page import duration_short

    assert duration_short(0.0042) == "4 ms" and duration_short(0.0) == "under 1 ms" and duration_short(11.04) == "11.0 s"


def test_an_untraced_plans_memory_says_why_as_the_cli_does():
    from rigpilot.app.planner.model import memory_figures

    gib = 2**30
    why = "not verified: multi-node plans are not traced"
    assert memory_figures({"verification": why}, {"total": 12 * gib}) == f"Memory: formula 12.0 GiB ({why})"
    assert memory_figures({"verification": ""}, {"total": 12 * gib}) == "Memory: formula 12.0 GiB"
    traced = {"total": 12 * gib, "traced": 13 * gib}
    assert memory_figures({"verification": "traced: meta, 1.0 s"}, traced) == "Memory: formula 12.0 GiB · traced 13.0 GiB"


def test_bf16_master_weights_are_asked_for_from_the_declaration_and_plan_without_offload(qtbot):
    # The headline case of torchtune's recipe: 7B full fine-tuning on four 24 GB cards fits without CPU offload
    # once the weights, gradients and AdamW moments are bf16; with fp32 master weights it needs offload.
    from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS

    page, link = open_page(qtbot, "4x-rtx4090")
    declared = TRAIN_SETTINGS["master_weights"]
    assert page.workload_form.labelForField(page.master_weights).text() == declared.label
    assert page.master_weights.toolTip() == declared.help
    assert page.master_weights.currentData() == "auto" and page.recipe["loss_chunks"].currentText().startswith("Auto")
    # What open means comes from each declaration's `searched`: the planner never turns compile or FP8 on.
    for name in ("compile", "fp8"):
        box = page.recipe[name]
        assert [box.itemText(i) for i in range(box.count())] == ["Off: the planner never turns it on", "On"]
    plain = PLAIN
    fp32 = plan_for(qtbot, page, "llama-2-7b", seq_len=2048, batch=16, **plain)
    assert link.requests("plan")[-1]["workload"]["master_weights"] == "fp32"
    assert fp32["best"]["parallelism"]["offload_params"] or fp32["best"]["parallelism"]["offload_optimizer"]
    # Auto: the planner reaches for pure bf16 itself, says so, and the summary shows the recipe in words.
    auto = plan_for(qtbot, page, "llama-2-7b", seq_len=2048, batch=16, **dict.fromkeys(plain, "auto"))
    assert "master_weights" not in link.requests("plan")[-1]["workload"]  # left to the planner
    best = auto["best"]["parallelism"]
    assert not (best["offload_params"] or best["offload_optimizer"]) and auto["best"]["workload"]["master_weights"] == "bf16"
    assert f"Recipe: {auto['best']['recipe']}" in page.summary.text() and "pure bf16" in auto["best"]["recipe"]
    page.task.setCurrentIndex(page.task.findData("infer"))
    assert not page.workload_form.isRowVisible(page.master_weights)


def test_a_change_to_any_input_marks_the_plan_shown_stale_and_disables_launch(qtbot):
    """The plan stays on screen to compare, dimmed under a banner, and cannot be launched for inputs it was not
    made for; setting the input back, or planning again, makes it current. A machine switch clears it."""
    page, link = open_page(qtbot, "4x-rtx4090")
    plan_for(qtbot, page)
    assert not page.results.is_stale and page.launch_button.isEnabled()

    def changes_and_back(change, back) -> None:
        change()
        assert page.results.is_stale and not page.launch_button.isEnabled()
        assert page.results.stale.isVisible() and page.results.results_splitter.graphicsEffect() is not None
        assert page.table.isEnabled() and page.results.tabs.isEnabled()  # dimmed, still readable and scrollable
        assert "plan again" in page.launch_note.text()
        back()
        assert not page.results.is_stale and page.launch_button.isEnabled(), "back as planned: current again"

    seq, batch = page.seq_len.value(), page.batch.value()
    changes_and_back(lambda: page.seq_len.setValue(seq * 2), lambda: page.seq_len.setValue(seq))
    changes_and_back(lambda: page.batch.setValue(batch + 1), lambda: page.batch.setValue(batch))
    method = page.method.currentIndex()
    changes_and_back(lambda: page.method.setCurrentIndex((method + 1) % page.method.count()),
                     lambda: page.method.setCurrentIndex(method))  # fmt: skip
    optimizer = page.recipe["optimizer"]
    changes_and_back(lambda: optimizer.setCurrentIndex((optimizer.currentIndex() + 1) % optimizer.count()),
                     lambda: optimizer.setCurrentIndex(0))  # fmt: skip
    changes_and_back(lambda: page.nodes.setValue(2), lambda: page.nodes.setValue(1))  # in the GPUs box
    gpus = page.gpus.selected()
    changes_and_back(lambda: page.gpus.set_selected(gpus[:2]), lambda: page.gpus.set_selected(gpus))
    changes_and_back(lambda: page.picker.set_model("llama-2-13b", chosen=False),
                     lambda: page.picker.set_model(PRESET_7B, chosen=False))  # fmt: skip
    page.batch.setValue(batch + 1)
    assert page.results.is_stale
    with qtbot.waitSignal(page.sig_plan_ready, timeout=20000):
        page.plan_button.click()
    assert not page.results.is_stale and page.launch_button.isEnabled()
    # The engine's machine switched (Settings): the plan for the one before goes, and the page says why.
    link.machine_obj = make_machine("8x-h100-sxm")
    link.machine = link.machine_obj.to_dict()
    link.sig_machine.emit(link.machine)
    assert page.result is None and not page.launch_button.isEnabled()
    assert "8×H100" in page.status.text() and "plan again" in page.status.text()
    assert "4×RTX 4090" not in page.summary.text() + page.explanation.toPlainText()
    # Another machine under the same label (other links between the same GPUs) is another machine too.
    with qtbot.waitSignal(page.sig_plan_ready, timeout=20000):
        page.plan_button.click()
    rewired = link.machine_obj.to_dict()
    rewired["pairs"] = [{**p, "topo": "SYS", "pcie": "SYS", "nvlink_count": 0, "nvswitch": False}
                        for p in rewired["pairs"]]  # fmt: skip
    assert rewired["label"] == link.machine["label"]
    link.sig_machine.emit(rewired)
    assert page.result is None and "plan again" in page.status.text()
    assert page.rented.comparison is None


def test_every_plans_layout_reads_whole_at_1280_by_800(qtbot):
    """The layout is the answer: its column takes the room the figures leave and wraps, so each row shows its
    layout whole, with no sideways scrolling; the reason a plan does not run is on hover and beside Launch."""
    from PySide6.QtCore import QRect

    from rigpilot.app.planner.results_view import LAYOUT_COLUMN

    page, _ = open_page(qtbot, "4x-rtx4090")
    plan_for(qtbot, page)
    table = page.table
    qtbot.wait(10)  # the header's resize-to-contents settles in the event loop
    shown = [c for c in range(table.columnCount()) if not table.isColumnHidden(c)]
    assert sum(table.columnWidth(c) for c in shown) <= table.viewport().width() + 1
    fm = table.fontMetrics()
    width = table.columnWidth(LAYOUT_COLUMN) - 2 * table.style().pixelMetric(table.style().PixelMetric.PM_FocusFrameHMargin) - 4
    assert table.rowCount() >= 2
    for r in range(table.rowCount()):
        text = table.item(r, LAYOUT_COLUMN).text()
        assert len(text) > 40, text  # the whole sentence, not a short form
        need = fm.boundingRect(QRect(0, 0, width, 10_000), int(Qt.TextFlag.TextWordWrap), text).height()
        assert table.rowHeight(r) >= need, (r, text, table.rowHeight(r), need)
    # A plan over 90% of its fullest GPU says "tight" on its own line there, with why on hover.
    from rigpilot.app.planner.model import plans_of, shown_total
    from rigpilot.app.planner.results_view import FULLEST_COLUMN, TIGHT_TIP

    fills = [max(shown_total(m) / m["capacity"] for m in p["memory"]) for p in plans_of(page.result)]
    assert any(f > 0.9 for f in fills) and any(f <= 0.9 for f in fills)  # both kinds on this machine
    for r, fill in enumerate(fills):
        cell = table.item(r, FULLEST_COLUMN)
        assert cell.text().endswith("\ntight") == (0.9 < fill <= 1.0), (r, fill, cell.text())
        assert (cell.toolTip() == TIGHT_TIP) == (0.9 < fill <= 1.0)
