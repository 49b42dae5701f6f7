"""The `rigpilot` command: bare, it opens the app; with a subcommand, it is the CLI.

It lives in app/ because the engine must never import the GUI, while the GUI
may use the engine. Nothing Qt is imported on the CLI path, so subcommands
start fast and work without a display.
"""

from __future__ import annotations

import sys

from engine import cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        return cli.main(argv)
    # Until the desktop window exists, the live terminal view is the app.
    return cli.main(["watch"])


if __name__ == "__main__":
    sys.exit(main())
