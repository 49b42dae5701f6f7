"""The `rigpilot` command: bare, it opens the app; with a subcommand, it is the CLI.

It lives in app/ because the engine must never import the GUI, while the GUI
may use the engine. Nothing Qt is imported on the CLI path, so subcommands
start fast and work without a display.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--self-test":
        if len(argv) > 2:
            print("usage: rigpilot --self-test [DIR]", file=sys.stderr)
            return 2
        from rigpilot.app.selftest import main as self_test

        return self_test(Path(argv[1]) if len(argv) > 1 else None)
    if argv and argv[0] == "--screenshots":
        themes: tuple[str, ...] = ("light", "dark")
        if len(argv) == 4 and argv[2] == "--theme" and argv[3] in themes:
            themes = (argv[3],)
        elif len(argv) != 2:
            print("usage: rigpilot --screenshots DIR [--theme light|dark]", file=sys.stderr)
            return 2
        from rigpilot.app.screenshots import main as screenshots

        return screenshots(Path(argv[1]), themes)
    if argv:
        # Imported here: the CLI's modules (the engine's settings, its client) are not needed to open the app.
        from rigpilot.engine.cli import entry as cli

        return cli.main(argv)
    from rigpilot.app.main import main as run_app

    return run_app()


if __name__ == "__main__":
    sys.exit(main())
