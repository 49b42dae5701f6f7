"""`python -m rigpilot.engine.cli`: the command line."""

import sys

from rigpilot.engine.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
