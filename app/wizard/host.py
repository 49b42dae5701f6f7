"""What a wizard page may ask of the wizard it sits in: the one interface pages and `JobWizard` share.

The pages are built by `rigpilot.app.wizard.wizard` and talk back to it; naming that
conversation here (a Protocol) lets both import this module instead of each
other, so there is no import cycle between the wizard and its pages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rigpilot.app.planner.gpu_selector import BusyGpus
    from rigpilot.app.wizard.data_check import DataReport
    from rigpilot.app.wizard.plan_check import PlanChecker
    from rigpilot.app.wizard.state import WizardState

# The pages' ids, in the order Next walks them (pages a task does not need are skipped).
TASK, MODEL, DATA, GPUS, PLAN, HYPER, REVIEW, LAUNCH = range(8)


class WizardHost(Protocol):
    state: WizardState
    machine: dict[str, Any] | None
    busy: BusyGpus
    checker: PlanChecker | None  # re-checks plan overrides; None until the model is described
    link: Any  # the EngineLink (the node choice asks it for the nodes)

    def data_report(self) -> DataReport | None:
        """What the Data page found in the chosen files (None before it has read them)."""

    def model_described(self, model: str, spec: Any) -> None:
        """Remember a model's description (a ModelSpec), so the plan checker need not describe it again."""

    def need_checker(self) -> None:
        """Make sure `checker` is for the chosen model on this machine (described in the background)."""

    def request_plan(
        self, on_done: Callable[[dict[str, Any]], None], on_error: Callable[[BaseException], None]
    ) -> None:
        """A plan (search result) for the current choices."""

    def check(self, on_done: Callable[[dict[str, Any]], None], on_error: Callable[[BaseException], None]) -> None:
        """The engine's verdict on submitting the current choices, without submitting them."""

    def submit(self, on_done: Callable[[str], None], on_error: Callable[[str], None]) -> None:
        """Submit the job once; `on_done(job_id)`."""
