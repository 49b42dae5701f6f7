"""The app's interface icons (Lucide, in resources/ui-icons) ship with their license: in the wheel's package data and
in the .deb's machine-readable copyright file, the ones Lucide took from Feather under both licenses."""

from __future__ import annotations

import fnmatch
import importlib.util
import sys
import tomllib

from support.paths import REPO

ICONS = REPO / "resources" / "ui-icons"


def _debcopyright():
    spec = importlib.util.spec_from_file_location("debcopyright", REPO / "packaging" / "debcopyright.py")
    module = sys.modules["debcopyright"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_icon_file_and_the_license_are_package_data():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["rigpilot.resources"]
    for path in ICONS.iterdir():
        rel = path.relative_to(REPO / "resources").as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel


def test_the_copyright_file_names_the_icons_license_with_its_text():
    paragraphs = _debcopyright().icon_paragraphs("opt/rigpilot/lib")
    assert len(paragraphs) == 2
    lucide, feather = paragraphs
    assert lucide.startswith("Files: opt/rigpilot/lib/*/rigpilot/resources/ui-icons/*\n")
    assert "\nLicense: ISC\n" in lucide and "Lucide Icons and Contributors" in lucide
    assert "Permission to use, copy, modify, and/or distribute this software" in lucide
    # Later paragraphs win in DEP-5: the Feather-derived files are named one by one, under both licenses.
    assert "ui-icons/trash-2.svg" in feather and "ui-icons/rocket.svg" not in feather
    assert "\nLicense: ISC and Expat\n" in feather and "Cole Bemis" in feather
    assert "Permission is hereby granted, free of charge" in feather
