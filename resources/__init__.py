"""Data files shipped with Rigpilot: machine profiles, the GPU spec table, icons, desktop files.

A package only so that installed copies can find their data through importlib.resources.
"""

from importlib.resources import files
from pathlib import Path


def path(*parts: str) -> Path:
    """The path of a file or folder under resources/."""
    return Path(str(files(__name__).joinpath(*parts)))
