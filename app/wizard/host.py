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
    from rigpilot.app.wizard.state import WizardState
    from rigpilot.engine.planner.overrides import Overrides

# The pages' ids, in the order Next walks them (pages a task does not need are skipped).
TASK, MODEL, DATA, GPUS, PLAN, HYPER, REVIEW, LAUNCH = range(8)


class WizardHost(Protocol):
    state: WizardState
    machine: dict[str, Any] | None
    busy: BusyGpus
    link: Any  # the EngineLink (the node choice asks it for the nodes)

    def data_report(self) -> DataReport | None:
        """What the Data page found in the chosen files (None before it has read them)."""

    def engine_connected(self) -> bool:
        """Whether the engine answers requests now (plans and their re-checks come from it)."""

    def recheck(
        self,
        plan: dict[str, Any],
        overrides: Overrides,
        on_done: Callable[[dict[str, Any]], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        """`plan` with the user's changes, re-checked by the engine: `on_done({"plan", "fits", "message"})`,
        or `on_error` with the refusal (its reason and fields say what is wrong)."""

    def request_plan(
        self, on_done: Callable[[dict[str, Any]], None], on_error: Callable[[BaseException], None],
        on_formula: Callable[[dict[str, Any]], None] | None = None, on_progress: Callable[[int, int], None] | None = None,
    ) -> Any:  # fmt: skip
        """A plan (search result) for the current choices; with `on_formula`, the formula's answer first, then
        the memory check's (a handle whose `cancel()` drops the rest)."""

    def check(self, on_done: Callable[[dict[str, Any]], None], on_error: Callable[[BaseException], None]) -> None:
        """The engine's verdict on submitting the current choices, without submitting them."""

    def submit(self, on_done: Callable[[str], None], on_error: Callable[[str], None]) -> None:
        """Submit the job once; `on_done(job_id)`."""
