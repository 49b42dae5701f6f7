"""Rigpilot: run AI work on a multi-GPU workstation.

Everything Rigpilot installs imports under this one package, so nothing it
ships can shadow a user's own `engine.py`, `app.py` or `resources/`:

    rigpilot.engine     the headless core: hardware, planner, jobs, the engine service, the workers
    rigpilot.app        the desktop app (Qt); never imported by the engine
    rigpilot.resources  data files: machine profiles, GPU specs, icons, desktop files
    rigpilot.examples   small offline inputs for a first job (a tiny Llama, Shakespeare, chat data)

In the repository these are the top-level folders `engine/`, `app/`,
`resources/` and `examples/`; `rigpilot/` links to them, so a checkout, an
editable install and a wheel all import the same names.

Code that runs inside a Rigpilot job reports metrics with:

    from rigpilot import report
    report(step=10, loss=2.31)
"""

from rigpilot.engine import __version__
from rigpilot.engine.report import report

__all__ = ["__version__", "report"]
