"""Where engine.launch.rankexec lived before engine/service was cut by reason to change.

A SLURM job queued by an older Rigpilot has `python -m rigpilot.engine.service.rankexec` in its sbatch
script; when it starts after an upgrade, its ranks must still find the module. Nothing new uses this path.
"""

from __future__ import annotations

import sys

from rigpilot.engine.launch.rankexec import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
