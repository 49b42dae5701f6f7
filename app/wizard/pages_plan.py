"""The plan page (the engine's recommendation, alternatives, overrides checked live) and the hyper-parameters."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.planner.memory_chart import MemoryChart
from rigpilot.app.planner.model import (
    change_text,
    context_to_fit,
    error_text,
    explanation_lines,
    plan_runs_here,
    plans_of,
    recipe_values,
    summary_lines,
    tokens_per_s,
)
from rigpilot.app.widgets.form_row import form_row
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.palette import BAD, status_text
from rigpilot.app.widgets.style import set_status
from rigpilot.app.wizard.data_check import CHAT, INSTRUCTION
from rigpilot.app.wizard.host import HYPER, REVIEW, WizardHost
from rigpilot.app.wizard.page_base import StepPage
from rigpilot.app.wizard.state import INFER, INFER_BACKEND_CHOICES
from rigpilot.engine.capability import why_not
from rigpilot.engine.jobspec.spec import INFER_SETTINGS, JOB_SETTINGS
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS as TRAIN
from rigpilot.engine.layout import LAYOUT_SETTINGS as LAYOUT
from rigpilot.engine.layout import Layout
from rigpilot.engine.planner.overrides import Overrides
from rigpilot.engine.recipe import RECIPE_SETTINGS
from rigpilot.engine.schema import Checkpointing, Range, Setting, shown_value

PIPELINE_SCHEDULES = [("1f1b", "1F1B"), ("gpipe", "GPipe")]  # as the planner writes them
CHECKPOINTING = [
    (Checkpointing.NONE.value, "none (fastest, most memory)"),
    (Checkpointing.SELECTIVE.value, "selective (recompute attention)"),
    (Checkpointing.FULL.value, "full (recompute every layer: least memory)"),
]


INT_MAX = 2**31 - 1  # a QSpinBox holds a C int


def _setting_spin(name: str, s: Setting) -> QSpinBox:
    """A spin box bounded as setting `s` is declared (within what a QSpinBox holds); 0 in its words."""
    lo, hi = (int(s.bound.lo), int(s.bound.hi)) if isinstance(s.bound, Range) else (0, INT_MAX)
    box = _spin(name, max(lo, -INT_MAX), min(hi, INT_MAX))
    if s.zero_words and lo == 0:
        box.setSpecialValueText(s.zero_words)
    return box


def _setting_double(name: str, s: Setting, decimals: int, step: float) -> QDoubleSpinBox:
    """A decimal box bounded as setting `s` is declared; an open end is the nearest value the box can show."""
    assert isinstance(s.bound, Range)
    tick = 10.0**-decimals
    box = QDoubleSpinBox()
    box.setObjectName(name)
    box.setDecimals(decimals)
    box.setRange(s.bound.lo + (tick if s.bound.lo_open else 0.0), s.bound.hi - (tick if s.bound.hi_open else 0.0))
    box.setSingleStep(step)
    return box


def _setting_row(form: QFormLayout, s: Setting, control: QWidget) -> QWidget:
    return form_row(form, s.label, control, s.help)


# Training settings the task and the plan decide; each other setting with choices gets a drop-down on the
# hyper-parameters page straight from its declaration, so a new one appears there without an edit here.
DECIDED_ELSEWHERE = frozenset({"method", "precision", "activation_checkpointing"})
# A recipe drop-down's first choice: what the plan chose, left to the planner (not pinned).
FROM_PLAN = "from the plan"


def recipe_settings() -> list[Setting]:
    """The training recipe (engine.recipe), each as the job declares it: a drop-down each, "from the plan" first."""
    return [TRAIN[name] for name in RECIPE_SETTINGS]


def choice_settings() -> list[Setting]:
    """The other training settings with choices that neither the task nor the plan decides."""
    return [s for name, s in TRAIN.items() if s.choices and name not in DECIDED_ELSEWHERE | RECIPE_SETTINGS.keys()]


def _object_name(s: Setting) -> str:
    head, *rest = s.name.split("_")
    return head + "".join(w.title() for w in rest)


def _setting_combo(s: Setting) -> QComboBox:
    box = QComboBox()
    box.setObjectName(_object_name(s))
    for choice in s.choices or ():
        box.addItem(choice, choice)
    return box


def _recipe_combo(s: Setting) -> QComboBox:
    """"From the plan" (worded with the plan's value when the page opens), then the setting's values in the app's
    words, as the Planner page offers them."""
    box = QComboBox()
    box.setObjectName(_object_name(s))
    box.addItem("From the plan", FROM_PLAN)
    for value, text in recipe_values(s.name):
        box.addItem(text, value)
    return box


def _value_text(box: QComboBox, s: Setting, value: Any) -> str:
    index = box.findData(value)
    return box.itemText(index) if index > 0 else shown_value(s, value)


def conflict_of(settings: Any) -> tuple[Setting, str] | None:
    """The first contradiction between the training settings: the setting whose value needs another's, and
    that in the controls' words; None where there is none."""
    for decl in TRAIN.values():
        error = decl.conflict(settings)
        if error is not None:
            f = error.fields
            other = TRAIN[f["other"].rpartition(".")[2]]
            return decl, f"{decl.label} “{f['value']}” needs {other.label} “{f['needs']}” (it is “{f['found']}”)."
    return None


def _spin(name: str, low: int, high: int) -> QSpinBox:
    box = QSpinBox()
    box.setObjectName(name)
    box.setRange(low, high)
    box.setAccelerated(True)
    return box


class PlanPage(StepPage):
    def __init__(self, wizard: WizardHost):
        super().__init__(
            wizard, "Plan", "How the job is split over the GPUs. Change it if you like: memory is re-checked as you go."
        )
        self.result: dict[str, Any] | None = None  # the search result the alternatives come from
        self._plan_check: Any = None  # the plan request whose memory check may still be under way
        self.base: dict[str, Any] | None = None  # the alternative the overrides apply to
        self.headline = QLabel()
        self.headline.setObjectName("planHeadline")
        self.headline.setWordWrap(True)
        self.headline.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.alternatives = QListWidget()
        self.alternatives.setObjectName("planAlternatives")
        self.alternatives.setAccessibleName("Recommended plan and alternatives")
        self.alternatives.setWordWrap(True)
        self.alternatives.currentRowChanged.connect(self._alternative_chosen)
        self.dp = _setting_spin("overrideDp", LAYOUT["dp_replicate"])  # data parallelism, replicated or sharded
        self.tp = _setting_spin("overrideTp", LAYOUT["tp"])
        self.pp = _setting_spin("overridePp", LAYOUT["pp"])
        self.micro = _setting_spin("overrideMicroBatch", TRAIN["micro_batch"])
        self.checkpointing = QComboBox()
        self.checkpointing.setObjectName("overrideCheckpointing")
        for key, text in CHECKPOINTING:
            self.checkpointing.addItem(text, key)
        self.schedule = QComboBox()
        self.schedule.setObjectName("overridePpSchedule")
        for key, text in PIPELINE_SCHEDULES:
            self.schedule.addItem(text, key)
        self.pp_microbatches = _spin("overridePpMicrobatches", 0, int(LAYOUT["pp_microbatches"].hi))
        self.pp_microbatches.setSpecialValueText("as accumulated, at least the stages")
        self.sequence_parallel = QCheckBox("Sequence parallel")
        self.sequence_parallel.setObjectName("overrideSequenceParallel")
        self.cpu_offload = QCheckBox("Offload to host RAM (FSDP2)")
        self.cpu_offload.setObjectName("overrideCpuOffload")
        self.reset_button = QPushButton("Back to this alternative as planned")
        set_icon(self.reset_button, "revert")
        self.reset_button.setObjectName("resetOverrides")
        self.reset_button.clicked.connect(lambda: self._show_alternative(self.base))
        self.replan_button = QPushButton("Plan again")
        set_icon(self.replan_button, "plan")
        self.replan_button.setObjectName("replan")
        self.replan_button.clicked.connect(self.request_plan)
        overrides = QGroupBox("Your changes")
        form = QFormLayout(overrides)
        form_row(form, "Data parallel (dp)", self.dp, "Replicas (or shards) of the model, each on its own data.",
                 compact=True)  # fmt: skip
        form_row(form, "Tensor parallel (tp)", self.tp, "GPUs each layer's matrices are split over.", compact=True)
        form_row(form, "Pipeline stages (pp)", self.pp, "Groups of layers, one after another.", compact=True)
        self.micro_row = form_row(
            form, "Micro-batch", self.micro, "Sequences each GPU processes at once.", compact=True
        )
        self.checkpointing_row = form_row(
            form, "Activation checkpointing", self.checkpointing,
            "Recompute activations in the backward pass instead of keeping them: less memory, more time.",
            compact=True,
        )  # fmt: skip
        self.schedule_row = form_row(
            form, "Pipeline schedule", self.schedule,
            "1F1B interleaves forward and backward passes (less activation memory); GPipe runs all forwards first.",
            compact=True,
        )  # fmt: skip
        self.pp_microbatches_row = form_row(
            form, "Pipeline micro-batches", self.pp_microbatches,
            "Micro-batches in flight through the stages per step; fewer than the stages leaves stages idle.",
            compact=True,
        )  # fmt: skip
        self.sequence_parallel_row = form_row(
            form, "", self.sequence_parallel,
            "Splits norms and dropout along the sequence over the tensor-parallel GPUs: less activation memory.",
            compact=True,
        )  # fmt: skip
        self.cpu_offload_row = form_row(
            form, "", self.cpu_offload,
            "Parameters, gradients and the optimizer step live in host RAM: far less GPU memory, much slower.",
            compact=True,
        )  # fmt: skip
        buttons = QHBoxLayout()
        buttons.addWidget(self.reset_button)
        buttons.addWidget(self.replan_button)
        form.addRow(buttons)
        self.override_form = form
        for box in (self.dp, self.tp, self.pp, self.micro):
            box.valueChanged.connect(self._override_changed)
        self.checkpointing.currentIndexChanged.connect(self._override_changed)
        self.schedule.currentIndexChanged.connect(self._override_changed)
        self.sequence_parallel.toggled.connect(self._override_changed)
        self.cpu_offload.toggled.connect(self._override_changed)
        self.pp_microbatches.valueChanged.connect(self._pp_microbatches_changed)
        self.chart = MemoryChart()
        self.explanation = QPlainTextEdit()
        self.explanation.setObjectName("planWhy")
        self.explanation.setReadOnly(True)
        self.explanation.setTabChangesFocus(True)
        self.explanation.setMaximumHeight(90)

        left = QVBoxLayout()
        left.addWidget(QLabel("Recommended first, then alternatives:"))
        left.addWidget(self.alternatives, 1)
        left.addWidget(overrides)
        right = QVBoxLayout()
        right.addWidget(self.chart, 1)
        right.addWidget(self.explanation)
        row = QHBoxLayout()
        row.addLayout(left, 2)
        row.addLayout(right, 3)
        self.body.addWidget(self.headline)
        self.body.addLayout(row, 1)
        self.body.addWidget(self.message)
        self.body.addWidget(self.fix_button, 0, Qt.AlignmentFlag.AlignLeft)

    # -- entering -------------------------------------------------------------------------------------
    def load(self) -> None:
        training = self.state.training
        self.override_form.setRowVisible(self.micro_row, training)
        self.override_form.setRowVisible(self.checkpointing_row, training)
        self._show_applicable_rows()
        if self.state.plan_is_current() and self.state.plan is not None:
            self._show_overrides(self.state.plan)
            self._show_plan(self.state.plan)
            if self.result is None:
                self.result = {"best": self.state.plan, "runners_up": [], "explanation": []}
                self._fill_alternatives()
            return
        self.result = None
        self.request_plan()

    def validate(self) -> None:
        if not self.busy and self.state.plan is not None:
            self._verdict(self.state.plan)

    def request_plan(self) -> None:
        """Ask the engine for a recommendation."""
        self.state.take_plan(None)
        self.base = None
        self.alternatives.clear()
        self.chart.clear()
        self.headline.setText("")
        self.explanation.setPlainText("")
        self.cancel_checks()
        self.busy = True
        self.set_problem(None, note="Asking the planner for the best way to split this job…")
        if self._plan_check is not None:
            self._plan_check.cancel()  # a memory check still on its way was of the choices before
        # The formula's plan shows at once; the plan traced by the engine replaces it when its check is done.
        self._plan_check = self.wiz.request_plan(
            self._planned, self._plan_failed, on_formula=self._planned, on_progress=self._verifying
        )

    def _verifying(self, done: int, of: int) -> None:
        if self.problem is None:
            self.set_problem(None, note=f"Checking the memory of the top plans: {done} of {of} traced…")

    def _planned(self, result: dict[str, Any]) -> None:
        self.busy = False
        self.result = result
        self._fill_alternatives()
        lines = explanation_lines(result)  # the settings named by their controls, not by CLI flags
        if result.get("best") is None:
            changes = [change_text(s) for s in result.get("suggestions") or []]
            self.headline.setText("Nothing fits on the selected GPUs.")
            self.explanation.setPlainText("\n".join(f"• {line}" for line in lines))
            self.set_problem(
                "Nothing fits. " + (f"Try: {'; '.join(changes)}." if changes else "Choose more or larger GPUs.")
            )
            return
        self.explanation.setPlainText("\n".join(f"• {line}" for line in lines))
        self.alternatives.setCurrentRow(0)

    def _plan_failed(self, error: BaseException) -> None:
        self.busy = False
        self.result = None
        self.set_problem(f"No plan: {error_text(error)}")
        context = context_to_fit(error)
        if context is not None:
            self.offer_fix(f"Use {context} tokens (the model's context)", lambda: self._use_context(context))

    def _use_context(self, context: int) -> None:
        self.state.fit_to_context(context)
        self.request_plan()

    def _fill_alternatives(self) -> None:
        self.alternatives.blockSignals(True)
        self.alternatives.clear()
        for i, plan in enumerate(plans_of(self.result or {})):
            speed = tokens_per_s(plan["timing"].get("tokens_per_s"), plan["workload"]["task"] == "train")
            label = "Recommended" if i == 0 else f"Alternative {i}"
            runs, why = plan_runs_here(plan)
            text = f"{label}: {plan['parallelism']['family']} — {speed}\n{summary_lines(plan)[0]}"
            item = QListWidgetItem(text if runs else f"{text}\nDoes not run here: {why}")
            if not runs:
                item.setForeground(status_text(BAD, self.palette()))
                item.setToolTip(f"The engine does not run this plan: {why}")
            item.setData(Qt.ItemDataRole.UserRole, plan)
            self.alternatives.addItem(item)
        self.alternatives.blockSignals(False)

    # -- choosing and changing -------------------------------------------------------------------------
    def _alternative_chosen(self, row: int) -> None:
        item = self.alternatives.item(row)
        if item is not None:
            self._show_alternative(item.data(Qt.ItemDataRole.UserRole))

    def _show_alternative(self, plan: dict[str, Any] | None) -> None:
        if plan is None:
            return
        self.cancel_checks()  # a re-check still on its way was of the changes this undoes
        self.base = plan
        self.state.take_plan(plan)
        self._show_overrides(plan)
        self._show_plan(plan)
        self._verdict(plan)

    def _show_overrides(self, plan: dict[str, Any]) -> None:
        par = plan["parallelism"]
        with self.quietly():
            self.dp.setValue(par["dp"])
            self.tp.setValue(par["tp"])
            self.pp.setValue(par["pp"])
            self.micro.setValue(par["micro_batch"])
            self.checkpointing.setCurrentIndex(max(self.checkpointing.findData(par["checkpointing"]), 0))
            self.schedule.setCurrentIndex(max(self.schedule.findData(par.get("pipeline_schedule")), 0))
            self.sequence_parallel.setChecked(bool(par.get("sequence_parallel")))
            self.cpu_offload.setChecked(bool(par.get("offload_params") or par.get("offload_optimizer")))
            self.pp_microbatches.setValue(self.state.pp_microbatches)
        if self.base is None:
            self.base = plan
        self._show_applicable_rows()

    def _show_applicable_rows(self) -> None:
        """Each setting only where it means something for the layout in the degrees' boxes."""
        form, training = self.override_form, self.state.training
        tp, pp = self.tp.value(), self.pp.value()
        form.setRowVisible(self.schedule_row, pp > 1)
        form.setRowVisible(self.pp_microbatches_row, pp > 1)
        form.setRowVisible(self.sequence_parallel_row, tp > 1)
        # Offered where the engine's capability contract runs an offloaded layout of this job.
        offloaded = Layout(tp=tp, pp=pp, cpu_offload=True)
        form.setRowVisible(self.cpu_offload_row, training and why_not(offloaded, method=self.state.train_method) is None)

    def _pp_microbatches_changed(self, value: int) -> None:
        if not self.changing():
            self.state.pp_microbatches = value

    def overrides(self) -> Overrides:
        return Overrides(
            dp=self.dp.value(), tp=self.tp.value(), pp=self.pp.value(),
            micro_batch=self.micro.value() if self.state.training else None,
            checkpointing=self.checkpointing.currentData() if self.state.training else None,
            pp_schedule=self.schedule.currentData() if self.pp.value() > 1 else None,
            sequence_parallel=self.sequence_parallel.isChecked() if self.tp.value() > 1 else None,
            cpu_offload=self.cpu_offload.isChecked() if self.cpu_offload_row.isVisibleTo(self) else None,
        )  # fmt: skip

    def _override_changed(self) -> None:
        if self.changing() or self.base is None:
            return
        self._show_applicable_rows()
        if not self.wiz.engine_connected():
            self.cancel_checks()
            self.set_problem(None, note="Not re-checked: the engine is not connected.", tone="warn")
            return
        base, overrides = self.base, self.overrides()
        self.check_with_engine(
            lambda done, failed: self.wiz.recheck(base, overrides, done, failed),
            self.apply_check, lambda e: self.set_problem(error_text(e)), "Re-checking your changes…",
        )  # fmt: skip

    def apply_check(self, result: dict[str, Any]) -> None:
        """The engine's re-check of the changed plan: show it and say whether it fits."""
        self.state.take_plan(result["plan"])
        self._show_plan(result["plan"])
        self._verdict(result["plan"])

    def _show_plan(self, plan: dict[str, Any]) -> None:
        self.chart.show_memory(plan.get("memory") or [])
        self.headline.setText("\n".join(summary_lines(plan)))

    def _verdict(self, plan: dict[str, Any]) -> None:
        runs, why = plan_runs_here(plan)
        if not runs:
            self.set_problem(f"The engine does not run this plan: {why}. Choose another alternative or change it.")
            return
        memory = plan.get("memory") or []
        worst = min(memory, key=lambda m: m["headroom"], default=None)
        host = plan.get("host") or {}
        if host.get("available") and host["needed"] > host["available"]:
            self.set_problem(
                f"Does not fit: the host needs {host['needed'] / 2**30:.0f} GiB of RAM and has "
                f"{host['available'] / 2**30:.0f} GiB."
            )
        elif worst is not None and worst["headroom"] < 0:
            self.set_problem(
                f"Does not fit: GPU {worst['gpu']} needs {worst['total'] / 2**30:.1f} GiB of "
                f"{worst['capacity'] / 2**30:.1f} GiB. Lower the micro-batch, checkpoint activations or shard more."
            )
        else:
            changed = any("changed in the wizard" in n for n in plan.get("notes") or [])
            self.set_problem(None, note="Your changes fit." if changed else None, tone="ok")

    def nextId(self) -> int:
        return HYPER


class HyperPage(StepPage):
    def __init__(self, wizard: WizardHost):
        super().__init__(wizard, "Hyper-parameters", "Sensible defaults are filled in; each says what it does.")
        t = QFormLayout()
        self.train_form = t
        self.steps = _setting_spin("steps", TRAIN["max_steps"])
        self.lr = _setting_double("learningRate", TRAIN["learning_rate"], 6, 1e-4)
        self.warmup = _setting_spin("warmup", TRAIN["warmup_steps"])
        self.micro = _setting_spin("microBatch", TRAIN["micro_batch"])
        self.accum = _setting_spin("gradAccum", TRAIN["grad_accum"])
        self.seq_len = _setting_spin("seqLen", TRAIN["seq_len"])
        self.seq_len.setSingleStep(64)
        self.lora_rank = _setting_spin("loraRank", TRAIN["lora_rank"])
        self.lora_alpha = _setting_spin("loraAlpha", TRAIN["lora_alpha"])
        self.lora_targets = QLineEdit()
        self.lora_targets.setObjectName("loraTargets")
        self.lora_targets.setPlaceholderText("q_proj,k_proj,v_proj,o_proj (empty: attention and MLP projections)")
        self.checkpoint_every = _setting_spin("checkpointEvery", TRAIN["checkpoint_every"])
        self.keep_checkpoints = _setting_spin("keepCheckpoints", TRAIN["keep_checkpoints"])
        self.max_restarts = _spin("maxRestarts", -1, 100)
        self.max_restarts.setSpecialValueText("automatic")
        self.tensorboard = QCheckBox("Also write TensorBoard event files")
        self.tensorboard.setObjectName("tensorboard")
        self.save_merged = QCheckBox("Also save the weights with the adapters merged in")
        self.save_merged.setObjectName("saveMerged")
        self.train_on_prompts = QCheckBox("Train on the prompts too")
        self.train_on_prompts.setObjectName("trainOnPrompts")
        self.eval_every = _setting_spin("evalEvery", TRAIN["eval_every"])
        self.seed = _setting_spin("seed", TRAIN["seed"])
        # Labels and explanations are the settings' declarations (engine.jobspec.spec), as the CLI's help is.
        for name, control in (("max_steps", self.steps), ("learning_rate", self.lr), ("warmup_steps", self.warmup),
                              ("micro_batch", self.micro), ("grad_accum", self.accum), ("seq_len", self.seq_len)):
            _setting_row(t, TRAIN[name], control)
        self.lora_rows = [_setting_row(t, TRAIN[name], control) for name, control in (
            ("lora_rank", self.lora_rank), ("lora_alpha", self.lora_alpha), ("lora_targets", self.lora_targets),
            ("save_merged", self.save_merged))]
        _setting_row(t, TRAIN["checkpoint_every"], self.checkpoint_every)
        _setting_row(t, TRAIN["keep_checkpoints"], self.keep_checkpoints)
        restarts = JOB_SETTINGS["max_restarts"]
        form_row(t, restarts.label, self.max_restarts, f"{restarts.help} Automatic: {restarts.default_words}.")
        _setting_row(t, JOB_SETTINGS["tensorboard"], self.tensorboard)
        self.prompts_row = form_row(
            t,
            "Chat data",
            self.train_on_prompts,
            "Chat and instruction files: off, the loss covers the answers only (the usual way to fine-tune on them).",
        )
        _setting_row(t, TRAIN["eval_every"], self.eval_every)
        _setting_row(t, TRAIN["seed"], self.seed)
        self.choices = {decl.name: _setting_combo(decl) for decl in choice_settings()}
        for decl in choice_settings():
            _setting_row(t, decl, self.choices[decl.name])
        recipe_head = QLabel("Memory and speed recipe: “From the plan” keeps what the planner chose for the job")
        recipe_head.setObjectName("recipeHeading")
        recipe_head.setWordWrap(True)
        t.addRow(recipe_head)
        self.recipe = {decl.name: _recipe_combo(decl) for decl in recipe_settings()}
        for decl in recipe_settings():
            _setting_row(t, decl, self.recipe[decl.name])
        self.train_box = QWidget()
        self.train_box.setLayout(t)

        i = QFormLayout()
        self.new_tokens = _setting_spin("maxNewTokens", INFER_SETTINGS["max_new_tokens"])
        self.batch = _setting_spin("inferBatch", INFER_SETTINGS["batch_size"])
        self.context = _setting_spin("context", TRAIN["seq_len"])  # prompt and answer: the sequence the job holds
        self.temperature = _setting_double("temperature", INFER_SETTINGS["temperature"], 2, 0.1)
        self.top_p = _setting_double("topP", INFER_SETTINGS["top_p"], 2, 0.05)
        self.infer_seed = _setting_spin("inferSeed", INFER_SETTINGS["seed"])
        self.backend = QComboBox()
        self.backend.setObjectName("inferBackend")
        for key, text in INFER_BACKEND_CHOICES:
            self.backend.addItem(text, key)
        _setting_row(i, INFER_SETTINGS["max_new_tokens"], self.new_tokens)
        _setting_row(i, INFER_SETTINGS["batch_size"], self.batch)
        form_row(i, "Context", self.context, "Prompt plus answer tokens the KV cache is planned for.")
        _setting_row(i, INFER_SETTINGS["temperature"], self.temperature)
        _setting_row(i, INFER_SETTINGS["top_p"], self.top_p)
        _setting_row(i, INFER_SETTINGS["seed"], self.infer_seed)
        backend = INFER_SETTINGS["backend"]
        form_row(i, backend.label, self.backend, f"{backend.help} The Review page says which one runs, and why.")
        self.infer_box = QWidget()
        self.infer_box.setLayout(i)

        self.trust = QCheckBox("Trust remote code")
        self.trust.setObjectName("trustRemoteCode")
        # The warning stays in view whether the box is ticked or not: it is why the default is off.
        self.trust_warning = QLabel(
            "⚠ Runs Python code from the model's repository on this machine, with your rights. "
            "Turn it on only for models whose code you trust."
        )
        self.trust_warning.setObjectName("trustWarning")
        self.trust_warning.setWordWrap(True)
        set_status(self.trust_warning, "warn")
        self.trust.toggled.connect(self._changed)

        content = QWidget()
        cl = QVBoxLayout(content)
        cl.addWidget(self.train_box)
        cl.addWidget(self.infer_box)
        cl.addWidget(self.trust)
        cl.addWidget(self.trust_warning)
        cl.addStretch(1)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setWidget(content)
        self.scroll.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.coverage = QLabel()
        self.coverage.setObjectName("dataCoverage")
        self.coverage.setWordWrap(True)
        self.body.addWidget(self.coverage)
        self.body.addWidget(self.scroll, 1)
        self.body.addWidget(self.message)
        self.body.addWidget(self.fix_button, 0, Qt.AlignmentFlag.AlignLeft)
        for box in (self.steps, self.warmup, self.micro, self.accum, self.seq_len, self.lora_rank, self.lora_alpha,
                    self.checkpoint_every, self.eval_every, self.seed, self.new_tokens, self.batch, self.context,
                    self.infer_seed):  # fmt: skip
            box.valueChanged.connect(self._changed)
        for dbox in (self.lr, self.temperature, self.top_p):
            dbox.valueChanged.connect(self._changed)
        self.lora_targets.editingFinished.connect(self._changed)
        self.keep_checkpoints.valueChanged.connect(self._changed)
        self.max_restarts.valueChanged.connect(self._changed)
        self.train_on_prompts.toggled.connect(self._changed)
        self.save_merged.toggled.connect(self._changed)
        self.tensorboard.toggled.connect(self._changed)
        self.backend.currentIndexChanged.connect(self._changed)
        for combo in (*self.choices.values(), *self.recipe.values()):
            combo.currentIndexChanged.connect(self._changed)

    def load(self) -> None:
        s = self.state
        infer = s.kind == INFER
        self.train_box.setVisible(not infer)
        self.infer_box.setVisible(infer)
        lora = s.adapters
        for row in self.lora_rows:
            self.train_form.setRowVisible(row, lora)
        # Only conversations have prompts to leave out of the loss (unknown data: offer it anyway).
        report = self.wiz.data_report()
        chat = report is None or any(f.kind in (CHAT, INSTRUCTION) for f in report.files)
        self.train_form.setRowVisible(self.prompts_row, chat)
        t, i = s.train, s.infer
        self.steps.setValue(t.max_steps)
        self.lr.setValue(t.learning_rate)
        self.warmup.setValue(t.warmup_steps)
        self.micro.setValue(t.micro_batch)
        self.accum.setValue(t.grad_accum)
        self.seq_len.setValue(t.seq_len)
        self.lora_rank.setValue(t.lora_rank)
        self.lora_alpha.setValue(t.lora_alpha)
        self.lora_targets.setText(",".join(t.lora_targets or []))
        self.checkpoint_every.setValue(t.checkpoint_every)
        self.keep_checkpoints.setValue(t.keep_checkpoints)
        self.max_restarts.setValue(-1 if s.max_restarts is None else s.max_restarts)
        self.tensorboard.setChecked(s.tensorboard)
        self.train_on_prompts.setChecked(t.train_on_prompts)
        self.save_merged.setChecked(t.save_merged)
        self.eval_every.setValue(t.eval_every)
        self.seed.setValue(t.seed)
        for name, combo in self.choices.items():
            combo.setCurrentIndex(max(combo.findData(getattr(t, name)), 0))
        self._load_recipe()
        self.new_tokens.setValue(i.max_new_tokens)
        self.batch.setValue(i.batch_size)
        self.context.setValue(t.seq_len)
        self.temperature.setValue(i.temperature)
        self.top_p.setValue(i.top_p)
        self.infer_seed.setValue(i.seed)
        self.backend.setCurrentIndex(max(self.backend.findData(i.backend), 0))
        self.trust.setChecked(s.trust_remote_code)

    def _load_recipe(self) -> None:
        """Each recipe setting the user pinned shows its value; the others "from the plan", worded with the value
        the plan chose (without a plan: the engine's default), so taking a plan pins nothing."""
        s, t = self.state, self.state.train
        source = "From the plan" if s.plan is not None else "Default"
        for decl in recipe_settings():
            combo, name = self.recipe[decl.name], decl.name
            pinned = name in s.pinned_recipe
            planned = s.planned_recipe.get(name, decl.default) if pinned else getattr(t, name)
            combo.setItemText(0, f"{source}: {_value_text(combo, decl, planned)}")
            if not pinned:
                combo.setCurrentIndex(0)
                continue
            value = getattr(t, name)
            if combo.findData(value) < 0:  # a value the drop-down does not list (pinned elsewhere, --loss-chunks 64)
                combo.addItem(shown_value(decl, value), value)
            combo.setCurrentIndex(combo.findData(value))

    def _changed(self) -> None:
        if self.changing():
            return
        s, t, i = self.state, self.state.train, self.state.infer
        t.max_steps, t.learning_rate, t.warmup_steps = self.steps.value(), self.lr.value(), self.warmup.value()
        t.checkpoint_every, t.eval_every, t.seed = (
            self.checkpoint_every.value(),
            self.eval_every.value(),
            self.seed.value(),
        )
        t.lora_rank, t.lora_alpha = self.lora_rank.value(), self.lora_alpha.value()
        t.keep_checkpoints, t.train_on_prompts = self.keep_checkpoints.value(), self.train_on_prompts.isChecked()
        t.save_merged = self.save_merged.isChecked()
        for name, combo in self.choices.items():
            setattr(t, name, combo.currentData())
        for name, combo in self.recipe.items():
            value = combo.currentData()
            if value == FROM_PLAN:
                if name in s.pinned_recipe:  # given back to the planner
                    s.unpin_recipe(name)
            elif name not in s.pinned_recipe or value != getattr(t, name):  # the user's choice, pinned
                s.pin_recipe(name, value)
        s.max_restarts = None if self.max_restarts.value() < 0 else self.max_restarts.value()
        s.tensorboard = self.tensorboard.isChecked()
        targets = [x.strip() for x in self.lora_targets.text().split(",") if x.strip()]
        t.lora_targets = targets or None
        i.temperature, i.top_p, i.seed = self.temperature.value(), self.top_p.value(), self.infer_seed.value()
        i.backend = self.backend.currentData()
        s.trust_remote_code = self.trust.isChecked()
        self.validate()

    def overrides(self) -> Overrides:
        s = self.state
        if s.kind == INFER:
            return Overrides(seq_len=self.context.value(), global_batch=self.batch.value(),
                             new_tokens=self.new_tokens.value())  # fmt: skip
        lora = s.adapters
        work = (s.plan or {}).get("workload") or {}
        # The recipe settings changed from what the plan was sized for (a plan that does not say: the default).
        recipe = {name: getattr(s.train, name) for name in RECIPE_SETTINGS
                  if getattr(s.train, name) != (work.get(name) if work.get(name) is not None else TRAIN[name].default)}  # fmt: skip
        return Overrides(
            micro_batch=self.micro.value(), grad_accum=self.accum.value(), seq_len=self.seq_len.value(),
            lora_rank=self.lora_rank.value() if lora else None, lora_alpha=self.lora_alpha.value() if lora else None,
            lora_targets=self.state.train.lora_targets if lora else None,
            **recipe,
        )  # fmt: skip

    def validate(self) -> None:
        self._check()
        self._show_coverage()

    def _check(self) -> None:
        s = self.state
        self.cancel_checks()  # an answer on its way is for values changed since
        if s.training and self.warmup.value() >= self.steps.value():
            self.set_problem("Warm-up must be shorter than the run: fewer warm-up steps or more steps.")
            return
        if s.kind == INFER and self.new_tokens.value() >= self.context.value():
            self.set_problem("New tokens must leave room for the prompt in the context.")
            return
        conflict = conflict_of(s.train) if s.training else None
        if conflict is not None:
            decl, text = conflict
            self.set_problem(text)
            box, default = self.recipe.get(decl.name), decl.default
            if box is not None:  # the other setting is the task's or the plan's: offer to undo this one
                self.offer_fix(f"Use {decl.label.lower()} “{default}”",
                               lambda: box.setCurrentIndex(box.findData(default)))  # fmt: skip
            return
        if s.plan is None:
            self._store_unchecked()
            self.set_problem(None)
            return
        if not self.wiz.engine_connected():
            self._store_unchecked()
            self.set_problem(None, note="Memory is not re-checked: the engine is not connected.", tone="warn")
            return
        plan, overrides = s.plan, self.overrides()
        self.check_with_engine(
            lambda done, failed: self.wiz.recheck(plan, overrides, done, failed),
            self._rechecked, self._refused, "Re-checking memory…",
        )  # fmt: skip

    def _rechecked(self, result: dict[str, Any]) -> None:
        self.state.take_plan(result["plan"])
        if result["fits"]:
            self.set_problem(None, note=result["message"], tone="ok")
        else:
            self.set_problem(result["message"])

    def _refused(self, error: BaseException) -> None:
        self.set_problem(error_text(error))
        context = context_to_fit(error)
        if context is not None:
            box = self.context if self.state.kind == INFER else self.seq_len
            self.offer_fix(f"Use {context} tokens (the model's context)", lambda: box.setValue(context))

    def _show_coverage(self) -> None:
        """How much of the data the run sees: too few steps learn little, too many repeat it."""
        s, report = self.state, self.wiz.data_report()
        if not s.training or report is None or not report.token_estimate:
            self.coverage.hide()
            return
        seen = s.train.max_steps * s.global_batch * s.train.seq_len
        passes = seen / report.token_estimate
        self.coverage.setText(
            f"{s.train.max_steps} steps × {s.global_batch} sequences × {s.train.seq_len} tokens ≈ {seen:,} tokens: "
            f"about {passes:.1f} passes over the data (from its size estimate)."
        )
        self.coverage.show()

    def _store_unchecked(self) -> None:
        """Without a plan to re-check, the fields go into the job as they are."""
        s = self.state
        s.train.micro_batch, s.train.grad_accum, s.train.seq_len = (
            self.micro.value(),
            self.accum.value(),
            self.seq_len.value(),
        )
        if s.kind == INFER:
            s.train.seq_len = self.context.value()
            s.infer.max_new_tokens, s.infer.batch_size = self.new_tokens.value(), self.batch.value()

    def nextId(self) -> int:
        return REVIEW
