"""What every wizard page shares: the wizard's state, an inline message, and checks that run in the background.

A page writes each change straight into `wizard.state`, so Back and Next keep
everything, and `load()` (on entering) fills the widgets from it. A page is
complete when its check found no problem and no check is still running; the
message label says what is missing. Nothing here opens a dialog.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QPushButton, QVBoxLayout, QWizardPage

from rigpilot.app.planner.model import error_text
from rigpilot.app.tasks import run_in_background
from rigpilot.app.widgets.style import Status, set_status
from rigpilot.app.wizard.host import DATA, GPUS, HYPER, LAUNCH, MODEL, PLAN, REVIEW, TASK, WizardHost

if TYPE_CHECKING:
    from rigpilot.app.wizard.state import WizardState

__all__ = ["DATA", "GPUS", "HYPER", "LAUNCH", "MODEL", "PLAN", "REVIEW", "TASK", "StepPage"]


class StepPage(QWizardPage):
    def __init__(self, wizard: WizardHost, title: str, subtitle: str = ""):
        super().__init__()
        self.wiz = wizard
        self.setTitle(title)
        if subtitle:
            self.setSubTitle(subtitle)
        self.problem: str | None = None
        self.busy = False
        self._loading = False
        self._serial = 0
        self.message = QLabel()
        self.message.setObjectName("pageMessage")
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.message.hide()
        # The one-click fix for the problem shown (a page that offers fixes puts it under its message).
        self.fix_button = QPushButton()
        self.fix_button.setObjectName("offeredFix")
        self.fix_button.clicked.connect(self._apply_fix)
        self.fix_button.hide()
        self._fix: Callable[[], None] | None = None
        self.body = QVBoxLayout(self)
        self.body.setContentsMargins(0, 0, 0, 0)

    @property
    def state(self) -> WizardState:
        return self.wiz.state

    # -- entering the page ---------------------------------------------------------------------
    def initializePage(self) -> None:
        with self.quietly():
            self.load()
        self.validate()

    def load(self) -> None:
        """Fill the widgets from the state."""

    def validate(self) -> None:
        """Check the page's choices; call `set_problem` (now or from a background check)."""

    # -- the verdict -------------------------------------------------------------------------------
    def set_problem(self, problem: str | None, *, note: str | None = None, tone: str = "info") -> None:
        """`problem` blocks Next and shows in red; a `note` (with no problem) only informs.

        A note's `tone` is "info" (plain), "ok" (green: it fits) or "warn" (amber: allowed, but mind it).
        A fix offered for an earlier problem is withdrawn (`offer_fix` after this call offers one).
        """
        self._fix = None
        self.fix_button.hide()
        self.problem = problem
        text = problem or note
        if text:
            tones: dict[str, Status] = {"ok": "good", "warn": "warn"}
            set_status(self.message, "bad" if problem else tones.get(tone))
            self.message.setText(text)
        self.message.setVisible(bool(text))
        self.completeChanged.emit()

    def offer_fix(self, label: str, fix: Callable[[], None]) -> None:
        """A button under the message that fixes the problem shown, e.g. "Use 256 tokens (the model's context)"."""
        self._fix = fix
        self.fix_button.setText(label)
        self.fix_button.show()

    def _apply_fix(self) -> None:
        fix, self._fix = self._fix, None
        self.fix_button.hide()
        if fix is not None:
            fix()

    def isComplete(self) -> bool:
        return self.problem is None and not self.busy

    def check_in_background(
        self, work: Callable[[], Any], done: Callable[[Any], None], waiting: str = "Checking…"
    ) -> None:
        """Run `work` off the GUI thread; `done(result)` runs only if no newer check started meanwhile."""
        finished, failed = self._begin_check(done, lambda e: self.set_problem(error_text(e)), waiting)
        run_in_background(work, finished, failed)

    def check_with_engine(
        self,
        ask: Callable[[Callable[[Any], None], Callable[[BaseException], None]], None],
        done: Callable[[Any], None],
        refused: Callable[[BaseException], None],
        waiting: str = "Asking the engine…",
    ) -> None:
        """`ask(on_done, on_error)` sends an engine request (the link answers on the GUI thread); `done` or
        `refused` runs only if no newer check started meanwhile, and the page is busy until then."""
        ask(*self._begin_check(done, refused, waiting))

    def _begin_check(
        self, done: Callable[[Any], None], refused: Callable[[BaseException], None], waiting: str
    ) -> tuple[Callable[[Any], None], Callable[[BaseException], None]]:
        self._serial += 1
        serial = self._serial
        self.busy = True
        self.set_problem(None, note=waiting)

        def finished(result: Any) -> None:
            if serial == self._serial:
                self.busy = False
                done(result)
                self.completeChanged.emit()

        def failed(error: BaseException) -> None:
            if serial == self._serial:
                self.busy = False
                refused(error)
                self.completeChanged.emit()

        return finished, failed

    def cancel_checks(self) -> None:
        self._serial += 1
        self.busy = False

    def changing(self) -> bool:
        """True while the page fills its own widgets: their change signals are not the user's edits."""
        return self._loading

    @contextmanager
    def quietly(self) -> Iterator[None]:
        """Fill widgets without their change signals counting as edits (see `changing`)."""
        before, self._loading = self._loading, True
        try:
            yield
        finally:
            self._loading = before

