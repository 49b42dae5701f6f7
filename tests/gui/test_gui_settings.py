"""The Settings page: loading, inline validation, saving to QSettings and the engine's settings file."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import QSettings

from rigpilot.app.settings import model
from rigpilot.app.settings.model import (
    KEY_ADDRESS,
    KEY_REFRESH_HZ,
    KEY_TOKEN,
    engine_link_options,
    read_refresh_hz,
    validate_address,
)
from rigpilot.engine.hardware.simulated import list_profiles
from rigpilot.engine.settings import Settings

from support.gui_fakes import focusable_widgets, tab_through
from support.gui_settings import open_page


def test_loads_the_profiles_and_current_values(qtbot):
    Settings(simulated_profile="8x-a100-pcie").save()
    QSettings().setValue(KEY_REFRESH_HZ, 4.0)
    page = open_page(qtbot)
    ids = [page.profile.itemData(i) for i in range(page.profile.count())]
    assert ids == [p["id"] for p in list_profiles()]
    assert page.profile.currentData() == "8x-a100-pcie"
    assert page.refresh_hz.value() == 4.0
    assert page.save_button.isEnabled()
    assert str(Settings.path()) in page.settings_path.text()


def test_saves_valid_values_to_both_stores(qtbot):
    page = open_page(qtbot)
    page.profile.setCurrentIndex(page.profile.findData("2x-rtx3090-nvlink"))
    page.address.setText("workstation.lan:7860")
    page.token.setText("s3cret-token")
    page.refresh_hz.setValue(2.5)
    with qtbot.waitSignal(page.sig_saved, timeout=10000) as saved:
        assert page.save()
    assert saved.args[0]["simulated_profile"] == "2x-rtx3090-nvlink"
    assert Settings.load().simulated_profile == "2x-rtx3090-nvlink"
    s = QSettings()
    assert s.value(KEY_ADDRESS) == "workstation.lan:7860" and s.value(KEY_TOKEN) == "s3cret-token"
    assert read_refresh_hz(s) == 2.5
    assert engine_link_options(s) == {"tcp": "workstation.lan:7860", "token": "s3cret-token"}
    assert "Saved" in page.status.text()


def test_invalid_fields_are_shown_inline_and_nothing_is_saved(qtbot):
    page = open_page(qtbot)
    page.address.setText("workstation.lan:99999")
    page.refresh_hz.setValue(30.0)
    with qtbot.waitSignal(page.sig_invalid) as invalid:
        assert not page.save()
    assert set(invalid.args[0]) == {"engine_address", "engine_token", "refresh_hz"}
    assert page.address_error.isVisible() and "65535" in page.address_error.text()
    assert page.token_error.isVisible() and "token" in page.token_error.text()
    assert page.refresh_error.isVisible()
    assert not Settings.path().exists()
    assert QSettings().value(KEY_ADDRESS) is None
    # Fixing a field clears its message as you type.
    page.address.clear()
    page.address.textEdited.emit("")
    assert not page.address_error.isVisible() and not page.token_error.isVisible()


def test_local_engine_needs_no_token_and_stores_none(qtbot):
    page = open_page(qtbot)
    page.token.setText("left over")
    with qtbot.waitSignal(page.sig_saved, timeout=10000):
        assert page.save()
    assert engine_link_options(QSettings()) == {"tcp": None, "token": None}


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("", True), ("gpu-box:7860", True), ("10.0.0.5:1", True), ("[fe80::1]:7860", True),
        ("gpu-box", False), ("gpu box:7860", False), ("gpu-box:0", False), ("gpu-box:http", False),
        ("[nonsense]:7860", False), ("-bad-.lan:7860", False),
    ],
)  # fmt: skip
def test_address_validation(text, ok):
    assert (validate_address(text) is None) == ok


def test_refresh_rate_is_clamped_when_read():
    s = QSettings()
    s.setValue(KEY_REFRESH_HZ, 100)
    assert read_refresh_hz(s) == 10.0
    s.setValue(KEY_REFRESH_HZ, "garbage")
    assert read_refresh_hz(s) == model.DEFAULT_REFRESH_HZ


def test_cpu_ranks_are_saved_to_the_engine_settings(qtbot):
    page = open_page(qtbot)
    assert page.cpu_ranks.isEnabled() and page.cpu_ranks.value() == Settings().max_cpu_ranks
    page.cpu_ranks.setValue(2)
    with qtbot.waitSignal(page.sig_saved, timeout=10000):
        assert page.save()
    assert json.loads(Settings.path().read_text())["max_cpu_ranks"] == 2
    assert Settings.load().simulated_profile == Settings().simulated_profile  # the other field is kept


def test_more_ranks_than_cpus_is_a_note_not_an_error(qtbot, monkeypatch):
    monkeypatch.setattr(model.os, "cpu_count", lambda: 2)
    page = open_page(qtbot)
    page.cpu_ranks.setValue(8)
    assert "2 logical CPUs" in page.cpu_ranks_note.text()
    assert "max_cpu_ranks" not in page.validate()


def test_unreadable_settings_file_is_reported(qtbot):
    Settings.path().parent.mkdir(parents=True, exist_ok=True)
    Settings.path().write_text("{not json")
    page = open_page(qtbot)
    assert "unreadable" in page.status.text()
    assert page.profile.currentData() == Settings().simulated_profile


def test_tab_reaches_every_control(qtbot):
    page = open_page(qtbot)
    expected = focusable_widgets(page)
    visited = tab_through(page, qtbot)
    assert not [w.objectName() or type(w).__name__ for w in expected if w not in visited]
    names = {w.objectName() for w in visited}
    assert {"simulatedProfile", "engineAddress", "engineToken", "showToken", "refreshHz", "save", "revert"} <= names


def test_the_remote_engines_pinned_certificate_is_shown_for_its_address(qtbot):
    from rigpilot.engine.api import pins

    fingerprint = "SHA256:" + "A" * 43
    pins.remember("workstation.lan:7860", fingerprint)
    page = open_page(qtbot)
    assert page.certificate.text().startswith("none: the engine on this computer")
    page.address.setText("workstation.lan:7860")
    assert page.certificate.text().startswith(fingerprint) and "refused" in page.certificate.text()
    page.address.setText("other.lan:7860")
    assert page.certificate.text().startswith("not pinned yet") and "--fingerprint" in page.certificate.text()
