"""The job wizard on a FakeLink that plans for real and accepts submissions, and walking its pages."""

from __future__ import annotations

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QWizard

from rigpilot.app.wizard.wizard import DESIGN_SIZE, JobWizard

from support.gui_fakes import FakeLink, accept_submissions, real_plan_reply


def make_link(profile: str = "4x-rtx4090", jobs=None) -> tuple[FakeLink, list[dict]]:
    link = FakeLink(profile, jobs=jobs)
    link.replies["plan"] = real_plan_reply(link.machine_obj)
    submitted = accept_submissions(link)
    link.connect_engine()
    return link, submitted


def searches(link: FakeLink) -> list[dict]:
    """The `plan` requests that asked for a search (the others re-check a changed plan)."""
    return [r for r in link.requests("plan") if "recheck" not in r]


def open_wizard(qtbot, link: FakeLink, settings: QSettings, **kw) -> JobWizard:
    wizard = JobWizard(link, settings=settings, **kw)
    qtbot.addWidget(wizard)
    wizard.resize(DESIGN_SIZE)
    wizard.show()
    qtbot.waitExposed(wizard)
    return wizard


def settled(qtbot, wizard: JobWizard):
    """The current page, once its background checks have answered."""
    page = wizard.currentPage()
    qtbot.waitUntil(lambda: not page.busy, timeout=20000)
    return page


def next_page(qtbot, wizard: JobWizard) -> int:
    page = settled(qtbot, wizard)
    assert page.isComplete(), page.message.text()
    wizard.next()
    settled(qtbot, wizard)
    return wizard.currentId()


def go_to(qtbot, wizard: JobWizard, target: int) -> None:
    while wizard.currentId() != target:
        next_page(qtbot, wizard)


def blocked(qtbot, wizard: JobWizard, text: str) -> None:
    """The current page refuses Next and says `text`."""
    page = settled(qtbot, wizard)
    assert not page.isComplete()
    assert not wizard.button(QWizard.WizardButton.NextButton).isEnabled()
    assert page.message.isVisible() and text in page.message.text(), page.message.text()
