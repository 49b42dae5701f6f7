"""The Linux installer: the .deb builds, installs, starts, and leaves nothing behind.

Building and checking the package's contents runs wherever dpkg-deb exists.
Installing it changes the machine (/opt, /usr/share), so that part runs only as
root and where CI=true or RIGPILOT_TEST_INSTALL=1 says this machine may be
changed: CI always does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
APP_ID = "io.rigpilot.Rigpilot"
INSTALLED = [
    "/usr/bin/rigpilot",
    f"/usr/share/applications/{APP_ID}.desktop",
    f"/usr/share/metainfo/{APP_ID}.metainfo.xml",
    f"/usr/share/icons/hicolor/scalable/apps/{APP_ID}.svg",
    *(f"/usr/share/icons/hicolor/{s}x{s}/apps/{APP_ID}.png" for s in (16, 24, 32, 48, 64, 128, 256, 512)),
]

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def deb(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = run([sys.executable, str(REPO / "packaging" / "build_deb.py"), "--out", str(out)], timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    debs = list(out.glob("rigpilot_*_amd64.deb"))
    assert len(debs) == 1
    return debs[0]


@pytest.mark.parametrize("tool, args, path", [
    ("desktop-file-validate", [], f"resources/desktop/{APP_ID}.desktop"),
    ("appstreamcli", ["validate", "--no-net"], f"resources/desktop/{APP_ID}.metainfo.xml"),
])
def test_desktop_metadata_validates(tool, args, path):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    r = run([tool, *args, str(REPO / path)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_one_id_everywhere():
    from rigpilot.app.identity import APP_ID as code_id

    desktop = (REPO / f"resources/desktop/{APP_ID}.desktop").read_text()
    metainfo = (REPO / f"resources/desktop/{APP_ID}.metainfo.xml").read_text()
    assert code_id == APP_ID
    assert f"Icon={APP_ID}\n" in desktop and f"StartupWMClass={APP_ID}\n" in desktop
    assert f"<id>{APP_ID}</id>" in metainfo and f'"desktop-id">{APP_ID}.desktop<' in metainfo


@needs_dpkg
@pytest.mark.slow
def test_package_contents_and_metadata(deb):
    info = run(["dpkg-deb", "--field", str(deb), "Package", "Depends", "Architecture"]).stdout
    assert "Package: rigpilot" in info and "python3-venv" in info and "libxcb-cursor0" in info
    files = run(["dpkg-deb", "--contents", str(deb)]).stdout
    for f in INSTALLED:
        assert f".{f}" in files, f
    wheels = [line.split("/")[-1] for line in files.splitlines() if line.endswith(".whl")]
    assert any(w.startswith("rigpilot-") for w in wheels)
    assert any(w.lower().startswith("pyside6_essentials-") for w in wheels)
    assert any(w.startswith("uv-") for w in wheels)
    # PyTorch is provisioned per user, never shipped.
    assert not any(w.startswith("torch-") or (w.startswith("nvidia_") and not w.startswith("nvidia_ml_py")) for w in wheels)
    listing = run(["dpkg-deb", "--info", str(deb)]).stdout
    for script in ("postinst", "prerm", "postrm", "triggers"):
        assert script in listing


def _may_install() -> str | None:
    if os.geteuid() != 0:
        return "installing a package needs root"
    if os.environ.get("CI") != "true" and os.environ.get("RIGPILOT_TEST_INSTALL") != "1":
        return "installs system-wide: runs where CI=true or RIGPILOT_TEST_INSTALL=1"
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    return None


@needs_dpkg
@pytest.mark.slow
@pytest.mark.skipif(_may_install() is not None, reason=str(_may_install()))
def test_install_start_remove_leaves_nothing(deb, tmp_path):
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = run(["apt-get", "install", "-y", "-q", str(deb)], env=env, timeout=900)
    if install.returncode != 0:  # stale package lists on a fresh machine
        run(["apt-get", "update", "-q"], env=env, timeout=900)
        install = run(["apt-get", "install", "-y", "-q", str(deb)], env=env, timeout=900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    try:
        for f in INSTALLED:
            assert Path(f).exists(), f
        assert Path("/opt/rigpilot/venv/bin/python").exists()
        # The wizard's default first job finds the shipped examples.
        probe = "from rigpilot.app.wizard.state import EXAMPLES, examples_present; print(EXAMPLES, examples_present())"
        clean = {**os.environ, "PYTHONPATH": ""}
        r = run(["/opt/rigpilot/venv/bin/python", "-c", probe], cwd=tmp_path, env=clean, timeout=60)
        assert r.stdout.split() == ["/opt/rigpilot/examples", "True"], r.stdout + r.stderr
        r = run(["/usr/bin/rigpilot", "--version"], timeout=60)
        assert r.returncode == 0 and r.stdout.startswith("rigpilot "), r.stderr
        for tool, args, f in [
            ("desktop-file-validate", [], INSTALLED[1]),
            ("appstreamcli", ["validate", "--no-net"], INSTALLED[2]),
        ]:
            if shutil.which(tool):
                v = run([tool, *args, f], timeout=120)
                assert v.returncode == 0, v.stdout + v.stderr

        # The installed app against a CPU engine, in a throw-away home: the same package works without a GPU.
        home = tmp_path / "home"
        user_env = {
            **os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_STATE_HOME": str(home / ".local/state"), "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_RUNTIME_DIR": str(tmp_path / "run"), "QT_QPA_PLATFORM": "offscreen",
            "RIGPILOT_SIMULATE": "4x-rtx4090", "PYTHONPATH": "",
        }
        (tmp_path / "run").mkdir(mode=0o700)
        shot = tmp_path / "selftest.png"
        r = run(["/usr/bin/rigpilot", "--self-test", str(shot)], env=user_env, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "self-test passed" in r.stdout and "simulated: 4×RTX 4090" in r.stdout
        assert shot.stat().st_size > 10_000
        run(["/usr/bin/rigpilot", "engine", "--stop"], env=user_env, timeout=60)
    finally:
        remove = run(["apt-get", "remove", "-y", "-q", "rigpilot"], env=env, timeout=600)
    assert remove.returncode == 0, remove.stdout[-2000:] + remove.stderr[-2000:]
    assert not Path("/opt/rigpilot").exists(), list(Path("/opt/rigpilot").rglob("*"))[:20]
    for f in INSTALLED:
        assert not Path(f).exists(), f
    purge = run(["apt-get", "purge", "-y", "-q", "rigpilot"], env=env, timeout=600)
    assert purge.returncode == 0
