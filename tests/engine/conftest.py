"""The engine service and what runs against it: real service processes on sockets, the job store, the CLI against
a running engine, SLURM (a real one-machine cluster where installed), jobs across two engines.

The harness is tests/support/engine.py; the `engine` fixture below gives each test its own service.
"""

import pytest

from support.engine import Engine, engine_home, leftover_job_processes


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """An engine service (not started yet: `engine.start(...)`) whose folders are in tmp_path, on a simulated
    4×RTX 4090; stopped afterwards, and any job process it left killed."""
    engine_home(tmp_path, monkeypatch)
    e = Engine(tmp_path)
    yield e
    e.stop()
    for p in leftover_job_processes(tmp_path):  # never leave a job behind, whatever failed
        p.kill()
