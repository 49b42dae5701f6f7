"""Planning and submitting a `WizardState`: the requests the wizard sends, shared with "Run the example job".

The wizard walks these steps page by page; the Jobs page's one-click example
takes the same steps with the wizard's first-run defaults (`default_state`),
so the example job is exactly the one Next, Next, ... Launch would submit.
No widgets here: the link answers on the GUI thread. Plans and their
re-checks come from the engine alone: there is no second planner here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rigpilot.app.planner.model import error_text, plans_of
from rigpilot.app.wizard.state import WizardState, default_gpus, default_state, examples_present
from rigpilot.engine.errors import UserError
from rigpilot.engine.planner.overrides import Overrides

NOT_CONNECTED = "engine_not_connected"  # the reason of the refusal below: plans come from the engine alone


def not_connected() -> UserError:
    return UserError("Not connected to the engine: plans come from it. Once it is back, plan again.",
                     reason=NOT_CONNECTED)  # fmt: skip


def connected(link: Any) -> bool:
    return getattr(link, "state", None) == "connected"


class PlanCheck:
    """A plan request whose memory check may still be under way; `cancel()` drops whatever it still brings."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def request_plan(
    link: Any,
    state: WizardState,
    on_done: Callable[[dict[str, Any]], None],
    on_error: Callable[[BaseException], None],
    on_formula: Callable[[dict[str, Any]], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> PlanCheck:
    """A plan (search result) for `state`, from the engine's `plan` request; `on_error` gets the refusal itself
    (its reason and fields say which fix to offer).

    With `on_formula`: the formula's answer comes first, at once (`on_formula(result)`); then the engine traces
    the top plans one request at a time (`on_progress(done, of)` after each) and `on_done` gets the result
    ranked with the traced figures. An engine from before this answers the old way: `on_done` alone."""
    check = PlanCheck()
    asked: dict[str, Any] = {"workload": state.workload_args(), "options": {}}

    def done(result: dict[str, Any]) -> None:
        if not check.cancelled:
            on_done(result)

    def failed(error: BaseException) -> None:
        if not check.cancelled:
            on_error(error)

    if on_formula is None:
        _ask_plan(link, state, done, failed, **asked)
        return check

    def formula(result: dict[str, Any]) -> None:
        if check.cancelled:
            return
        on_formula(result)
        plans = plans_of(result)[: int((result.get("trace") or {}).get("pending") or 0)]
        if not plans:
            done(result)
            return
        trace(plans, 0)

    def trace(plans: list[dict[str, Any]], i: int) -> None:
        if check.cancelled:
            return
        if i == len(plans):  # every trace in the engine's cache now: the search ranks with them at once
            _ask_plan(link, state, done, failed, **asked)
            return

        def traced(_: dict[str, Any]) -> None:
            if not check.cancelled and on_progress is not None:
                on_progress(i + 1, len(plans))
            trace(plans, i + 1)

        _ask_plan(link, state, traced, failed, trace={"plan": plans[i]})

    def refused(error: BaseException) -> None:
        if getattr(error, "code", None) == "invalid" and not check.cancelled:
            _ask_plan(link, state, done, failed, **asked)  # an engine from before `verify`
            return
        failed(error)

    _ask_plan(link, state, formula, refused, verify=False, **asked)
    return check


def recheck(
    link: Any,
    state: WizardState,
    plan: dict[str, Any],
    overrides: Overrides,
    on_done: Callable[[dict[str, Any]], None],
    on_error: Callable[[BaseException], None],
) -> None:
    """`plan` with `overrides`, re-checked by the engine's `plan` request (`recheck`): `on_done({"plan", "fits",
    "message"})`, or `on_error` with the refusal."""
    _ask_plan(link, state, on_done, on_error, recheck={"plan": plan, "overrides": overrides.to_dict()})


def _ask_plan(link: Any, state: WizardState, on_done: Callable[[dict[str, Any]], None],
              on_error: Callable[[BaseException], None], **args: Any) -> None:  # fmt: skip
    """The engine's `plan` request for `state`'s model and GPUs with `args` (a search, or a re-check)."""
    if not connected(link):
        on_error(not_connected())
        return
    link.call(
        "plan",
        on_done=lambda reply: on_done(reply.get("result", reply)),
        on_error=on_error,
        model=state.planning_model(), gpus=sorted(state.gpus), trust_remote_code=state.trust_remote_code, **args,
    )  # fmt: skip


def submission(link: Any, state: WizardState) -> dict[str, Any]:
    """The arguments of the `submit` request for `state` (and of `check`, the same)."""
    args: dict[str, Any] = {"spec": state.to_spec(), "plan": state.plan if state.planned else None}
    if state.slurm is not None:  # SLURM places the job itself: it never also spans this engine's nodes
        args["slurm"] = dict(state.slurm)
    elif state.nodes:  # the same GPUs on every node; this engine leads (engine.service.multinode)
        args["nodes"] = ["local", *state.nodes]
    if getattr(link, "remote", None) is None:
        args["cwd"] = os.getcwd()  # relative paths typed by the user mean: from here
    return args


def run_example(
    link: Any,
    machine: dict[str, Any] | None,
    jobs: list[dict[str, Any]],
    on_done: Callable[[str], None],
    on_error: Callable[[str], None],
) -> WizardState | None:
    """Plan the wizard's first-run job (the shipped tiny model and text) on free GPUs and submit it under the
    recommended plan: `on_done(job_id)`, or `on_error(one line)`. Returns the state it submits."""
    if not examples_present():
        on_error("the example model and data are not installed with this copy of Rigpilot")
        return None
    if machine is None:
        on_error("the engine has not said which machine it runs on yet; try again once it is connected")
        return None
    state = default_state(machine)
    state.gpus = default_gpus(machine, jobs) or state.gpus  # all busy: the job queues for the usual ones
    state.name = "example: tiny-llama from scratch"

    def planned(result: dict[str, Any]) -> None:
        best = result.get("best")
        if best is None:
            on_error("it does not fit on the free GPUs: " + "; ".join(result.get("explanation") or []))
            return
        state.take_plan(best)
        link.call(
            "submit",
            on_done=lambda reply: on_done(reply["job"]["id"]),
            on_error=lambda e: on_error(error_text(e)),
            **submission(link, state),
        )

    request_plan(link, state, planned, lambda e: on_error(error_text(e)))
    return state
