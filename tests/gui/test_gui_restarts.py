"""The Jobs page shows a job's automatic restarts: "restarted 2×" in the list, and a timeline on its page."""

from __future__ import annotations

import shlex

from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QImage

from rigpilot.app.jobs.model import STATE
from rigpilot.app.jobs.restarts import timeline_of
from rigpilot.app.widgets.palette import BAD

from support.gui_fakes import FakeLink
from support.gui_jobs import T0, FakeJobs, a_job, open_job, open_page, step_record

RESTARTS = [
    {"time": T0 + 60, "run": 1, "cause": "rank 1 was killed by SIGKILL", "from_step": 50, "left_out_gpus": [],
     "notes": []},
    {"time": T0 + 180, "run": 2, "cause": "rank 0 exited with code 1", "from_step": 100, "left_out_gpus": [1],
     "notes": ["GPU 1 fell off the bus (NVML: GPU is lost): left out",
               "data parallelism shrinks from dp 2 × fsdp 1 to dp 1 × fsdp 1"]},
]  # fmt: skip


def test_the_timeline_names_each_restart_its_checkpoint_and_the_gpus_left_out():
    job = {"created": T0, "ended": T0 + 240, "restarts": RESTARTS, "max_restarts": 3}
    t = timeline_of(job)
    assert t.heading == "Restarted 2× (up to 3 in a row)"
    assert [r.text for r in t.rows] == [
        "run 1 → 2 from step 50: rank 1 was killed by SIGKILL",
        "run 2 → 3 from step 100: rank 0 exited with code 1",
    ]
    assert [r.left_out for r in t.rows] == [None, "left out GPU 1"]
    assert t.rows[1].notes[1].startswith("data parallelism shrinks")
    assert t.runs == [(1, 0.0, 0.25), (2, 0.25, 0.75), (3, 0.75, 1.0)]
    policy = timeline_of({"created": T0, "restarts": [], "max_restarts": 3})
    assert policy.heading.startswith("Restarts itself from its newest checkpoint") and not policy.rows
    assert timeline_of({"created": T0, "restarts": [], "max_restarts": 0}).heading is None


def test_the_list_and_the_job_page_show_the_restarts(qtbot):
    link = FakeLink()
    restarted = a_job("r1", "failed", restarts=RESTARTS, max_restarts=3, exit_reason="rank 0 exited with code 1")
    restarted.update(run=3, gpus=[0], created=T0, ended=T0 + 240)
    plain = a_job("p1", "running", restarts=[], max_restarts=0)
    fake = FakeJobs(link, [restarted, plain])
    fake.records["r1"] = [step_record(s) for s in range(1, 5)]
    page = open_page(qtbot, link)
    states = {page.model.index(r, 0).data(): page.model.index(r, STATE).data() for r in range(page.model.rowCount())}
    assert states == {"run r1  (r1)": "failed · restarted 2×", "run p1  (p1)": "running"}

    open_job(qtbot, page, "r1")
    timeline = page.detail.restarts
    qtbot.waitUntil(timeline.isVisible)
    assert timeline.heading.text() == "<b>Restarted 2× (up to 3 in a row)</b>"
    rows = timeline.rows.text()
    assert "run 1 → 2 from step 50: rank 1 was killed by SIGKILL" in rows and "left out GPU 1" in rows
    assert "GPU 1 fell off the bus" in rows
    # The strip marks each restart in the "bad" colour where it came in the job's life.
    image = QImage(timeline.strip.size(), QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    timeline.strip.render(image)
    row = [image.pixelColor(x, image.height() // 2) for x in range(image.width())]
    marks = [x for x, c in enumerate(row) if c.red() == BAD.red() and c.green() == BAD.green()]
    assert len(marks) >= 2 and marks[-1] - marks[0] > image.width() // 4

    open_job(qtbot, page, "p1")
    qtbot.waitUntil(lambda: not timeline.isVisible())


def test_the_wizard_sets_the_restart_limit_and_tensorboard_and_the_command_line_carries_them(qtbot, tmp_path):
    from rigpilot.app.wizard.page_base import HYPER
    from rigpilot.app.wizard.state import WizardState, default_state, state_from_spec

    from support.gui_wizard import go_to, make_link, open_wizard

    link, _ = make_link()
    settings = QSettings(str(tmp_path / "wizard.ini"), QSettings.Format.IniFormat)
    wizard = open_wizard(qtbot, link, settings, state=default_state(link.machine))
    go_to(qtbot, wizard, HYPER)
    box = wizard.hyper_page.max_restarts
    assert box.text() == "automatic" and wizard.state.max_restarts is None
    assert "max_restarts" not in wizard.state.to_spec()  # the engine's default policy decides
    box.setValue(2)
    spec = wizard.state.to_spec()
    assert spec["max_restarts"] == 2 and wizard.state.max_restarts == 2
    words = shlex.split(wizard.state.command().splitlines()[0])
    assert words[words.index("--max-restarts") + 1] == "2"
    assert state_from_spec(spec).max_restarts == 2
    assert WizardState.from_json(wizard.state.to_json()).max_restarts == 2
    box.setValue(0)
    assert wizard.state.to_spec()["max_restarts"] == 0

    # TensorBoard: off is the engine's default and goes unsaid; on, the spec, the command and a copy carry it.
    assert "tensorboard" not in wizard.state.to_spec() and "--tensorboard" not in wizard.state.command()
    wizard.hyper_page.tensorboard.setChecked(True)
    spec = wizard.state.to_spec()
    assert spec["tensorboard"] is True and "--tensorboard" in shlex.split(wizard.state.command().splitlines()[0])
    assert state_from_spec(spec).tensorboard and WizardState.from_json(wizard.state.to_json()).tensorboard
