"""Which figures of a job's metric records and telemetry become TensorBoard scalars (engine.jobs.tensorboard)."""

import json

from rigpilot.engine.jobs.tensorboard import scalars, telemetry_scalars


def test_rank_0s_figures_go_by_their_names_and_per_rank_ones_by_rank():
    step = {"time": 5.0, "rank": 0, "run": 1, "step": 3, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 900.0,
            "peak_memory": 1024, "mfu": None, "note": "text", "flag": True}  # fmt: skip
    assert sorted(scalars(step)) == [
        ("loss", 2.5),
        ("lr", 1e-3),
        ("peak_memory/rank0", 1024.0),
        ("tokens_per_s/rank0", 900.0),
    ]
    other = {**step, "rank": 1}
    assert sorted(scalars(other)) == [("peak_memory/rank1", 1024.0), ("tokens_per_s/rank1", 900.0)]
    assert scalars({"rank": 0, "run": 1, "step": 4, "kind": "eval", "eval_loss": 2.0}) == [("eval_loss", 2.0)]


def test_records_without_a_step_or_a_figure_kind_make_no_scalar():
    assert scalars({"rank": 0, "step": None, "loss": 1.0}) == []
    assert scalars({"rank": 0, "step": 2, "kind": "status", "phase": "training", "max_steps": 9}) == []
    assert scalars({"rank": 0, "step": 2, "kind": "checkpoint", "checkpoint_time": 0.5}) == []
    # A NaN loss is sent as null with a marker (engine.report): a gap, not a point.
    assert scalars({"rank": 0, "step": 2, "loss": None, "nonfinite": ["loss"]}) == []


def test_telemetry_of_the_jobs_gpus_only():
    sample = {"time": 10.0, "gpus": [{"index": 0, "gpu_util": 50.0, "memory_used": 2048},
                                     {"index": 1, "gpu_util": 70.0, "memory_used": None}]}  # fmt: skip
    assert telemetry_scalars(sample, [1]) == [("gpu1/utilization", 70.0)]
    assert telemetry_scalars(sample, [0]) == [("gpu0/utilization", 50.0), ("gpu0/memory_used", 2048.0)]


def test_a_resumed_runs_steps_replace_the_earlier_runs_in_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rigpilot.engine.jobs.tensorboard import TensorboardLog

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    # Run 1 reached step 6; run 2 resumed from the checkpoint of step 4 and trained steps 5 to 7 again.
    records = [{"time": 100.0 + i, "rank": 0, "run": run, "step": step, "loss": float(run * 10 + step)}
               for i, (run, step) in enumerate([(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6),
                                                (2, 5), (2, 6), (2, 7)])]  # fmt: skip
    (metrics / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for _ in range(2):  # a second follower (a resume, a restart of the engine) writes the same files afresh
        tb = TensorboardLog(tmp_path, [0], 0.0)
        tb.catch_up()
        tb.close()
    events = EventAccumulator(str(tmp_path / "tensorboard" / "training"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (1, 11.0),
        (2, 12.0),
        (3, 13.0),
        (4, 14.0),
        (5, 25.0),
        (6, 26.0),
        (7, 27.0),
    ]
