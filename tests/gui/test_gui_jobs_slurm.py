"""The Jobs page names a SLURM job's queue state: in the list, its tooltip, and the job's header."""

from __future__ import annotations

from rigpilot.app.jobs.model import STATE

from support.gui_fakes import FakeLink
from support.gui_jobs import FakeJobs, a_job, open_job, open_page


def slurm_job(job_id: str, state: str, slurm_state: str, reason: str | None) -> dict:
    slurm = {"job_id": "4242", "state": slurm_state, "reason": reason, "partition": "gpu", "login": "me@login1"}
    return a_job(job_id, state, slurm=slurm)


def test_the_list_and_the_header_show_the_slurm_queue_state(qtbot):
    link = FakeLink()
    jobs = FakeJobs(link, [slurm_job("s1", "starting", "PENDING", "Resources"), a_job("l1", "running")])
    page = open_page(qtbot, link)

    def state_cell(job_id: str, role=None):
        index = page.model.index(page.model.row_of(job_id), STATE)
        return page.model.data(index) if role is None else page.model.data(index, role)

    assert state_cell("s1") == "starting · SLURM: pending (Resources)"
    assert state_cell("l1") == "running"  # a local job reads as before
    from PySide6.QtCore import Qt

    assert state_cell("s1", Qt.ItemDataRole.ToolTipRole) == (
        "SLURM: pending (Resources), job 4242 · partition gpu · through me@login1"
    )
    open_job(qtbot, page, "s1")
    assert "SLURM: pending (Resources), job 4242" in page.detail.summary.text()

    # SLURM starts it: the engine's next record says so, and the list follows.
    jobs.record("s1")["slurm"] = {**jobs.record("s1")["slurm"], "state": "RUNNING", "reason": "None"}
    page.model.upsert(jobs.record("s1"))
    assert state_cell("s1") == "starting · SLURM: running"
    # Ended: Rigpilot's own state says it all.
    page.model.upsert({**jobs.record("s1"), "state": "cancelled"})
    assert state_cell("s1") == "cancelled"
