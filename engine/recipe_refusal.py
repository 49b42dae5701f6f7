"""A recipe the capability contract refuses, as the error a submission and a worker raise: its one line, with the
setting it refuses and that setting's value as fields (code "recipe_refused"), so clients need parse nothing."""

from __future__ import annotations

import dataclasses
from typing import Any, NoReturn

from rigpilot.engine.capability import RecipeContext, recipe_why_not
from rigpilot.engine.errors import UserError
from rigpilot.engine.layout import Layout
from rigpilot.engine.recipe import RECIPE_SETTINGS, Recipe

REASON = "recipe_refused"


def check_recipe(recipe: Recipe, layout: Layout, ctx: RecipeContext) -> None:
    """Raise the contract's refusal of `recipe` on `layout`, if it refuses it."""
    why = recipe_why_not(recipe, layout, ctx)
    if why is None:
        return
    name, value = refused_setting(recipe, layout, ctx, why)
    refuse(name, value, why)


def refuse(name: str, value: Any, why: str) -> NoReturn:
    """Raise the refusal of recipe setting `name` at `value`, for a reason only a rank can see (its model's layer
    dimensions): the same code and fields as the contract's own refusals."""
    raise UserError(why, reason=REASON, setting=f"train.{name}", value=value)


def refused_setting(recipe: Recipe, layout: Layout, ctx: RecipeContext, why: str) -> tuple[str, Any]:
    """The recipe setting the refusal `why` is about: the first one that, set back to the plain recipe's value,
    changes the answer (the contract checks one technique at a time, each with its own sentence)."""
    for name, value in recipe.changed().items():
        plain = dataclasses.replace(recipe, **{name: RECIPE_SETTINGS[name].default})
        if recipe_why_not(plain, layout, ctx) != why:
            return name, value
    # A refusal of the plain recipe itself (an unknown optimizer is refused before it is ever "changed").
    return "optimizer", recipe.optimizer
