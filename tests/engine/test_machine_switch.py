"""One machine everywhere: the engine switches its machine when Settings change, and the CLI agrees with it.

Each test runs its own engine service (as tests/engine/test_service_engine.py does) that follows Settings:
RIGPILOT_SIMULATE is unset, so with no NVIDIA driver the settings' profile stands in.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rigpilot.engine.api.client import EngineClient, EngineError
from rigpilot.engine.hardware.discovery import open_backend
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.settings import Settings

from support.engine import GATE_SCRIPT, Engine, engine_home, gate, leftover_job_processes
from support.paths import REPO
from support.waiting import wait_for


@pytest.fixture
def engine(tmp_path, monkeypatch):
    engine_home(tmp_path, monkeypatch)
    monkeypatch.delenv("RIGPILOT_SIMULATE")  # follow Settings, as a user's engine does
    if not open_backend().machine.simulated:
        pytest.skip("this computer has NVIDIA GPUs: the engine serves them, whatever the simulated profile")
    e = Engine(tmp_path)
    yield e
    e.stop()
    for p in leftover_job_processes(tmp_path):
        p.kill()


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`rigpilot ARGS` in a process of its own, as a user types it (the environment is the test's)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "rigpilot.engine.cli", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    if check:
        assert r.returncode == 0, r.stderr
    return r


def cli_machines() -> set[str]:
    """The machine each machine-showing command uses now, by its label: one when they agree."""
    return {
        json.loads(cli("gpus", "--json").stdout)["machine"]["label"],
        json.loads(cli("topo", "--json").stdout)["machine"]["label"],
        json.loads(cli("plan", "--model", "gpt2", "--json").stdout)["machine"],
        json.loads(cli("settings", "--json").stdout)["machine"]["label"],
    }


def label(profile: str) -> str:
    return load_profile(profile).label


def next_event(client: EngineClient, kind: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ev = client.next_event(left)
        if ev is not None and ev.get("event") == kind:
            return ev
    raise AssertionError(f"no {kind} event within {timeout} s")


def test_a_new_profile_is_served_and_pushed_at_once(engine):
    engine.start()
    with engine.client() as c, engine.client() as watcher:
        assert c.request("machine")["machine"]["profile"] == "4x-rtx4090"
        watcher.request("subscribe", topics=["telemetry"])
        next_event(watcher, "telemetry")

        Settings(simulated_profile="2x-rtx3090-nvlink").save()
        reply = c.request("reload_machine")
        assert reply["changed"] and reply["machine"]["profile"] == "2x-rtx3090-nvlink"

        pushed = next_event(watcher, "machine")
        assert pushed["machine"]["profile"] == "2x-rtx3090-nvlink" and pushed["notes"]
        assert len(next_event(watcher, "telemetry")["sample"]["gpus"]) == 2  # sampled from the new machine
        assert c.request("machine")["machine"]["profile"] == "2x-rtx3090-nvlink"
        assert c.request("topology")["matrix"]["gpus"] == [0, 1]
        assert c.request("hello")["machine"] == "simulated: 2×RTX 3090"
        # A job is now checked against the new machine's GPUs.
        with pytest.raises(EngineError, match="GPU 3"):
            c.request("check", spec={"kind": "script", "script": ["x.py"], "gpus": [3]})
        # Asking again changes nothing and pushes nothing.
        assert not c.request("reload_machine")["changed"]

        # The profile can come with the request (a remote GUI cannot write the engine's settings file).
        reply = c.request("reload_machine", simulated_profile="1x-rtx4090")
        assert reply["changed"] and Settings.load().simulated_profile == "1x-rtx4090"
        with pytest.raises(EngineError, match="unknown simulated profile 'nope'"):
            c.request("reload_machine", simulated_profile="nope")
        assert Settings.load().simulated_profile == "1x-rtx4090"


def test_an_engine_started_on_a_named_profile_says_why_it_does_not_follow_settings(engine):
    engine.start("--simulate", "8x-a100-pcie")
    with engine.client() as c:
        Settings(simulated_profile="1x-rtx4090").save()
        with pytest.raises(EngineError, match=r"started on the simulated profile '8x-a100-pcie' \(--simulate\)"):
            c.request("reload_machine")
        assert c.request("machine")["machine"]["profile"] == "8x-a100-pcie"


@pytest.mark.slow
def test_a_running_job_holds_the_machine_and_is_named(engine):
    engine.start()
    script = engine.script("gate.py", GATE_SCRIPT)
    with engine.client() as c:
        job = engine.submit(c, script, str(gate(engine, "a")), gpus=[0], name="holds-gpu0")
        engine.wait_state(c, job["id"], "running")
        Settings(simulated_profile="8x-h100-sxm").save()
        with pytest.raises(EngineError) as refused:
            c.request("reload_machine")
        message = str(refused.value)
        assert f"{job['id']} 'holds-gpu0' (running)" in message and "\n" not in message
        # Deferred, not lost: the reply's code and facts say to what and after which jobs.
        assert refused.value.reason == "machine_switch_deferred" and "when it ends" in message
        assert refused.value.fields == {"jobs": [job["id"]], "to": label("8x-h100-sxm")}
        assert c.request("machine")["machine"]["profile"] == "4x-rtx4090"
        # The CLI says the same, keeps the setting and reports that it is not applied yet.
        r = cli("settings", "set", "simulated-profile", "8x-h100-sxm", check=False)
        assert r.returncode == 1 and "holds-gpu0" in r.stderr and "Traceback" not in r.stderr
        assert cli_machines() == {label("4x-rtx4090")}  # everything shows what the engine serves

        gate(engine, "a").touch()
        engine.wait_state(c, job["id"], "completed")
        # The switch asked for while the job ran is made when it ends, nobody asking again.
        wait_for(lambda: c.request("machine")["machine"]["profile"] == "8x-h100-sxm", 20, what="the deferred switch")
        assert cli_machines() == {label("8x-h100-sxm")}
        assert not c.request("reload_machine")["changed"]


def test_cli_commands_agree_with_the_engine_running_and_not(engine):
    assert cli_machines() == {label("4x-rtx4090")}  # no engine: Settings, found as the engine finds it
    engine.start()
    assert "machine: simulated: 8×H100" in cli("settings", "set", "simulated-profile", "8x-h100-sxm").stdout
    with engine.client() as c:
        assert c.request("machine")["machine"]["profile"] == "8x-h100-sxm"
    assert cli_machines() == {label("8x-h100-sxm")}
    # Settings changed behind the engine's back (an editor): the CLI shows what the engine serves, not the file.
    Settings(simulated_profile="1x-rtx4090").save()
    assert cli_machines() == {label("8x-h100-sxm")}
    engine.stop()
    wait_for(lambda: not (Path(os.environ["XDG_RUNTIME_DIR"]) / "rigpilot" / "engine.sock").exists(), 15,
             what="the engine's socket to go")  # fmt: skip
    assert cli_machines() == {label("1x-rtx4090")}
    r = cli("settings", "set", "simulated-profile", "nope", check=False)
    assert r.returncode == 2 and r.stderr.startswith("rigpilot: error: unknown simulated profile 'nope'")
