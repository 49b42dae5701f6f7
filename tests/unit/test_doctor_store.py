"""The stored machine check as every submission and plan reads it: found, re-read when a new check replaces it,
and "unreadable" (not a stale copy) once the file is damaged."""

import json

from rigpilot.engine.hardware.doctor import store_key
from rigpilot.engine.hardware.doctor_host import identity
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs import doctor_store
from rigpilot.engine.paths import write_private

from support.doctor_reports import four_gpu_report


def test_latest_follows_the_stored_file(tmp_path):
    machine = load_profile("4x-rtx4090")
    assert doctor_store.latest(machine, tmp_path) == (None, doctor_store.NEVER)
    path = tmp_path / store_key(*identity(machine))
    first = four_gpu_report(measured_at="2026-11-29T04:00:00Z").to_dict()
    write_private(path, json.dumps(first))
    assert doctor_store.latest(machine, tmp_path)[0]["measured_at"] == "2026-11-29T04:00:00Z"
    second = four_gpu_report(measured_at="2026-11-29T05:00:00Z", corrupt=()).to_dict()
    write_private(path, json.dumps(second, indent=2))
    assert doctor_store.latest(machine, tmp_path)[0]["measured_at"] == "2026-11-29T05:00:00Z"
    path.write_text("{ damaged")
    assert doctor_store.latest(machine, tmp_path) == (None, doctor_store.UNREADABLE)
    path.unlink()
    assert doctor_store.latest(machine, tmp_path) == (None, doctor_store.NEVER)
