"""Every recipe setting (engine.recipe, declared once) is a field wherever the recipe travels by name."""

from __future__ import annotations

import dataclasses

from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS
from rigpilot.engine.planner.overrides import Overrides
from rigpilot.engine.planner.plan import Workload
from rigpilot.engine.recipe import RECIPE_SETTINGS, Recipe


def test_the_job_the_plans_workload_and_the_recheck_carry_every_recipe_setting() -> None:
    names = set(RECIPE_SETTINGS)
    assert names == {f.name for f in dataclasses.fields(Recipe)}
    for cls in (Workload, Overrides):
        assert names <= {f.name for f in dataclasses.fields(cls)}, cls.__name__
    # The job takes the recipe's own declarations, not copies that could drift.
    for name, decl in RECIPE_SETTINGS.items():
        job = TRAIN_SETTINGS[name]
        assert (job.flags, job.bound, job.help, job.default) == (decl.flags, decl.bound, decl.help, decl.default)
