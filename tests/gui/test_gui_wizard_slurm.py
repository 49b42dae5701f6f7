"""The wizard's SLURM choice (GPUs page): the options go into the check and the submission, the command
line says --slurm, a bad option is the engine's one-line refusal on Review, and what does not apply to a
SLURM job (other nodes, queueing here) is hidden. The check's sbatch --test-only answer is canned
(tests/support/gui_fakes.py); tests/engine/test_slurm_jobs.py puts the same request to a real SLURM."""

from __future__ import annotations

import shlex

import pytest

from rigpilot.app.wizard.page_base import GPUS, LAUNCH, REVIEW
from rigpilot.app.wizard.state import WizardState, examples_present

from support.gui_wizard import blocked, go_to, make_link, open_wizard, settled

pytestmark = pytest.mark.skipif(not examples_present(), reason="the shipped examples are missing")


def choose_slurm(qtbot, wizard, **options: str):
    go_to(qtbot, wizard, GPUS)
    page = settled(qtbot, wizard)
    assert page.queue.isVisibleTo(page) and not page.slurm.options.isVisibleTo(page)
    page.slurm.enabled.setChecked(True)
    for key, value in options.items():
        page.slurm.edits[key].setText(value)
        page.slurm.edits[key].textEdited.emit(value)
    assert page.slurm.options.isVisibleTo(page)
    assert not page.queue.isVisibleTo(page) and not page.nodes.isVisibleTo(page)  # SLURM queues and places it
    return page


def test_a_slurm_job_is_checked_by_slurm_and_submitted_with_its_options(qtbot, settings):
    link, submitted = make_link()
    wizard = open_wizard(qtbot, link, settings)
    choose_slurm(qtbot, wizard, partition="gpu", time="30")
    assert wizard.state.slurm == {"partition": "gpu", "time": "30"}
    go_to(qtbot, wizard, REVIEW)
    review = settled(qtbot, wizard)
    shown = review.engine_view.toPlainText()
    assert "SLURM: would be submitted with sbatch (partition gpu, time 30)" in shown, shown
    assert "SLURM: Job 7 to start at" in shown
    words = shlex.split(wizard.state.command().splitlines()[0])
    assert words[words.index("--slurm") + 1 : words.index("--slurm") + 5] == ["--partition", "gpu", "--time", "30"]
    with qtbot.waitSignal(wizard.sig_submitted, timeout=20000):
        go_to(qtbot, wizard, LAUNCH)
    assert submitted[-1]["slurm"] == {"partition": "gpu", "time": "30"}


def test_a_bad_slurm_option_is_refused_on_review_in_one_line_and_unticking_runs_here(qtbot, settings):
    link, _ = make_link()
    wizard = open_wizard(qtbot, link, settings)
    page = choose_slurm(qtbot, wizard, time="2h")
    go_to(qtbot, wizard, REVIEW)
    blocked(qtbot, wizard, "--time '2h' is not a SLURM time limit")
    wizard.back()
    while wizard.currentId() != GPUS:
        wizard.back()
    page.slurm.enabled.setChecked(False)
    assert wizard.state.slurm is None and page.queue.isVisibleTo(page)
    go_to(qtbot, wizard, REVIEW)
    assert "SLURM" not in settled(qtbot, wizard).engine_view.toPlainText()
    assert "--slurm" not in wizard.state.command()


def test_the_slurm_choice_survives_the_state_round_trip():
    state = WizardState(kind="calibrate", gpus=[0], slurm={"login": "me@login1"})
    again = WizardState.from_json(state.to_json())
    assert again.slurm == {"login": "me@login1"}
    assert again.copy().slurm == {"login": "me@login1"} and again.copy().slurm is not again.slurm
    assert "--slurm --login me@login1" in again.command()
