"""The Planner page: will this model fit on these GPUs, and what is the fastest way to split it?

The form on the left asks (`WorkloadForm`, the machine planned for and its
GPUs); the engine's `plan` request answers: the GUI runs no planner of its
own. The right side shows the answer (`PlanResults`: ranked plans, the chosen plan's memory per GPU, why it
won and why the others lost, suggestions when nothing fits) and what can be
done with it (`LaunchBar`: exports, and "Launch with this plan…", which opens
the job wizard). Every failure ends up as one line above the results, never a
dialog. This module only composes them and talks to the engine.

The machine planned for is this one (the engine's), a simulated profile or
an imported machine (the list the Topology page keeps): another machine is
planned by the engine too (the `plan` request's `machine`), without this
machine's calibration; its plans export, and launch only on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QByteArray, QSettings, Qt, Signal
from PySide6.QtGui import QShowEvent
from PySide6.QtWidgets import (
    QAbstractSpinBox,
    QCheckBox,
    QComboBox,
    QGroupBox,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.planner.gpu_selector import BusyGpus, GpuSelector
from rigpilot.app.planner.launch_bar import LaunchBar
from rigpilot.app.planner.machine_choice import MachineChoice
from rigpilot.app.planner.model import (
    AUTO,
    NODES_MAX,
    PlanRequest,
    context_to_fit,
    error_text,
    plan_runs_here,
    plans_of,
    recipe_choice,
)
from rigpilot.app.planner.results_view import TABLE_COLUMNS, PlanResults
from rigpilot.app.planner.workload_form import WorkloadForm
from rigpilot.app.topology.imported import HERE, ImportedMachines
from rigpilot.app.widgets.engine_messages import machine_dict, machine_identity
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import mark_primary
from rigpilot.engine.recipe import RECIPE_SETTINGS

__all__ = ["TABLE_COLUMNS", "PlannerPage", "duration_short"]

# "results_splitter" held the splitter below the form's results whether or not the user dragged it (and so kept a
# two-row table); only a dragged one is kept now, under this key.
RESULTS_SPLITTER_KEY = "plans_splitter"
# The form's settings as QSettings keys: (key, PlanRequest field, type).
_SAVED = [("model", "model", str), ("task", "task", str), ("method", "method", str), ("precision", "precision", str),
          ("master_weights", "master_weights", str),
          ("seq_len", "seq_len", int), ("batch", "batch", int), ("lora_rank", "lora_rank", int),
          ("weight_bits", "weight_bits", int), ("new_tokens", "new_tokens", int), ("offload", "offload", str),
          ("nodes", "nodes", int), ("internode", "internode", str)]  # fmt: skip


@dataclass
class MemoryCheck:
    """The memory check under way: which plans of which answer to trace, how far it got, and the request to
    send again once they are traced."""

    serial: int
    plans: list[dict[str, Any]]
    asked: dict[str, Any]
    result: dict[str, Any]
    done: int = 0


def duration_short(seconds: float) -> str:
    """A measured time that never reads "0.00 s": milliseconds below a second."""
    if seconds < 0.001:
        return "under 1 ms"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


class PlannerPage(QWidget):
    sig_plan_ready = Signal(dict)  # the search result (SearchResult.to_dict()) now shown
    sig_plan_failed = Signal(str)  # the message shown instead
    sig_plan_shown = Signal(dict)  # the plan (Plan.to_dict()) the chart, exports and launch now use
    sig_wizard_opened = Signal(object)  # the JobWizard "Launch with this plan…" opened
    sig_job_submitted = Signal(str)  # a job id, submitted from a wizard this page opened
    sig_plan_traced = Signal(int, dict)  # a plan's index in the result and its outcome, as each trace comes back
    sig_plan_verified = Signal(dict)  # the search result once its memory check is done (traced figures in it)
    sig_check_cancelled = Signal()  # the user stopped the memory check: the formula's figures stand

    def __init__(self, link: Any, parent: QWidget | None = None, *, machines: ImportedMachines | None = None):
        super().__init__(parent)
        self.link = link
        self.plan: dict[str, Any] | None = None  # the plan shown in the chart
        self.wizard: Any = None
        self._serial = 0  # replies to older requests are dropped
        self._check: MemoryCheck | None = None  # the memory check of the result shown, while it runs
        self._default_selection = True  # until the user picks, the selection follows which GPUs are free
        self._asked: dict[str, Any] | None = None  # what the result shown was planned for
        self._launchable = False  # whether the plan shown runs here, as the results said

        self.form = WorkloadForm()
        self.form.picker.sig_model_chosen.connect(lambda _: self.request_plan())
        self.choice = MachineChoice(machines if machines is not None else ImportedMachines(parent=self))
        self.choice.sig_changed.connect(self._target_changed)
        self.choice.sig_picked.connect(self._plan_if_asked)
        self.gpus = GpuSelector()
        self.gpus.sig_selection_changed.connect(self._user_selected)
        self.busy = BusyGpus(link, self)
        self.busy.sig_changed.connect(self._busy_changed)
        self.results = PlanResults()
        self.results.sig_plan_shown.connect(self._plan_shown)
        self.results.sig_apply.connect(self._apply_suggestion)
        self.launch_bar = LaunchBar()
        self.launch_bar.sig_launch.connect(self.open_wizard)
        self.launch_bar.sig_exported.connect(lambda *_: self.results.hide_message())
        self.launch_bar.exports.sig_export_failed.connect(self.results.show_message)
        self._aliases()
        self._lay_out()
        self.results.show_result(None)
        self._watch_inputs()

        link.sig_machine.connect(self.on_machine)
        if getattr(link, "machine", None):
            self.on_machine(link.machine)

    def _aliases(self) -> None:
        """The parts' controls by their old names: tests, screenshots and the main window reach them here."""
        f, r, a = self.form, self.results, self.launch_bar
        self.picker, self.task, self.method, self.lora_rank = f.picker, f.task, f.method, f.lora_rank
        self.quant, self.seq_len, self.batch, self.batch_label = f.quant, f.seq_len, f.batch, f.batch_label
        self.new_tokens, self.tokens, self.precision = f.new_tokens, f.tokens, f.precision
        self.master_weights, self.recipe = f.master_weights, f.recipe
        self.offload, self.force_tp, self.workload_form = f.offload, f.force_tp, f.workload_form
        self.nodes, self.internode, self.nodes_form = f.nodes, f.internode, f.nodes_form
        self.target, self.target_note = self.choice.target, self.choice.target_note
        self.message, self.fix_button, self.summary = r.message, r.fix_button, r.summary
        self.calibration, self.table, self.chart = r.calibration, r.table, r.chart
        self.explanation, self.rejected, self.suggestions = r.explanation, r.rejected, r.suggestions
        self.apply_button, self.tabs, self.rented = r.apply_button, r.tabs, r.rented
        self.results_splitter = r.results_splitter
        self.exports, self.launch_button = a.exports, a.launch_button
        self.launch_note, self.export_note = a.launch_note, a.export_note

    def _lay_out(self) -> None:
        self.plan_button = QPushButton("Plan")
        set_icon(self.plan_button, "plan")
        mark_primary(self.plan_button)
        self.plan_button.setObjectName("planButton")
        self.plan_button.setDefault(True)
        self.plan_button.setToolTip("Find the fastest way to split this workload over the selected GPUs")
        self.plan_button.clicked.connect(self.request_plan)
        self.status = QLabel("")
        self.status.setObjectName("planStatus")
        self.status.setWordWrap(True)
        self.cancel_check = QPushButton("Cancel memory check")
        set_icon(self.cancel_check, "cancel")
        self.cancel_check.setObjectName("cancelMemoryCheck")
        self.cancel_check.setToolTip("Stop tracing the plans' memory: the formula's figures stand")
        self.cancel_check.clicked.connect(self.cancel_memory_check)
        self.cancel_check.hide()
        gpu_box = QGroupBox("GPUs")
        gpu_layout = QVBoxLayout(gpu_box)
        gpu_layout.addWidget(self.choice)
        gpu_layout.addWidget(self.gpus)
        gpu_layout.addWidget(self.form.nodes_box)
        form = QWidget()
        form_layout = QVBoxLayout(form)
        for part in (self.form, gpu_box, self.plan_button, self.status, self.cancel_check):
            form_layout.addWidget(part)
        form_layout.addStretch(1)
        self.form_area = QScrollArea()
        self.form_area.setWidgetResizable(True)
        self.form_area.setWidget(form)
        self.form_area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.form_area.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        answer = QWidget()
        answer_layout = QVBoxLayout(answer)
        answer_layout.setContentsMargins(0, 0, 0, 0)
        answer_layout.addWidget(self.results, 1)
        answer_layout.addWidget(self.launch_bar)
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setObjectName("plannerSplitter")
        self.splitter.addWidget(self.form_area)
        self.splitter.addWidget(answer)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([360, 760])
        QVBoxLayout(self).addWidget(self.splitter)

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        # Scroll up and down only: the form is as wide as its widest row (known once styled), plus the scroll bar.
        form = self.form_area.widget()
        if form is None:
            return
        scroll_bar = self.form_area.verticalScrollBar().sizeHint().width()
        self.form_area.setMinimumWidth(form.minimumSizeHint().width() + scroll_bar + 2 * self.form_area.frameWidth())

    @property
    def result(self) -> dict[str, Any] | None:
        """The search result shown (None before the first, or after a failure)."""
        return self.results.result

    @property
    def machine(self) -> dict[str, Any] | None:
        """The engine's machine, once it said."""
        return self.choice.here

    @property
    def machines(self) -> ImportedMachines:
        return self.choice.machines

    # -- engine events ---------------------------------------------------------------------------
    def on_machine(self, message: dict[str, Any]) -> None:
        d = machine_dict(message)
        if not d:
            return
        before = machine_identity(self.choice.here)
        self.choice.set_here(d)
        if not self.choice.is_here():
            return
        if before is not None and before != machine_identity(d):
            # The engine's machine was switched: a plan for the one before says nothing about this one.
            self._serial += 1
            self._end_check()
            self._asked = None
            self.plan_button.setEnabled(True)
            self.status.setText(f"The machine is now {d.get('label', 'another one')}: plan again for it.")
            self.results.hide_message()
            self.results.show_result(None)
            self.results.planned_here(True)
            self.rented.clear()  # its comparison was for the machine before
        self.gpus.set_machine(d)
        if self._default_selection or not self.gpus.selected():
            self._default_selection = True
            self.gpus.set_selected(self.gpus.free() or sorted(self.gpus.boxes), emit=False)

    def _busy_changed(self, busy: dict[int, list[str]]) -> None:
        if not self.choice.is_here():
            return  # jobs run here; another machine's GPUs are all free
        self.gpus.set_busy(busy)
        if self._default_selection:
            self.gpus.set_selected(self.gpus.free() or sorted(self.gpus.boxes), emit=False)
            self._inputs_changed()

    def _user_selected(self, gpus: list[int]) -> None:
        self._default_selection = False

    # -- the machine planned for -------------------------------------------------------------------
    def use_machines(self, machines: ImportedMachines) -> None:
        """Share another page's list of imported machines (the main window gives the Topology page's)."""
        self.choice.use_machines(machines)

    def target_key(self) -> str:
        return self.choice.key()

    def target_machine(self) -> dict[str, Any] | None:
        """Machine.to_dict() of the machine planned for (None until the engine says what this one is)."""
        return self.choice.machine()

    def select_machine(self, key: str, *, plan: bool = False) -> bool:
        """Plan for HERE, a "profile:<id>" or an imported machine's key (as the Topology page names it);
        with `plan`, plan the form's model for it at once."""
        if not self.choice.select(key):
            return False
        if plan:
            self._plan_if_asked()
        return True

    def _plan_if_asked(self) -> None:
        # A machine picked by the user: plan the model already in the form for it.
        if self.picker.model().strip():
            self.request_plan()

    def _target_changed(self) -> None:
        d = self.choice.machine()
        self._serial += 1  # a reply for the machine before is not for this one
        self._end_check()
        self.plan_button.setEnabled(True)
        self.status.setText("")
        here = self.choice.is_here()
        self.results.other_machine = None if here else self.choice.title()
        self.results.hide_message()
        self.results.show_result(None)
        if d is None:
            return
        self.results.planned_here(here)
        self.gpus.set_busy(self.busy.busy if here else {})
        self.gpus.set_machine(d)
        self._default_selection = True
        self.gpus.set_selected((self.gpus.free() if here else []) or sorted(self.gpus.boxes), emit=False)

    # -- the form ------------------------------------------------------------------------------------
    def plan_request(self) -> PlanRequest:
        return self.form.request(self.gpus.selected())

    def set_request(self, r: PlanRequest) -> None:
        """Fill the form (a suggestion applied, restored settings, a test)."""
        self.form.set_request(r)
        if r.gpus:
            self.gpus.set_selected(r.gpus)

    # -- a result planned for other inputs -----------------------------------------------------------------
    def _watch_inputs(self) -> None:
        """Every control of the form, and the GPUs picked: a change marks the result shown as stale."""
        for part in (self.form, self.form.nodes_box):  # the nodes' controls sit in the GPUs box
            for box in part.findChildren(QComboBox):
                box.currentIndexChanged.connect(self._inputs_changed)
            for spin in part.findChildren(QAbstractSpinBox):
                spin.editingFinished.connect(self._inputs_changed)
                if hasattr(spin, "valueChanged"):
                    spin.valueChanged.connect(self._inputs_changed)
            for edit in part.findChildren(QLineEdit):
                if not isinstance(edit.parent(), QAbstractSpinBox | QComboBox):
                    edit.textChanged.connect(self._inputs_changed)
            for check in part.findChildren(QCheckBox):
                check.toggled.connect(self._inputs_changed)
        self.gpus.sig_selection_changed.connect(self._inputs_changed)

    def _asked_now(self, request: PlanRequest | None = None) -> dict[str, Any] | None:
        """The `plan` request the form makes now (None while it cannot make one)."""
        request = request or self.plan_request()
        try:
            if request.problem():
                return None
            other = self.choice.request_arg()
            return {"model": request.model, "workload": request.workload_args(), "gpus": request.gpus,
                    "options": request.options_args(), **({"machine": other} if other is not None else {})}  # fmt: skip
        except (ValueError, TypeError, KeyError):
            return None

    def _inputs_changed(self, *_: Any) -> None:
        """Whether the result shown is still for what the form asks: after any edit, and after each answer
        (the form may have changed while the plan or its memory check was under way)."""
        if self.results.result is None or self._asked is None:
            return
        stale = self._asked_now() != self._asked
        if stale != self.results.is_stale:
            self.results.set_stale(stale)
            self._offer_launch(self.plan if self._launchable else None)

    # -- planning --------------------------------------------------------------------------------------
    def request_plan(self) -> None:
        """Plan what the form asks; the answer (or the reason there is none) shows when it arrives."""
        request = self.plan_request()
        problem = request.problem()
        if problem:
            self.results.show_message(problem)
            return
        self._serial += 1
        serial = self._serial
        self._end_check()
        self.results.hide_message()
        self.status.setText(f"Planning {request.model}…")
        self.plan_button.setEnabled(False)
        if getattr(self.link, "state", None) != "connected":
            # Plans come from the engine alone (one planner, calibrated for this machine): say so, ask again later.
            self.plan_button.setEnabled(True)
            self.status.setText("")
            self.results.show_message("Not connected to the engine yet: plans come from it. Plan again once it is.")
            return
        asked = self._asked_now(request)
        if asked is None:  # the request has no problem, so it reads
            return
        self._ask(serial, asked, verify_later=True)

    def _ask(self, serial: int, asked: dict[str, Any], *, verify_later: bool) -> None:
        """The formula's answer first (milliseconds); the memory check follows plan by plan (_check_memory).
        An engine from before `verify` refuses the argument: it is asked again the old way, verified at once."""

        def answered(reply: dict[str, Any]) -> None:
            if serial == self._serial:
                self._asked = asked
            self._on_plan(serial, reply)
            self._check_memory(serial, reply, asked)

        def refused(error: BaseException) -> None:
            if verify_later and getattr(error, "code", None) == "invalid" and serial == self._serial:
                self._ask(serial, asked, verify_later=False)
                return
            self._on_plan_error(serial, error)

        later = {"verify": False} if verify_later else {}
        self.link.call("plan", on_done=answered, on_error=refused, **later, **asked)

    def _on_plan(self, serial: int, reply: dict[str, Any]) -> None:
        if serial != self._serial:
            return
        self.plan_button.setEnabled(True)
        result = reply.get("result", reply)
        self.status.setText(self._searched(result))
        self.results.hide_message()
        self.results.show_result(result)
        self._inputs_changed()
        self.rented.show_for(self.link, self.plan_request(), result, self.target_machine())
        self.sig_plan_ready.emit(result)

    @staticmethod
    def _searched(result: dict[str, Any], check: str = "") -> str:
        trace = result.get("trace") or {}
        line = f"{result.get('considered', 0)} layouts searched in {duration_short(result.get('elapsed_s') or 0.0)}."
        if trace.get("tried"):
            cached = f", {trace['cached']} from the trace cache" if trace.get("cached") else ""
            line += f" Memory traced for {trace['traced']} of {trace['tried']} plan(s) in {trace['seconds']:.1f} s{cached}."
        return f"{line} {check}" if check else line

    # -- the memory check: each top plan traced by the engine, shown as it comes ---------------------------
    def _check_memory(self, serial: int, reply: dict[str, Any], asked: dict[str, Any]) -> None:
        result = reply.get("result", reply)
        pending = int((result.get("trace") or {}).get("pending") or 0)
        plans = plans_of(result)[:pending]
        if serial != self._serial or not plans:
            return
        self._check = MemoryCheck(serial, plans, asked, result)
        self.cancel_check.show()
        self.cancel_check.setEnabled(True)
        self._trace_next()

    def _trace_next(self) -> None:
        check = self._check
        if check is None:
            return
        i = check.done
        if i >= len(check.plans):
            self.status.setText(self._searched(check.result, "Memory checked; ranking the traced plans…"))
            # The search again with verification on: the engine finds every trace in its cache, and ranks
            # and explains the plans with the traced figures counted (a plan that does not fit gives way).
            self.link.call("plan", on_done=lambda reply: self._verified(check, reply),
                           on_error=lambda e: self._check_failed(check, e), **check.asked)  # fmt: skip
            return
        self.status.setText(self._searched(check.result, f"Verifying memory: {i + 1} of {len(check.plans)} plans…"))
        self.link.call(
            "plan", on_done=lambda reply: self._traced(check, i, reply), on_error=lambda e: self._check_failed(check, e),
            model=check.asked["model"], gpus=check.asked["gpus"], trace={"plan": check.plans[i]},
        )  # fmt: skip

    def _traced(self, check: MemoryCheck, i: int, reply: dict[str, Any]) -> None:
        if check is not self._check:
            return  # cancelled, or another plan asked for since
        answer = reply.get("result", reply)
        self.results.update_plan(i, answer["plan"])
        check.done = i + 1
        self.sig_plan_traced.emit(i, answer.get("outcome") or {})
        self._trace_next()

    def _verified(self, check: MemoryCheck, reply: dict[str, Any]) -> None:
        if check is not self._check:
            return
        self._end_check()
        result = reply.get("result", reply)
        self.status.setText(self._searched(result))
        self.results.show_result(result)
        self._inputs_changed()
        self.rented.show_for(self.link, self.plan_request(), result, self.target_machine())
        self.sig_plan_verified.emit(result)

    def _check_failed(self, check: MemoryCheck, error: BaseException) -> None:
        if check is not self._check:
            return
        self._end_check()
        self.status.setText(self._searched(check.result, f"Memory check stopped ({error_text(error)}): "
                                                         "the formula's figures stand."))  # fmt: skip

    def cancel_memory_check(self) -> None:
        """Stop the memory check: no further plan is traced, a trace under way is not waited for."""
        check = self._check
        if check is None:
            return
        self._end_check()
        self.status.setText(self._searched(check.result, "Memory check cancelled: the formula's figures stand."))
        self.sig_check_cancelled.emit()

    def _end_check(self) -> None:
        self._check = None
        self.cancel_check.hide()

    def _on_plan_error(self, serial: int, error: BaseException) -> None:
        if serial != self._serial:
            return
        self.plan_button.setEnabled(True)
        self.status.setText("")
        self.results.show_result(None)
        self.results.show_message(error_text(error))
        context = context_to_fit(error)
        if context is not None:
            self.results.offer_fix(f"Use {context} tokens (the model's context)", lambda: self._use_seq_len(context))
        self.sig_plan_failed.emit(self.message.text())

    def _use_seq_len(self, tokens: int) -> None:
        self.form.use_seq_len(tokens)
        self.request_plan()

    # -- the plan shown ------------------------------------------------------------------------------
    def _plan_shown(self, plan: dict[str, Any] | None, launchable: bool) -> None:
        self.plan = plan
        self._launchable = launchable
        self.launch_bar.set_plan(plan)
        self._offer_launch(plan if launchable else None)
        if plan is not None:
            self.sig_plan_shown.emit(plan)

    def _offer_launch(self, plan: dict[str, Any] | None) -> None:
        """Launch only a plan the engine runs; for one it does not, say why beside the disabled button."""
        runs, why = plan_runs_here(plan) if plan is not None else (False, "")
        reason = "" if plan is None or runs else f"Does not run here: {why}"
        if plan is not None and runs and self.results.is_stale:
            runs = False
            reason = "The inputs changed since this plan was made: plan again before launching."
        if plan is not None and runs and not self.choice.is_here():
            runs = False
            reason = (f"Planned for another machine: jobs launch only on this one ({self.choice.here_label()}). "
                      "Export the plan instead.")  # fmt: skip
        self.launch_bar.offer_launch(plan is not None and runs, reason)

    def apply_suggestion(self) -> None:
        """Put the selected suggestion's workload and GPUs into the form, and plan again."""
        s = self.results.current_suggestion()
        if s:
            self._apply_suggestion(s)

    def _apply_suggestion(self, s: dict[str, Any]) -> None:
        plan = s["plan"]
        w = plan["workload"]
        r = self.plan_request()
        r.task, r.method, r.precision = w["task"], w["method"], w["precision"]
        if s.get("setting") in RECIPE_SETTINGS and s.get("setting") in w:
            setattr(r, s["setting"], w[s["setting"]])  # the recipe setting the suggestion changes; the rest stay
        r.seq_len, r.batch, r.weight_bits = w["seq_len"], w["global_batch"], w.get("weight_bits", 16)
        if w.get("new_tokens"):
            r.new_tokens = w["new_tokens"]
        if s.get("kind") == "gpus":
            r.gpus = list(plan["parallelism"]["gpu_indices"])
        self.set_request(r)
        self.request_plan()

    def open_wizard(self) -> Any:
        """Open the job wizard filled from the plan shown; returns it."""
        if self.plan is None:
            return None
        from rigpilot.app.wizard.wizard import open_wizard

        wizard = open_wizard(self.link, self, plan=self.plan)
        wizard.sig_submitted.connect(self.sig_job_submitted.emit)
        self.wizard = wizard
        self.sig_wizard_opened.emit(wizard)
        return wizard

    # -- persistence -------------------------------------------------------------------------------------
    def save_state(self, settings: QSettings, prefix: str) -> None:
        r = self.plan_request()
        for key, name, _ in _SAVED:
            value = getattr(r, name)
            # A recipe setting left open is saved as the drop-down holds it ("auto"), not as a missing value.
            settings.setValue(f"{prefix}/{key}", recipe_choice(name, value) if name in RECIPE_SETTINGS else value)
        settings.setValue(f"{prefix}/force_tp", int(r.force_tp))
        settings.setValue(f"{prefix}/machine", self.target_key())
        settings.setValue(f"{prefix}/splitter", self.splitter.saveState())
        if self.results.sized_by_user:  # otherwise the table's height follows its rows and the window
            settings.setValue(f"{prefix}/{RESULTS_SPLITTER_KEY}", self.results_splitter.saveState())

    def restore_state(self, settings: QSettings, prefix: str) -> None:
        def value(key: str, default: Any, kind: type) -> Any:
            v = settings.value(f"{prefix}/{key}", default)
            try:
                return kind(v)
            except (TypeError, ValueError):
                return default

        d = PlanRequest(model="")
        r = PlanRequest(model="", force_tp=bool(value("force_tp", 0, int)))
        for key, name, kind in _SAVED:
            setattr(r, name, value(key, AUTO if name in RECIPE_SETTINGS else getattr(d, name), kind))
        r.nodes = min(max(r.nodes, 1), NODES_MAX)
        self.set_request(r)
        self.select_machine(value("machine", HERE, str))
        state = settings.value(f"{prefix}/splitter")
        if isinstance(state, QByteArray):
            self.splitter.restoreState(state)
        state = settings.value(f"{prefix}/{RESULTS_SPLITTER_KEY}")
        if isinstance(state, QByteArray) and self.results_splitter.restoreState(state):
            self.results.sized_by_user = True
