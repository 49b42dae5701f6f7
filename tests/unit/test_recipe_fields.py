"""Every recipe setting (engine.recipe, declared once) is a field wherever the recipe travels by name."""

from __future__ import annotations

import dataclasses
from typing import get_type_hints

import pytest

from rigpilot.app.planner.model import AUTO, PlanRequest, open_text, recipe_choice, recipe_choices
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS
from rigpilot.engine.planner.overrides import Overrides
from rigpilot.engine.planner.plan import Workload
from rigpilot.engine.planner.recipes import LADDER
from rigpilot.engine.recipe import RECIPE_SETTINGS, AskedRecipe, Recipe, check_open_form, open_words


def test_the_job_the_plans_workload_and_the_recheck_carry_every_recipe_setting() -> None:
    names = set(RECIPE_SETTINGS)
    assert names == {f.name for f in dataclasses.fields(Recipe)}
    for cls in (Workload, Overrides, PlanRequest):
        # Inherited from the one open form of the declarations, each typed as declared or None (open).
        assert issubclass(cls, AskedRecipe), cls.__name__
        hints = get_type_hints(cls)
        assert {name: hints[name] for name in names} == {n: d.type | None for n, d in RECIPE_SETTINGS.items()}
        assert all(getattr(cls(model="m") if cls is not Overrides else cls(), n) is None for n in names)
    # The job takes the recipe's own declarations, not copies that could drift.
    for name, decl in RECIPE_SETTINGS.items():
        job = TRAIN_SETTINGS[name]
        assert (job.flags, job.bound, job.help, job.default, job.searched) == (
            decl.flags, decl.bound, decl.help, decl.default, decl.searched)  # fmt: skip


def test_an_open_form_that_drifted_from_the_declarations_is_refused() -> None:
    check_open_form(AskedRecipe)
    missing = dataclasses.make_dataclass("Missing", [(n, d.type | None, None) for n, d in RECIPE_SETTINGS.items() if n != "fp8"])
    closed = dataclasses.make_dataclass("Closed", [(n, d.type, None) for n, d in RECIPE_SETTINGS.items()])
    for cls in (missing, closed):
        with pytest.raises(TypeError, match="not Recipe's declarations"):
            check_open_form(cls)


def test_the_settings_the_search_climbs_are_the_ones_declared_searched() -> None:
    assert {name for name, _ in LADDER} == {name for name, decl in RECIPE_SETTINGS.items() if decl.searched}
    assert {"compile", "fp8"} <= {name for name, decl in RECIPE_SETTINGS.items() if not decl.searched}


def test_the_planner_page_words_a_setting_left_open_as_its_declaration_says() -> None:
    for name, decl in RECIPE_SETTINGS.items():
        first, *values = recipe_choices(name)
        assert first == (AUTO, open_text(name))
        if decl.searched:
            assert first[1] == "Auto: the planner chooses" and decl.default in [v for v, _ in values]
        else:  # never chosen by the search: open is its default, offered once
            assert not first[1].startswith("Auto") and decl.default not in [v for v, _ in values]
            assert recipe_choice(name, decl.default) == AUTO
        assert recipe_choice(name, None) == AUTO and open_words(name)[1] in first[1]
    assert open_text("compile") == "Off: the planner never turns it on"


def test_a_workloads_json_keeps_what_was_asked_first_and_the_recipe_flat() -> None:
    w = Workload(model="llama-2-7b", loss_chunks=8)
    d = w.to_dict()
    assert next(iter(d)) == "model" and list(d)[-len(RECIPE_SETTINGS):] == list(RECIPE_SETTINGS)
    assert d["loss_chunks"] == 8 and Workload(**d) == w
