"""A job with `tensorboard` on: TensorBoard's own event reader finds every figure its ranks reported."""

import json
from pathlib import Path

import pytest

from support.paths import REPO, SHAKESPEARE

pytestmark = pytest.mark.slow


def test_tensorboards_reader_reads_every_scalar_a_training_job_reported(engine, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rigpilot.engine.cli.entry import main as cli_main
    from rigpilot.engine.jobs.tensorboard import scalars

    engine.start()
    config = REPO / "examples" / "models" / "tiny-llama" / "config.json"
    train = {"dataset": [str(SHAKESPEARE)], "method": "scratch", "precision": "fp32", "seq_len": 32,
             "micro_batch": 2, "max_steps": 4, "eval_every": 2, "checkpoint_every": 0}  # fmt: skip
    spec = {"kind": "train", "model": str(config), "gpus": [0], "train": train, "tensorboard": True}
    with engine.client() as c:
        job = c.request("submit", spec=spec)["job"]
        done = engine.wait_state(c, job["id"], "completed", "failed", "cancelled", timeout=240)
        assert done["state"] == "completed", done.get("exit_reason")
        detail = c.request("job", job=job["id"])["job"]
    folder = Path(job["job_dir"]) / "tensorboard"
    assert detail["tensorboard_dir"] == str(folder)

    expected: dict[str, list[tuple[int, float]]] = {}
    for f in sorted((Path(job["job_dir"]) / "metrics").glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            record = json.loads(line)
            for tag, value in scalars(record):
                expected.setdefault(tag, []).append((record["step"], value))
    assert {"loss", "lr", "eval_loss", "tokens_per_s/rank0", "peak_memory/rank0"} <= set(expected)

    events = EventAccumulator(str(folder / "training"), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in sorted(points)], tag
    # The (simulated) telemetry of the job's GPU, and of no other.
    gpus = EventAccumulator(str(folder / "gpus"))
    gpus.Reload()
    assert {"gpu0/utilization", "gpu0/memory_used"} <= set(gpus.Tags()["scalars"])
    assert not any(t.startswith("gpu1/") for t in gpus.Tags()["scalars"])

    assert cli_main(["metrics", job["id"]]) == 0
    assert f"TensorBoard: tensorboard --logdir {folder}" in capsys.readouterr().out
