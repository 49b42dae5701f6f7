"""The wizard's plan request pins only the recipe settings the user chose; what a plan chose stays the planner's."""

from __future__ import annotations

from rigpilot.app.wizard.state import WizardState


def _plan(recipe: dict) -> dict:
    return {
        "parallelism": {"micro_batch": 2, "grad_accum": 1, "checkpointing": "full"},
        "workload": {"seq_len": 2048, "global_batch": 2, **recipe},
    }


def test_a_taken_plans_recipe_is_not_sent_back_as_pins() -> None:
    state = WizardState(kind="finetune", model="llama-3.1-8b", method="full")
    state.take_plan(_plan({"master_weights": "bf16", "loss_chunks": 8, "optimizer_offload": True}))
    assert state.train.master_weights == "bf16" and state.train.optimizer_offload  # the job runs the plan's recipe
    state.global_batch = 16  # the user asks for another batch: the planner chooses the recipe again
    args = state.workload_args()
    assert not any(k in args for k in ("master_weights", "loss_chunks", "optimizer_offload"))


def test_a_setting_the_user_chose_is_pinned_and_remembered() -> None:
    state = WizardState(kind="finetune", model="llama-3.1-8b", method="full")
    state.pin_recipe("optimizer", "adamw8bit")
    assert state.workload_args()["optimizer"] == "adamw8bit"
    again = WizardState.from_json(state.to_json())
    assert again.pinned_recipe == ["optimizer"] and again.workload_args()["optimizer"] == "adamw8bit"


def test_a_setting_given_back_to_the_planner_takes_the_plans_choice_again() -> None:
    state = WizardState(kind="finetune", model="llama-3.1-8b", method="full")
    state.take_plan(_plan({"loss_chunks": 8, "compile": False}))
    state.pin_recipe("loss_chunks", 16)
    # The re-checked plan carries the pin: it is the user's value, not the planner's choice.
    state.take_plan(_plan({"loss_chunks": 16, "compile": False}))
    assert state.planned_recipe["loss_chunks"] == 8
    state.unpin_recipe("loss_chunks")
    assert state.pinned_recipe == [] and state.train.loss_chunks == 8 and "loss_chunks" not in state.workload_args()
    state.pin_recipe("fp8", True)
    state.unpin_recipe("fp8")  # no plan said: the engine's default
    assert state.train.fp8 is False


def test_a_copy_of_the_state_has_its_own_pins() -> None:
    state = WizardState(kind="finetune", model="llama-3.1-8b", method="full")
    copy = state.copy()
    copy.pin_recipe("optimizer", "adamw8bit")
    assert state.pinned_recipe == [] and copy.pinned_recipe == ["optimizer"]
