"""What a model is, in the numbers the planner needs: parameters, shapes, context.

Importing this package never imports torch or huggingface_hub; the hub is
imported when a repo id is described, torch only in a child process.
"""

from rigpilot.engine.models.describe import describe_config, describe_model
from rigpilot.engine.models.formulas import SUPPORTED_MODEL_TYPES
from rigpilot.engine.models.presets import Preset, list_presets
from rigpilot.engine.models.spec import Linear, ModelSpec

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "Linear",
    "ModelSpec",
    "Preset",
    "describe_config",
    "describe_model",
    "list_presets",
]
