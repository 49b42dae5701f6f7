"""What the wizard's Model page checks on this side: a model folder that describes a model but holds no weights.

Describing the model itself is engine.models.job_model's (the engine's `plan`
request describes it the same way).
"""

from __future__ import annotations

from pathlib import Path

from rigpilot.engine.given_path import is_given_file

WEIGHT_FILES = ("*.safetensors", "*.bin")


def missing_weights(ref: str) -> str | None:
    """The local model folder `ref` names when it has a config.json but no weight files, else None.

    Such a folder describes a model (the planner is happy) but a fine-tune would have nothing to
    start from; training from scratch is what it can do.
    """
    if is_given_file(ref.strip()):
        path = Path(ref.strip()).expanduser()
        folder = path.parent if path.name == "config.json" else path
    else:
        folder = Path(ref.strip())
    if not is_given_file(folder / "config.json"):
        return None  # a preset or hub id: the engine fetches the weights
    if any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES):
        return None
    return folder.name or str(folder)
