import json
import subprocess
import sys

import pytest

from rigpilot.engine.cli.entry import main


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_profiles_lists_every_profile(capsys):
    rc, out, _ = run(capsys, "profiles", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["schema"] == "rigpilot.profiles/1"
    assert {"8x-h100-sxm", "4x-rtx4090"} <= {p["id"] for p in data["profiles"]}


def test_gpus_table_and_json(capsys):
    rc, out, _ = run(capsys, "gpus", "--simulate", "4x-rtxa6000-bridged")
    assert rc == 0
    assert out.startswith("simulated: 4×RTX A6000")
    assert out.count("RTX A6000") >= 4 and "49140MiB" in out
    rc, out, _ = run(capsys, "gpus", "--simulate", "8x-h100-sxm", "--json")
    data = json.loads(out)
    assert data["schema"] == "rigpilot.gpus/1"
    assert data["machine"]["label"] == "simulated: 8×H100 80GB HBM3"
    assert len(data["telemetry"]["gpus"]) == 8
    assert data["telemetry"]["gpus"][0]["fan_pct"] is None
    assert data["telemetry"]["simulated"] is True


def test_topo_prints_matrix_then_summary(capsys):
    rc, out, _ = run(capsys, "topo", "--simulate", "2x-rtx3090-nvlink")
    assert rc == 0
    assert "GPU0   X    NV4" in out
    assert out.index("Legend:") < out.index("Summary:")
    rc, out, _ = run(capsys, "topo", "--simulate", "8x-a100-pcie", "--json")
    data = json.loads(out)
    assert data["matrix"]["cells"][0][:3] == ["X", "NV12", "NODE"]
    assert data["summary"]["nvlink_islands"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_watch_emits_frames_then_stops(capsys):
    rc, out, _ = run(capsys, "watch", "--simulate", "1x-rtx4090", "--count", "2", "--interval", "0.05")
    assert rc == 0
    assert out.count("Rigpilot watch — simulated: 1×RTX 4090") == 2
    rc, out, _ = run(capsys, "watch", "--simulate", "1x-rtx4090", "--count", "3", "--interval", "0.05", "--json")
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == 3 and all(x["schema"] == "rigpilot.telemetry/1" for x in lines)
    assert lines[0]["time"] < lines[2]["time"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["gpus", "--simulate", "nope"], "unknown simulated profile 'nope'"),
        (["topo", "--import", "/nonexistent/topo.txt"], "/nonexistent/topo.txt"),
        (["gpus", "--simulate", "1x-rtx4090", "--import", "x.txt"], "cannot be used together"),
        (["gpus", "--bogus"], "unrecognized arguments: --bogus"),
        (["watch", "--interval", "0"], "must be greater than 0"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_errors_are_one_line_and_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exc_info:
        code = main(argv)
        raise SystemExit(code)
    assert exc_info.value.code == 2
    _, err = capsys.readouterr()
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_console_script_runs_in_a_fresh_process():
    r = subprocess.run([sys.executable, "-m", "rigpilot.engine.cli", "topo", "--simulate", "4x-rtx4090"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "No NVLink" in r.stdout
    r = subprocess.run([sys.executable, "-m", "rigpilot.engine.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("rigpilot ")
