"""What a user reads when things go wrong: the rank torchrun names, where a resume starts, a script folder."""

import json
import os
import signal
from pathlib import Path

import pytest

from rigpilot.engine.cli.entry import main as cli_main

from support.engine import GATE_SCRIPT, gate
from support.paths import REPO
from support.waiting import wait_for

pytestmark = pytest.mark.slow


def test_killing_one_ranks_wrapper_blames_that_rank(engine):
    engine.start()
    script = engine.script("gate.py", GATE_SCRIPT)
    with engine.client() as c:
        job = engine.submit(c, script, str(gate(engine, "k")), gpus=[0, 1], name="k")
        engine.wait_state(c, job["id"], "running")
        rank1 = Path(job["job_dir"]) / "ranks" / "rank1.json"
        wait_for(lambda: rank1.exists() and "child_pid" in json.loads(rank1.read_text()), 30, what="rank 1 to start")
        os.kill(json.loads(rank1.read_text())["pid"], signal.SIGKILL)  # the wrapper: it records no exit
        done = engine.wait_state(c, job["id"], "failed", "completed", "cancelled")
    assert done["failed_rank"] == 1 and done["exit_reason"].startswith("rank 1 was killed by SIGKILL"), done["exit_reason"]


def test_a_resume_without_a_checkpoint_says_it_starts_from_step_0_and_a_script_folder_is_named(
    engine, capsys, tmp_path, monkeypatch
):
    engine.start()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scripts_dir").mkdir()
    assert cli_main(["run", "script", "--gpus", "0", "--", "scripts_dir"]) != 0
    err = capsys.readouterr().err
    assert "is a folder" in err and "does not exist" not in err
    data = tmp_path / "data.txt"
    data.write_text("to be or not to be\n" * 50)
    config = REPO / "examples" / "models" / "tiny-llama" / "config.json"
    with engine.client() as c:
        # GPU 0 busy, so the training job waits in the queue and is cancelled there: it never saved a checkpoint.
        busy = engine.submit(c, engine.script("gate.py", GATE_SCRIPT), str(gate(engine, "busy")), gpus=[0])
        engine.wait_state(c, busy["id"], "running")
        train = {"dataset": [str(data)], "max_steps": 4}
        job = c.request("submit", spec={"kind": "train", "model": str(config), "gpus": [0], "train": train})["job"]
        assert c.request("cancel", job=job["id"])["job"]["state"] == "cancelled"
        capsys.readouterr()
        assert cli_main(["resume", job["id"], "--detach"]) == 0
        out = capsys.readouterr().out
        assert "no checkpoint was saved, so it starts from step 0" in out and "newest checkpoint" not in out
        c.request("cancel", job=job["id"])
        gate(engine, "busy").touch()
        engine.wait_state(c, busy["id"], "completed")
