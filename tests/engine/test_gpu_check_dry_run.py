"""The prepared GPU check (benchmarks/gpu_check.py) in its dry run: the whole path a lent GPU's minutes go to —
the CLI, the engine it starts, `rigpilot doctor`, a training recipe planned and run, inference against
transformers' generate() — on the simulated machine's CPU ranks, so a GPU session measures instead of debugging."""

import json
import subprocess
import sys

from support.paths import REPO


def test_the_gpu_check_dry_run_passes_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out), "--dry-run", "--recipes", "2",
         "--steps", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] is True
    assert "error" not in result["machine"], result["machine"]
    doctor = result["doctor"]
    assert doctor["exit"] == 0 and doctor["report"]["complete"] is True and doctor["report"]["simulated"] is True
    (row,) = result["training"]
    assert row["recipe"] == "pure bf16" and row["state"] == "completed", row
    assert row["peak_gib"] and row["planned_peak_gib"] and row["tokens_per_s"]
    assert result["inference"]["same"] is True, result["inference"]
    table = (out / "gpu_check.txt").read_text()
    assert "DRY RUN on CPU ranks" in table and "Machine check of simulated" in table and "Traceback" not in table
