"""A model as a job names it: a preset, a folder, a hub id, or a bare config.json file (training from scratch).

The planner's `plan` request and the job wizard's model check both describe a
job's model with `describe_for_job`, so a file the wizard accepts is one the
engine plans.
"""

from __future__ import annotations

from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import EITHER, check_given_path
from rigpilot.engine.models.config_file import read_config
from rigpilot.engine.models.describe import describe_config, describe_model
from rigpilot.engine.models.spec import ModelSpec


def describe_for_job(ref: str, trust_remote_code: bool = False) -> ModelSpec:
    """`describe_model`, and also a config file (JSON) on its own, which training from scratch takes."""
    path = check_given_path(ref.strip(), "model", expect=EITHER, missing_ok=True)
    if path.is_file():
        if path.suffix.lower() != ".json":
            raise UserError(f"{ref} is a file but not a config.json", reason="not_a_config_file", path=ref)
        return describe_config(read_config(path), id=path.parent.name or path.name)
    return describe_model(ref, trust_remote_code=trust_remote_code)
