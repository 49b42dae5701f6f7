"""The Planner page's answer: one inline line for a failure, the headline of the plan shown, the ranked plans,
the memory chart, and tabs for why it won, the rejected layouts, suggestions and rented machines.

The ranked plans come first: until the user drags the splitter below them, the table is as tall as its rows
(TABLE_ROWS, all a search keeps), and the chart and the details share what is left.

It shows what it is given and says what the user picked (`sig_plan_shown`, `sig_apply`); asking the
engine is the page's business.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QEvent, QObject, QSignalBlocker, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QGraphicsOpacityEffect,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.planner.memory_chart import MemoryChart
from rigpilot.app.planner.model import (
    change_text,
    explanation_lines,
    plan_rows,
    plans_of,
    rejection_reason,
    summary_lines,
)
from rigpilot.app.planner.rented_view import RentedTable
from rigpilot.app.widgets.palette import BAD, GOOD, WARN, status_text
from rigpilot.app.widgets.style import set_status
from rigpilot.engine.planner.amounts import TIGHT_FILL, gib_pair
from rigpilot.engine.planner.calibration import NOT_CALIBRATED

# The layout is the answer: its column takes the room the figures leave and wraps, whole, at 1280 pixels wide.
# (The plan's family, which the layout's words begin with, has no column of its own.)
TABLE_COLUMNS = ["#", "Layout", "GPUs", "Tokens/s", "Step", "To finish", "Fullest GPU", "Runs here"]
LAYOUT_COLUMN = TABLE_COLUMNS.index("Layout")
RUNS_HERE_COLUMN = TABLE_COLUMNS.index("Runs here")
FULLEST_COLUMN = TABLE_COLUMNS.index("Fullest GPU")
TO_FINISH_COLUMN = TABLE_COLUMNS.index("To finish")
SPEED_COLUMN = TABLE_COLUMNS.index("Tokens/s")
# Suggestions that change what is asked on this machine can be applied to the form; hardware ones cannot.
APPLICABLE_SUGGESTIONS = ("method", "quantize", "seq", "batch", "gpus")
EMPTY = "Choose a model and GPUs, then Plan."
TIGHT_TIP = (
    f"Tight: over {TIGHT_FILL:.0%} of the GPU's memory. It fits as predicted, but allocator fragmentation over a "
    "long run may still run it out of memory; it ranks after every plan that leaves more free."
)
STALE_OPACITY = 0.45  # a plan for other inputs: still readable, plainly not current
# The ranked plans the table shows without scrolling, until the user drags the splitter: all a search keeps (the
# best and four runners-up), at 1280×800. The chart and the details share the rest, the chart the larger part.
TABLE_ROWS = 5
CHART_SHARE = 0.6
DETAILS_LINES = 3  # the fewest lines of text a details tab keeps when the table takes the room


def _label(name: str, *, selectable: bool = True) -> QLabel:
    label = QLabel("")
    label.setObjectName(name)
    label.setWordWrap(True)
    if selectable:
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


def plans_table() -> QTableWidget:
    """The ranked plans, best first: one row selected at a time, arrows move between plans."""
    table = QTableWidget(0, len(TABLE_COLUMNS))
    table.setObjectName("planTable")
    table.setAccessibleName(
        "Ranked plans, best first: within 5% of the fastest, the most free memory; "
        f"plans over {TIGHT_FILL:.0%} of a GPU (tight) after the rest"
    )
    table.setHorizontalHeaderLabels(TABLE_COLUMNS)
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setTabKeyNavigation(False)  # Tab leaves the table; arrows move between plans
    table.verticalHeader().hide()
    header = table.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    header.setSectionResizeMode(LAYOUT_COLUMN, QHeaderView.ResizeMode.Stretch)
    table.setWordWrap(True)
    table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    # Rows as tall as their wrapped layout, again whenever the layout column's width changes.
    header.sectionResized.connect(lambda *_: table.resizeRowsToContents())
    return table


def rejected_table() -> QTableWidget:
    table = QTableWidget(0, 3)
    table.setObjectName("rejectedPlans")
    table.setHorizontalHeaderLabels(["Family", "Why not", "Needs"])
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setTabKeyNavigation(False)
    table.verticalHeader().hide()
    table.setWordWrap(True)
    header = table.horizontalHeader()
    header.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
    header.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
    header.setSectionResizeMode(2, QHeaderView.ResizeMode.ResizeToContents)
    return table


class PlanResults(QWidget):
    sig_plan_shown = Signal(object, bool)  # the plan now in the chart (or None), and whether it may launch
    sig_apply = Signal(dict)  # the suggestion the user applies (its `plan` carries the workload and GPUs)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.result: dict[str, Any] | None = None
        self.other_machine: str | None = None  # the title of the machine planned for, when not this one
        self._fix: Callable[[], None] | None = None
        self._headlines()
        self.table = plans_table()
        self.table.itemSelectionChanged.connect(self._row_selected)
        self.chart = MemoryChart()
        self.tabs = self._details()
        self.results_splitter = QSplitter(Qt.Orientation.Vertical)
        self.results_splitter.setObjectName("plannerResultsSplitter")
        self.results_splitter.addWidget(self.table)
        self.results_splitter.addWidget(self.chart)
        self.results_splitter.addWidget(self.tabs)
        self.results_splitter.setSizes([200, 300, 140])  # until fit_table knows the fonts and the rows
        self.sized_by_user = False  # a dragged splitter is kept; until then the table fits its rows
        self.results_splitter.splitterMoved.connect(self._splitter_dragged)
        # Rows change height as the layout column's width changes, and the splitter's height with the lines above
        # it: the table is fitted once they have settled.
        self._fit_timer = QTimer(self)
        self._fit_timer.setSingleShot(True)
        self._fit_timer.setInterval(0)
        self._fit_timer.timeout.connect(self.fit_table)
        self.table.verticalHeader().sectionResized.connect(self._fit_timer.start)
        self.results_splitter.installEventFilter(self)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        message_row = QHBoxLayout()
        message_row.addWidget(self.message, 1)
        message_row.addWidget(self.fix_button, 0, Qt.AlignmentFlag.AlignTop)
        layout.addLayout(message_row)
        layout.addWidget(self.stale)
        layout.addWidget(self.summary)
        layout.addWidget(self.calibration)
        layout.addWidget(self.results_splitter, 1)

    def _headlines(self) -> None:
        self.message = _label("planMessage")
        set_status(self.message, "bad")
        self.message.hide()
        # A refusal with a known fix (a sequence longer than the model's context) offers it in one click.
        self.fix_button = QPushButton()
        self.fix_button.setObjectName("planFix")
        self.fix_button.clicked.connect(self._apply_fix)
        self.fix_button.hide()
        self.summary = _label("planSummary")
        self.summary.setText(EMPTY)
        # The splitter below takes any height it is given; keep the headlines readable.
        self.summary.setMinimumHeight(self.summary.fontMetrics().lineSpacing() * 4 + 4)
        self.summary.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        # Which speed numbers were measured (and when), or that the priors stand: the engine's planner says.
        self.calibration = _label("planCalibration")
        self.calibration.setToolTip(
            "Measured numbers replace the speed priors of the GPUs and links they measured. "
            "Measure them with a calibration job (the job wizard, or `rigpilot run calibrate`)."
        )
        self.calibration.hide()
        # The result stays on screen after the inputs change (to compare), marked as not theirs.
        self.stale = _label("planStale", selectable=False)
        self.stale.setText("The inputs changed since this plan was made: press Plan to plan for them.")
        set_status(self.stale, "bad")
        self.stale.hide()

    def _details(self) -> QTabWidget:
        self.explanation = QPlainTextEdit()
        self.explanation.setObjectName("planExplanation")
        self.explanation.setReadOnly(True)
        self.explanation.setTabChangesFocus(True)
        self.rejected = rejected_table()
        self.suggestions = QListWidget()
        self.suggestions.setObjectName("planSuggestions")
        self.suggestions.setWordWrap(True)
        self.suggestions.currentRowChanged.connect(self._suggestion_selected)
        self.apply_button = QPushButton("Apply this change")
        self.apply_button.setObjectName("applySuggestion")
        self.apply_button.setEnabled(False)
        self.apply_button.clicked.connect(self._apply_suggestion)
        suggestions_box = QWidget()
        sl = QVBoxLayout(suggestions_box)
        sl.setContentsMargins(0, 0, 0, 0)
        intro = QLabel("The smallest changes that make it fit, each checked by planning again:")
        intro.setWordWrap(True)
        # The button beside the words, not under the list: one row less when the ranked plans take the room.
        head = QHBoxLayout()
        head.addWidget(intro, 1)
        head.addWidget(self.apply_button, 0, Qt.AlignmentFlag.AlignTop)
        sl.addLayout(head)
        sl.addWidget(self.suggestions, 1)
        self.rented = RentedTable()  # this job here against the rented machines of Settings
        # Short when the ranked plans take the room: a few lines, which scroll.
        for view in (self.explanation, self.rejected, self.suggestions, self.rented.table):
            view.setMinimumHeight(DETAILS_LINES * view.fontMetrics().lineSpacing() + 2 * view.frameWidth())
        tabs = QTabWidget()
        tabs.setObjectName("planDetails")
        tabs.addTab(self.explanation, "Why this plan")
        tabs.addTab(self.rejected, "Rejected")
        tabs.addTab(suggestions_box, "Suggestions")
        tabs.addTab(self.rented, "Rented machines")
        return tabs

    # -- how the height is shared -------------------------------------------------------------------------
    def _splitter_dragged(self, *_: object) -> None:
        self.sized_by_user = True

    def table_height(self) -> int:
        """The table's height with its first TABLE_ROWS rows whole (with none yet, TABLE_ROWS plain rows)."""
        t = self.table
        shown = min(t.rowCount(), TABLE_ROWS)
        rows = sum(t.rowHeight(r) for r in range(shown)) if shown else TABLE_ROWS * t.verticalHeader().defaultSectionSize()
        header = t.horizontalHeader()
        return rows + max(header.height(), header.sizeHint().height()) + 2 * t.frameWidth()

    def fit_table(self) -> None:
        """Give the table its rows, the chart and the details the rest (each at least its minimum), until the user
        drags the splitter."""
        sizes = self.results_splitter.sizes()
        total = sum(sizes)
        if self.sized_by_user or total <= 0:
            return
        chart_min = self.chart.minimumSizeHint().height()
        tabs_min = self.tabs.minimumSizeHint().height()
        table = max(min(self.table_height(), total - chart_min - tabs_min), 0)
        rest = total - table
        chart = min(max(int(rest * CHART_SHARE), chart_min), rest - tabs_min)
        wanted = [table, chart, total - table - chart]
        if wanted != sizes:
            self.results_splitter.setSizes(wanted)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.results_splitter and event.type() in (QEvent.Type.Resize, QEvent.Type.Show):
            self._fit_timer.start()
        return super().eventFilter(watched, event)

    # -- one line above the results ------------------------------------------------------------------
    def show_message(self, text: str) -> None:
        self.message.setText(text)
        self.message.show()
        self.offer_fix("", None)

    def hide_message(self) -> None:
        self.message.hide()
        self.offer_fix("", None)

    def offer_fix(self, label: str, fix: Callable[[], None] | None) -> None:
        self._fix = fix
        self.fix_button.setText(label)
        self.fix_button.setVisible(fix is not None)

    def _apply_fix(self) -> None:
        fix, self._fix = self._fix, None
        self.fix_button.hide()
        if fix is not None:
            fix()

    # -- a result --------------------------------------------------------------------------------------
    @property
    def is_stale(self) -> bool:
        return not self.stale.isHidden()

    def set_stale(self, stale: bool) -> None:
        """Mark the result shown as planned for other inputs than the form's now (dimmed, with a banner)."""
        stale = stale and self.result is not None
        self.stale.setVisible(stale)
        # Dimmed, not disabled: the old plan stays readable to compare with, its tabs open and its text scrolls.
        for part in (self.summary, self.results_splitter):
            if stale and part.graphicsEffect() is None:
                part.setGraphicsEffect(QGraphicsOpacityEffect(part, opacity=STALE_OPACITY))
            elif not stale:
                part.setGraphicsEffect(None)  # type: ignore[arg-type]  # None removes it (Qt's documented use)

    def planned_here(self, here: bool) -> None:
        """The engine's verdict on a layout holds on any machine; on another one, "here" would say the wrong thing."""
        header = self.table.horizontalHeaderItem(RUNS_HERE_COLUMN)
        if header is not None:
            header.setText("Runs here" if here else "Rigpilot runs it")
            header.setToolTip(
                "Whether Rigpilot's engine runs this layout"
                + ("" if here else " (on that machine, were it installed there)")
            )

    def show_result(self, result: dict[str, Any] | None) -> None:
        self.result = result
        self.set_stale(False)
        rows = self._fill_table(result)
        lines = explanation_lines(result or {})
        self.explanation.setPlainText("\n".join(f"• {line}" for line in lines))
        self._show_calibration(result)
        self._show_rejected((result or {}).get("rejected", []))
        self._show_suggestions((result or {}).get("suggestions", []))
        if rows:
            # Shown outright: when row 0 was already selected, selecting it again signals nothing, and the
            # headline and chart would go on showing the previous result's best plan.
            with QSignalBlocker(self.table.selectionModel()):
                self.table.selectRow(0)
            self.show_plan(plans_of(result or {})[0])
            self.tabs.setCurrentIndex(0)
        else:
            self.show_plan(None)
            if result is not None:
                self.summary.setText(f"Nothing fits on GPU {', '.join(map(str, result.get('gpu_indices', [])))}.")
                self.tabs.setCurrentIndex(2 if result.get("suggestions") else 1)
            else:
                self.summary.setText(EMPTY)

    def update_plan(self, index: int, plan: dict[str, Any]) -> None:
        """Plan `index` of the result shown (0: the best), replaced by `plan` (its memory traced since): its row,
        and the headline and chart when it is the plan shown. The selection stays where the user put it."""
        if self.result is None or not 0 <= index < len(plans_of(self.result)):
            return
        result = dict(self.result)
        if index == 0:
            result["best"] = plan
        else:
            runners = list(result.get("runners_up") or [])
            runners[index - 1] = plan
            result["runners_up"] = runners
        self.result = result
        rows = self.table.selectionModel().selectedRows()
        selected = rows[0].row() if rows else 0
        with QSignalBlocker(self.table.selectionModel()):
            self._fill_table(result)
            self.table.selectRow(selected)
        if selected == index:
            self.show_plan(plan)

    def _fill_table(self, result: dict[str, Any] | None) -> int:
        rows = plan_rows(result) if result else []
        plans = plans_of(result) if result else []
        infer = bool(plans) and (plans[0].get("workload") or {}).get("task") == "infer"
        speed = self.table.horizontalHeaderItem(SPEED_COLUMN)
        if speed is not None:
            speed.setText("Generated tokens/s" if infer else "Tokens/s")
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            runs = row.runs_here == "yes"
            values = [row.rank, row.layout, row.gpus, row.tokens_per_s, row.step, row.to_budget, row.peak,
                      "yes" if runs else "no"]  # fmt: skip
            for c, value in enumerate(values):
                item = QTableWidgetItem(value)
                item.setToolTip(value)
                if c == RUNS_HERE_COLUMN and not runs:
                    # The reason in full: beside the Launch button when the plan is shown, and here on hover.
                    item.setForeground(status_text(BAD, self.palette()))
                    item.setToolTip(f"The engine does not run this plan: {row.runs_here}")
                if c == FULLEST_COLUMN and not row.fits:
                    item.setForeground(status_text(BAD, self.palette()))
                    item.setToolTip(f"Does not fit: the fullest GPU would need {value}")
                elif c == FULLEST_COLUMN and row.tight:
                    item.setText(f"{value}\ntight")  # a second line: the layout keeps the width
                    item.setForeground(status_text(WARN, self.palette()))
                    item.setToolTip(TIGHT_TIP)
                self.table.setItem(r, c, item)
        # Without a token budget no plan has a time to finish: its column would only take the layout's room.
        self.table.setColumnHidden(TO_FINISH_COLUMN, all(row.to_budget == "—" for row in rows))
        self.table.resizeRowsToContents()
        self._fit_timer.start()
        return len(rows)

    def _show_calibration(self, result: dict[str, Any] | None) -> None:
        cal = (result or {}).get("calibration") or {}
        text = "" if result is None else cal.get("line") or NOT_CALIBRATED
        self.calibration.setText(text)
        self.calibration.setVisible(bool(text))

    def _show_rejected(self, rejected: list[dict[str, Any]]) -> None:
        self.rejected.setRowCount(len(rejected))
        for r, rej in enumerate(rejected):
            need = rej.get("need_bytes")
            have = rej.get("have_bytes")
            needs = " of ".join(gib_pair(need, have, whole_from=10)) if need and have else ""
            if needs:  # the engine says which memory the bytes are of; older engines' are per GPU
                needs += " of host RAM" if rej.get("limit") == "host_memory" else " per GPU"
            for c, value in enumerate([rej.get("family", ""), rejection_reason(rej), needs]):
                item = QTableWidgetItem(value)
                item.setToolTip(value)
                self.rejected.setItem(r, c, item)
        self.rejected.resizeRowsToContents()

    def _show_suggestions(self, suggestions: list[dict[str, Any]]) -> None:
        self.suggestions.clear()
        for s in suggestions:
            item = QListWidgetItem(change_text(s))
            item.setData(Qt.ItemDataRole.UserRole, s)
            self.suggestions.addItem(item)
        self.apply_button.setEnabled(False)

    # -- choosing a plan -----------------------------------------------------------------------------
    def _row_selected(self) -> None:
        rows = self.table.selectionModel().selectedRows()
        plans = plans_of(self.result or {})
        if rows and rows[0].row() < len(plans):
            self.show_plan(plans[rows[0].row()])

    def current_suggestion(self) -> dict[str, Any] | None:
        item = self.suggestions.currentItem()
        s = item.data(Qt.ItemDataRole.UserRole) if item else None
        return s or None

    def _suggestion_selected(self, row: int) -> None:
        item = self.suggestions.item(row)
        s = item.data(Qt.ItemDataRole.UserRole) if item else None
        applicable = bool(s) and s is not None and s.get("kind") in APPLICABLE_SUGGESTIONS
        self.apply_button.setEnabled(applicable)
        if s:
            # Other hardware is for comparing and exporting; a job can only launch on this machine.
            self.show_plan(s["plan"], heading=f"With this change ({change_text(s)}):", launch=applicable)

    def _apply_suggestion(self) -> None:
        s = self.current_suggestion()
        if s:
            self.sig_apply.emit(s)

    def show_plan(self, plan: dict[str, Any] | None, heading: str = "", *, launch: bool = True) -> None:
        """`plan` in the headline and the chart; `launch`: whether it may be launched from here."""
        if plan is None:
            self.chart.clear()
            self.sig_plan_shown.emit(None, False)
            return
        self.chart.show_memory(plan.get("memory") or [])
        lines = summary_lines(plan)
        fits = all(m["headroom"] >= 0 for m in plan.get("memory") or [])
        colour = status_text(GOOD if fits else BAD, self.palette())
        if not heading and self.other_machine is not None:
            heading = f"Plan for {html.escape(self.other_machine)}:"
        head = f"<b>{heading or 'Plan'}</b> <span style='color:{colour.name()}'>{lines[0]}</span>"
        self.summary.setText("<br>".join([head, *lines[1:]]))
        self.sig_plan_shown.emit(plan, launch)
