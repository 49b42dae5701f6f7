"""The examples Rigpilot ships (a tiny Llama, Shakespeare, chat data), wherever it is installed.

The README's commands name them as in a checkout: `--data examples/data/shakespeare.txt`. Someone who
installed the .deb, or with pip or pipx, has no examples/ folder where they stand, so a path given on
the command line that starts with `examples/`, does not exist there, and names one of the shipped
examples is taken from the shipped ones, and one line on stderr says which file was used. A real
`examples/` folder of the user's own always wins: nothing is looked up while the path exists.
"""

from __future__ import annotations

import os
from pathlib import Path

# Package data (rigpilot/examples): the repository's examples/ in a checkout, rigpilot/examples in a wheel and the .deb.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_PREFIX = "examples/"


def shipped_example(given: str, cwd: str | os.PathLike[str]) -> Path | None:
    """The shipped file or folder `given` means, when it is an `examples/…` path that `cwd` does not have; else None."""
    rest = given.removeprefix("./")
    if not rest.startswith(_PREFIX) or (Path(cwd) / rest).exists():
        return None
    parts = Path(rest).parts[1:]
    if not parts or ".." in parts:
        return None
    candidate = EXAMPLES.joinpath(*parts)
    return candidate if candidate.exists() else None


def note(given: str, used: Path) -> str:
    """The one line that tells the user which file stood in for what they typed."""
    return f"rigpilot: no {given} here; using the example Rigpilot ships: {used}"
