"""The Planner page on a simulated machine, planning with the real planner."""

from __future__ import annotations

from rigpilot.app.planner.page import PlannerPage

from support.gui_fakes import FakeLink, real_plan_reply

PRESET_7B = "llama-2-7b"


def open_page(qtbot, profile: str = "8x-a100-pcie", *, connect: bool = True, jobs=None) -> tuple[PlannerPage, FakeLink]:
    link = FakeLink(profile, jobs=jobs)
    link.replies["plan"] = real_plan_reply(link.machine_obj)
    page = PlannerPage(link)
    qtbot.addWidget(page)
    page.resize(1118, 734)  # what the main window leaves a page when it opens on a 1280×800 screen
    page.show()
    qtbot.waitExposed(page)
    if connect:
        link.connect_engine()
    return page, link


def plan_for(qtbot, page: PlannerPage, model: str = PRESET_7B, **form) -> dict:
    page.picker.set_model(model, chosen=False)
    if form:
        r = page.plan_request()
        for k, v in form.items():
            setattr(r, k, v)
        page.set_request(r)
    with qtbot.waitSignal(page.sig_plan_ready, timeout=20000) as ready:
        page.plan_button.click()
    return ready.args[0]
