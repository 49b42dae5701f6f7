"""A scaling study's speed-ups in plain words (engine.jobs.scaling_words), against figures worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from rigpilot.engine.hardware.machine import P2P
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs import scaling, scaling_table, scaling_words
from rigpilot.engine.jobs.scaling_words import PointLink, comm_share, point_link, words

from support.doctor_reports import clean_report, four_gpu_report


def point(n: int, tps: float, step_s: float = 1.0, comm_s: float | None = None) -> dict:
    return {"gpus": n, "gpu_indices": list(range(n)), "state": "completed",
            "measured": {"tokens_per_s": tps, "steps": 7, "step_time_spread": 0.02},
            "predicted": {"tokens_per_s": None, "step_s": step_s, "exposed_comm_s": comm_s}}  # fmt: skip


def test_the_link_is_named_where_the_plans_share_covers_the_loss():
    # 1 GPU: 1000 tok/s; 2 GPUs: 1300 → 1.3×, 65% of linear, 35% of each step lost. The plan: 0.38 s of a 1 s
    # step exposed on the link (38%), more than half of 35%: the link is the cause.
    points = [point(1, 1000.0), point(2, 1300.0, step_s=1.0, comm_s=0.38)]
    rows = scaling.table({"points": points})
    link = PointLink("sys", 6.6, measured=True)
    assert words(rows, points, {2: link}) == [
        "The host bounce between sockets costs 35% of each step: 2 GPUs give 1.3× (the plan expected 38% at "
        "6.6 GB/s, measured)"
    ]
    # CPU ranks measured a simulated machine's points: its GPUs' link is not blamed for them.
    assert words(rows, points, {2: link}, simulated=True) == [
        "On CPU ranks (simulated): 2 GPUs give 1.3× (65% of linear); on the real GPUs the plan expects the host "
        "bounce between sockets to cost 38% of each step"
    ]


def test_a_loss_the_plan_does_not_put_on_the_link_is_not_blamed_on_it():
    # 4 GPUs at 2000 tok/s: 2×, 50% of linear, 50% lost; the plan's comm share 0.1 / 0.5 s = 20% < half of 50%.
    points = [point(1, 1000.0), point(4, 2000.0, step_s=0.5, comm_s=0.1)]
    rows = scaling.table({"points": points})
    assert words(rows, points, {4: PointLink("host", 10.08, measured=False, p2p_off=True)}) == [
        "4 GPUs give 2.0× (50% of linear), and the host bounce (P2P off after the machine check) explains little "
        "of it: the plan expected it to cost 20% of each step at 10.1 GB/s; the rest is time the plan does not count"
    ]


def test_scaling_well_noise_and_missing_figures():
    points = [point(1, 1000.0), point(2, 1900.0, comm_s=0.05), point(4, 2600.0), point(8, 9000.0)]
    points[3]["measured"]["step_time_spread"] = 0.4  # noise: no sentence
    rows = scaling.table({"points": points})
    said = words(rows, points, {2: PointLink("nvlink", 100.0, measured=False), 4: None, 8: None})
    # 1.9× on 2 GPUs is 95% of linear; 2.6× on 4 is 65%, with no link figure to name.
    assert said == ["2 GPUs give 1.9×, 95% of linear: NVLink keeps up", "4 GPUs give 2.6× (65% of linear)"]
    assert comm_share({"step_s": 2.0, "exposed_comm_s": 0.5}) == 0.25
    assert comm_share({"step_s": 0.0, "exposed_comm_s": 0.5}) is None and comm_share(None) is None


def test_the_link_of_a_point_is_the_planners_after_the_machine_check():
    here = load_profile("4x-rtx4090")
    here.pairs = [dataclasses.replace(p, p2p_read=P2P.OK, p2p_write=P2P.OK) if p.key == (0, 1) else p
                  for p in here.pairs]  # fmt: skip
    assert point_link(here, [0], None) is None
    kept = point_link(here, [0, 1], clean_report().to_dict())
    off = point_link(here, [0, 1], four_gpu_report().to_dict())
    assert kept is not None and (kept.kind, kept.p2p_off, kept.measured) == ("p2p", False, False)
    assert off is not None and (off.kind, off.p2p_off) == ("host", True) and off.gbs < kept.gbs
    # A real check's bus bandwidth is the figure named.
    real = point_link(
        load_profile("4x-rtx4090"), [2, 3], clean_report(simulated=False, pair_busbw={(2, 3): 14.0}).to_dict()
    )
    assert real is not None and (real.kind, real.gbs, real.measured) == ("host", 14.0, True)


def test_a_study_shown_says_its_words():
    here = load_profile("4x-rtx4090")
    study = {"simulated": False, "points": [point(1, 1000.0), point(2, 1300.0, comm_s=0.38)]}
    study["points"][1]["predicted"]["comm_group"] = [2, 3]
    study["table"] = scaling.table(study)
    said = scaling_words.of_study(study, here, clean_report(simulated=False, pair_busbw={(2, 3): 6.6}).to_dict())
    assert said == ["The host bounce (no P2P) costs 35% of each step: 2 GPUs give 1.3× (the plan expected 38% at 6.6 GB/s, "
                    "measured)"]  # fmt: skip
    gone = {**study, "points": [point(1, 1000.0), {**point(2, 1300.0, comm_s=0.38), "gpu_indices": [0, 9]}]}
    assert scaling_words.of_study(gone, here, None) == ["2 GPUs give 1.3× (65% of linear)"]


@pytest.mark.parametrize("kind", sorted(scaling_words.LINK_WORDS))
def test_every_link_kind_has_words(kind):
    assert scaling_words._link_words(PointLink(kind, 1.0, False))


def test_rigpilot_scaling_prints_the_words_before_the_notes():
    study = scaling.summarize({
        "id": "s1", "model": "tiny", "machine": "box", "simulated": False, "cpu_cores": 2,
        "settings": {"global_batch": 8, "seq_len": 32, "micro_batch": 2, "precision": "fp32", "method": "full",
                     "steps": 9, "warmup": 2},
        "points": [point(1, 1000.0), point(2, 1300.0, comm_s=0.38)],
    })  # fmt: skip
    study["words"] = ["2 GPUs give 1.3× (65% of linear)"]
    lines = scaling_table.text_lines(study)
    assert lines.index("2 GPUs give 1.3× (65% of linear)") < min(
        i for i, x in enumerate(lines) if x.startswith("note:")
    )
