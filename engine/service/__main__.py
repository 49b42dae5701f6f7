"""`python -m rigpilot.engine.service`: the engine service (what `rigpilot engine` and clients start)."""

import sys

from rigpilot.engine.service.command_line import main_service

if __name__ == "__main__":
    sys.exit(main_service(sys.argv[1:]))
