import json

import pytest

import rigpilot.engine.hardware.nvml_backend as nvml_backend
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.discovery import StaticBackend, open_backend
from rigpilot.engine.hardware.machine import Source
from rigpilot.engine.hardware.telemetry import Tier
from rigpilot.engine.settings import Settings


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("RIGPILOT_SIMULATE", raising=False)
    return tmp_path


@pytest.fixture
def no_driver(monkeypatch):
    class NoDriver:
        def __init__(self, *a, **k):
            raise nvml_backend.NvmlUnavailable(
                "NVIDIA driver not loaded (NVML: Driver Not Loaded)", nvml_backend.NvmlFailure.DRIVER_NOT_LOADED
            )

    monkeypatch.setattr(nvml_backend, "NvmlBackend", NoDriver)


def test_without_a_driver_the_settings_profile_stands_in_and_says_why(no_driver):
    d = open_backend()
    assert d.machine.source is Source.SIMULATED and d.machine.profile == "4x-rtx4090"
    assert d.notes == [
        "The NVIDIA driver is installed but not loaded, so Rigpilot shows a simulated machine, "
        "chosen in Settings (rigpilot settings)."
    ]
    assert "Driver Not Loaded" in d.details[0]  # the driver's own words stay, for a tooltip and the log


def replayed_nvml(monkeypatch, machine, init_error=None):
    """open_backend's NVML is the real backend over a replayed NVML that fails to start with `init_error`."""
    import copy

    from rigpilot.engine.hardware.nvml_replay import FakeNvml

    fake = FakeNvml(machine)
    fake.fail_init(init_error)
    real = nvml_backend.NvmlBackend
    monkeypatch.setattr(nvml_backend, "NvmlBackend", lambda: real(fake, host_reader=lambda: copy.deepcopy(machine.host)))


@pytest.mark.parametrize(
    ("error", "plain"),
    [
        ("NVML_ERROR_NO_PERMISSION", "Your user may not use the NVIDIA driver"),
        ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", "The NVIDIA driver was updated and needs a reboot"),
        ("NVML_ERROR_LIBRARY_NOT_FOUND", "No NVIDIA driver found (libnvidia-ml.so.1 is missing)"),
        ("NVML_ERROR_UNKNOWN", "Rigpilot could not use the NVIDIA driver"),
    ],
)
def test_each_nvml_failure_kind_is_said_in_its_plain_words(monkeypatch, error, plain):
    import pynvml

    from rigpilot.engine.hardware.simulated import load_profile

    replayed_nvml(monkeypatch, load_profile("4x-rtx4090"), getattr(pynvml, error))
    d = open_backend()
    assert d.machine.simulated and d.notes == [
        f"{plain}, so Rigpilot shows a simulated machine, chosen in Settings (rigpilot settings)."
    ]
    assert d.details[0].startswith("NVIDIA GPUs not used: ") and "(NVML: " in d.details[0]


def test_a_driver_with_no_gpu_is_said_so(monkeypatch):
    from rigpilot.engine.hardware.machine import Host, Machine

    replayed_nvml(monkeypatch, Machine(source=Source.NVML, host=Host(driver_version="550.54"), gpus=[], pairs=[]))
    d = open_backend()
    assert d.machine.simulated and d.notes[0].startswith("The NVIDIA driver found no GPU, so Rigpilot shows")


def test_the_plain_words_come_from_the_kind_not_the_message(monkeypatch):
    class Reworded:
        def __init__(self, *a, **k):
            raise nvml_backend.NvmlUnavailable("whatever a later version says", nvml_backend.NvmlFailure.NO_PERMISSION)

    monkeypatch.setattr(nvml_backend, "NvmlBackend", Reworded)
    assert open_backend().notes[0].startswith("Your user may not use the NVIDIA driver, so")


def test_the_settings_profile_is_honoured(no_driver):
    Settings(simulated_profile="2x-rtx3090-nvlink").save()
    assert open_backend().machine.profile == "2x-rtx3090-nvlink"


def test_a_corrupt_settings_file_is_kept_aside_and_defaults_used(no_driver):
    f = Settings.path()
    f.parent.mkdir(parents=True)
    f.write_text("{not json")
    d = open_backend()
    assert d.machine.profile == "4x-rtx4090"
    assert any("unreadable" in n for n in d.notes)
    assert f.with_suffix(".json.bad").read_text() == "{not json"
    assert not f.exists()


def test_settings_round_trip_and_ignore_unknown_keys():
    f = Settings.path()
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps({"simulated_profile": "8x-h100-sxm", "from_the_future": 1}))
    assert Settings.load().simulated_profile == "8x-h100-sxm"


def test_environment_forces_simulation(monkeypatch):
    monkeypatch.setenv("RIGPILOT_SIMULATE", "8x-h100-sxm")
    d = open_backend()
    assert d.machine.profile == "8x-h100-sxm" and d.notes == []


def test_simulate_and_import_are_exclusive():
    with pytest.raises(UserError, match="cannot be used together"):
        open_backend(simulate="1x-rtx4090", import_paths=["x"])


def test_imported_machines_have_no_live_telemetry(smi_data):
    d = open_backend(import_paths=[smi_data / "case08_4xRTX6000Ada_dual_socket_genoa_4nics.txt"])
    assert isinstance(d.backend, StaticBackend)
    assert d.machine.source is Source.IMPORTED
    s = d.backend.sample_gpus(Tier.SLOW)
    assert len(s) == 4
    assert s[0].gpu_util is None and s[0].unavailable["gpu_util"] == StaticBackend.REASON


def test_unreadable_import_is_a_user_error(tmp_path):
    bad = tmp_path / "garbage.txt"
    bad.write_bytes(b"\x00\xff\xfe garbage")
    with pytest.raises(UserError):
        open_backend(import_paths=[bad])
