"""The system libraries Qt needs, declared once (packaging/qt-runtime.toml): `dev.py app` names the missing
ones in one line before it sets anything up, the .deb depends on them, the README lists them, and the list
is what the installed PySide6 really links.

packaging/qt_runtime.py is imported from its path (dev.py runs it on the bare system python3). The
libraries on this machine are all installed, so the missing ones are made by handing the check an
`ldconfig -p` listing without them; tests/packaging/test_first_run_debian12.py does it on a fresh Debian 12.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO

_spec = importlib.util.spec_from_file_location("qt_runtime", REPO / "packaging" / "qt_runtime.py")
qt_runtime = sys.modules["qt_runtime"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qt_runtime)
_spec = importlib.util.spec_from_file_location("rigpilot_packaging_elf", REPO / "packaging" / "elf.py")
elf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(elf)  # the reader the Qt trim follows links with: the two agree by construction

RUNTIME = qt_runtime.load()
CHECKED = [lib for lib in RUNTIME.libraries if lib.needs != qt_runtime.NONE]
DEBIAN = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\nVERSION_ID="12"\nID=debian\n'
ABI = "libc6,x86-64"
ISSUE_THREE = ["libxcb-cursor0", "libxcb-icccm4", "libxcb-keysyms1"]  # what a fresh Debian 12 desktop lacks


def listing(sonames, abi: str = ABI) -> str:
    """`ldconfig -p` output with these libraries in /usr/lib/x86_64-linux-gnu."""
    lines = [f"\t{s} ({abi}) => /usr/lib/x86_64-linux-gnu/{s}" for s in sonames]
    return f"{len(lines)} libs found in cache `/etc/ld.so.cache'\n" + "\n".join(lines) + "\n"


def everything() -> set[str]:
    return {s for lib in RUNTIME.libraries for s in lib.sonames} | RUNTIME.base


def without(*debian: str) -> set[str]:
    return everything() - {s for lib in RUNTIME.libraries if lib.apt_name in debian for s in lib.sonames}


def problem(env: dict[str, str], sonames: set[str], os_release: str = DEBIAN, root: bool = False) -> str | None:
    return qt_runtime.problem(RUNTIME, env, sonames, os_release, root)


# -- the line ---------------------------------------------------------------------------------------------------


def test_the_three_libraries_of_a_fresh_debian12_are_named_in_one_apt_line():
    line = problem({"DISPLAY": ":0"}, without(*ISSUE_THREE))
    assert line is not None and "\n" not in line
    assert f"sudo apt install {' '.join(ISSUE_THREE)};" in line
    assert "X11" in line and "python3 dev.py app again" in line and f"{qt_runtime.SKIP}=1" in line


def test_every_missing_library_of_the_display_is_named_and_nothing_else():
    missing = ["libfontconfig1", "libxcb-cursor0", "libwayland-client0", "libxcb-util1"]
    line = problem({"DISPLAY": ":0"}, without(*missing))
    # Qt's Gui libraries and the xcb plugin's, in the file's order; Wayland's are not needed on X11.
    assert "sudo apt install libfontconfig1 libxcb-cursor0 libxcb-util1;" in line


def test_nothing_missing_is_no_line():
    assert problem({"DISPLAY": ":0"}, everything()) is None
    assert problem({"DISPLAY": ":0"}, without("libopengl0", "libxcb-xinerama0", "libxi6")) is None  # nothing links them


def test_a_library_of_the_other_kind_does_not_count():
    """A 64-bit system with 32-bit X libraries (multiarch): only the libraries of python3's own kind count."""
    maps = "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    text = (
        listing(sorted(without("libxcb-cursor0")))
        + "\tlibxcb-cursor.so.0 (libc6) => /usr/lib/i386-linux-gnu/libxcb-cursor.so.0\n"
    )
    text += "\tlibc.so.6 (libc6) => /usr/lib/i386-linux-gnu/libc.so.6\n"
    abi = qt_runtime.own_abi(text, maps)
    assert abi == ABI
    assert "libxcb-cursor.so.0" not in qt_runtime.cached_sonames(text, abi)
    assert "libxcb-cursor.so.0" in qt_runtime.cached_sonames(text, None)  # libc not found in the cache: all count
    assert "apt install libxcb-cursor0;" in problem({"DISPLAY": ":0"}, qt_runtime.cached_sonames(text, abi))


def test_an_ldconfig_that_labels_libc_with_its_os_abi_still_counts_every_library():
    """Older ldconfigs (Ubuntu 22.04, RHEL 9) print "(libc6,x86-64, OS ABI: Linux 3.2.0)" for libc only."""
    maps = "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    text = listing(sorted(without())).replace("libc.so.6 (libc6,x86-64)", "libc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0)")
    text += "\tlibxcb-shm.so.0 (libc6,x86-64, hwcap: 0x0000000000000001) => /usr/lib/x86_64-linux-gnu/libxcb-shm.so.0\n"
    abi = qt_runtime.own_abi(text, maps)
    assert abi == ABI
    assert qt_runtime.cached_sonames(text, abi) == without() | {"libxcb-shm.so.0"}
    assert problem({"DISPLAY": ":0"}, qt_runtime.cached_sonames(text, abi)) is None


def test_qt_tries_wayland_first_where_the_session_is_wayland():
    assert qt_runtime.plugins({}) == ["xcb"]
    assert qt_runtime.plugins({"DISPLAY": ":0"}) == ["xcb"]
    assert qt_runtime.plugins({"WAYLAND_DISPLAY": "wayland-0", "DISPLAY": ":0"}) == ["wayland", "xcb"]
    assert qt_runtime.plugins({"XDG_SESSION_TYPE": "wayland"}) == ["wayland", "xcb"]
    assert qt_runtime.plugins({"QT_QPA_PLATFORM": "wayland-egl;xcb:nograb", "DISPLAY": ":0"}) == ["wayland-egl", "xcb"]


def test_a_wayland_session_needs_no_x11_libraries():
    wayland = {"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "wayland"}
    assert problem(wayland, without(*ISSUE_THREE, "libxcb1", "libx11-xcb1")) is None
    line = problem(wayland, without("libwayland-cursor0", *ISSUE_THREE))
    assert "Wayland" in line and "sudo apt install libwayland-cursor0;" in line


def test_with_xwayland_either_plugin_will_do_and_the_first_one_is_named():
    both = {"WAYLAND_DISPLAY": "wayland-0", "DISPLAY": ":0"}
    assert problem(both, without("libwayland-client0")) is None  # Qt falls back to xcb, whose libraries are there
    assert problem(both, without(*ISSUE_THREE)) is None  # wayland's are there
    line = problem(both, without("libwayland-client0", *ISSUE_THREE))
    assert "Wayland" in line and "sudo apt install libwayland-client0;" in line


def test_offscreen_needs_only_qts_own_libraries():
    offscreen = {"QT_QPA_PLATFORM": "offscreen"}
    assert problem(offscreen, without(*ISSUE_THREE, "libwayland-client0")) is None
    line = problem(offscreen, without("libfontconfig1", "libxcb-cursor0"))
    assert "Qt's offscreen platform" in line and "sudo apt install libfontconfig1;" in line


@pytest.mark.parametrize("env", [{}, {"XDG_SESSION_TYPE": "tty"}, {"QT_QPA_PLATFORM": "xcb"},
                                 {"QT_QPA_PLATFORM": "wayland", "DISPLAY": ":0"}])  # fmt: skip
def test_no_display_is_one_line_too(env):
    line = problem(env, without(*ISSUE_THREE))
    assert line.startswith("dev.py app: no display found") and "\n" not in line
    assert "dev.py setup" in line and "rigpilot watch" in line


@pytest.mark.parametrize(("os_release", "command"), [
    (DEBIAN, "sudo apt install libxcb-cursor0 libxcb-icccm4"),
    ('NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n', "sudo apt install libxcb-cursor0 libxcb-icccm4"),
    ('NAME="Linux Mint"\nID=linuxmint\nID_LIKE="ubuntu debian"\n', "sudo apt install libxcb-cursor0 libxcb-icccm4"),
    ('NAME="Fedora Linux"\nID=fedora\n', "sudo dnf install xcb-util-cursor xcb-util-wm"),
    ('NAME="Rocky Linux"\nID="rocky"\nID_LIKE="rhel centos fedora"\n', "sudo dnf install xcb-util-cursor xcb-util-wm"),
    ('NAME="Arch Linux"\nID=arch\n', "sudo pacman -S --needed xcb-util-cursor xcb-util-wm"),
    ('NAME="Manjaro Linux"\nID=manjaro\nID_LIKE=arch\n', "sudo pacman -S --needed xcb-util-cursor xcb-util-wm"),
    ('NAME="openSUSE Tumbleweed"\nID="opensuse-tumbleweed"\nID_LIKE="opensuse suse"\n',
     "libxcb-cursor.so.0, libxcb-icccm.so.4 (install them with your distribution's package manager)"),
    ("", "libxcb-cursor.so.0, libxcb-icccm.so.4 (install them with your distribution's package manager)"),
])  # fmt: skip
def test_the_command_is_the_distributions_own(os_release, command):
    line = problem({"DISPLAY": ":0"}, without("libxcb-cursor0", "libxcb-icccm4"), os_release)
    assert f": {command}; then" in line, line


def test_root_is_not_told_to_sudo():
    line = problem({"DISPLAY": ":0"}, without("libxcb-cursor0"), root=True)
    assert ": apt install libxcb-cursor0; then" in line


def test_one_fedora_package_for_many_debian_ones_is_named_once():
    line = problem({"DISPLAY": ":0"}, without("libxcb-randr0", "libxcb-shape0", "libxcb-xkb1"), "ID=fedora\n")
    assert ": sudo dnf install libxcb; then" in line


def test_skipped_only_when_asked(monkeypatch):
    monkeypatch.setattr(qt_runtime, "installed_sonames", lambda env: set())
    assert qt_runtime.check({qt_runtime.SKIP: "1"}) is None
    assert qt_runtime.check({qt_runtime.SKIP: "1", "DISPLAY": ":0"}) is None
    assert qt_runtime.check({qt_runtime.SKIP: "0", "DISPLAY": ":0"}) is not None
    assert qt_runtime.check({"DISPLAY": ":0"}) is not None


# -- finding what is installed -----------------------------------------------------------------------------------


def test_without_ldconfig_the_standard_folders_and_ld_library_path_are_searched(tmp_path, monkeypatch):
    lib, extra = tmp_path / "lib", tmp_path / "extra"
    lib.mkdir()
    extra.mkdir()
    (lib / "libxcb-cursor.so.0").symlink_to("libxcb-cursor.so.0.0.0")
    (lib / "libxcb-cursor.so.0.0.0").write_bytes(b"")
    (extra / "libxcb-icccm.so.4").write_bytes(b"")
    monkeypatch.setattr(qt_runtime.shutil, "which", lambda name: None)
    monkeypatch.setattr(qt_runtime, "LDCONFIG_PATHS", ())
    monkeypatch.setattr(qt_runtime, "library_dirs", lambda: [lib, tmp_path / "absent"])
    found = qt_runtime.installed_sonames({"LD_LIBRARY_PATH": f"{extra}::/nonexistent"})
    assert {"libxcb-cursor.so.0", "libxcb-icccm.so.4"} <= found


def test_ld_library_path_counts_beside_the_cache(tmp_path):
    if not shutil.which("ldconfig") and not any(os.access(p, os.X_OK) for p in qt_runtime.LDCONFIG_PATHS):
        pytest.skip("no ldconfig here")
    (tmp_path / "libnot-in-any-cache.so.7").write_bytes(b"")
    found = qt_runtime.installed_sonames({"LD_LIBRARY_PATH": str(tmp_path)})
    assert "libnot-in-any-cache.so.7" in found and "libc.so.6" in found


def test_the_real_ldconfig_listing_is_read():
    ldconfig = shutil.which("ldconfig") or next((p for p in qt_runtime.LDCONFIG_PATHS if os.access(p, os.X_OK)), None)
    if ldconfig is None:
        pytest.skip("no ldconfig here")
    text = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
    abi = qt_runtime.own_abi(text, Path("/proc/self/maps").read_text())
    assert abi is not None and abi.startswith("libc6")
    assert "libc.so.6" in qt_runtime.cached_sonames(text, abi)


# -- one list: the .deb, the README, and what PySide6 links ------------------------------------------------------


def test_the_debs_depends_are_the_file():
    sys.path.insert(0, str(REPO / "packaging"))
    try:
        import build_deb
    finally:
        sys.path.remove(str(REPO / "packaging"))
    assert build_deb.QT_RUNTIME == RUNTIME.debian_depends()
    assert "libglib2.0-0t64 | libglib2.0-0" in build_deb.QT_RUNTIME and "libxcb-cursor0" in build_deb.QT_RUNTIME


def test_every_library_dev_py_asks_for_has_its_fedora_and_arch_name():
    for lib in RUNTIME.libraries:
        assert lib.needs in (qt_runtime.GUI, qt_runtime.XCB, qt_runtime.WAYLAND, qt_runtime.NONE), lib
        assert lib.sonames and all(re.fullmatch(r"[\w+.-]+\.so\.[\d.]+", s) for s in lib.sonames), lib
        if lib.needs != qt_runtime.NONE:
            assert lib.fedora and lib.arch, lib
    assert len({lib.apt_name for lib in RUNTIME.libraries}) == len(RUNTIME.libraries)


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## From source", 1)[1].split("\n## ", 1)[0]
    joined = re.sub(r"\s*\\\n\s*", " ", section)
    return [line.strip() for line in joined.splitlines() if line.startswith("sudo ")]


def test_the_readme_lists_every_library_for_each_distribution():
    expected = [qt_runtime.install_hint(CHECKED, family, root=False) for family in ("debian", "fedora", "arch")]
    assert _readme_commands() == expected, "README.md's From source section should say:\n" + "\n".join(expected)


def _pyside() -> Path:
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("PySide6 is not installed")
    return Path(spec.submodule_search_locations[0])


def _system_libraries(starts: list[Path], bundled: list[Path]) -> set[str]:
    """The sonames the system must provide for `starts`: what they and the libraries PySide6 bundles that they
    load link by name, less those bundled."""
    system, seen, todo = set(), set(), list(starts)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in elf.needed(path):
            inside = next((d / name for d in bundled if (d / name).exists()), None)
            if inside is None:
                system.add(name)
            else:
                todo.append(inside)
    return system


def test_the_list_is_what_the_installed_pyside6_links():
    """The platform plugins of the PySide6 in this environment, with the Qt libraries they load: every system
    library they link is in the file under their kind (or a base one every system has), and every library in
    the file that dev.py asks for is linked by its kind. Bumping PySide6 cannot leave the list behind."""
    pyside = _pyside()
    qt = pyside / "Qt"
    plugins = qt / "plugins"
    bundled = [qt / "lib", pyside, pyside.parent / "shiboken6"]
    modules = [pyside / f"{m}.abi3.so" for m in ("QtCore", "QtGui", "QtWidgets")]  # what app/ imports
    starts = {
        qt_runtime.GUI: [
            *modules,
            plugins / "platforms/libqoffscreen.so",
            *(plugins / f"platforminputcontexts/lib{m}platforminputcontextplugin.so" for m in ("compose", "ibus")),
        ],
        qt_runtime.XCB: [plugins / "platforms/libqxcb.so"],
        qt_runtime.WAYLAND: [
            plugins / "platforms/libqwayland.so",
            plugins / "wayland-shell-integration/libxdg-shell.so",
        ],
    }
    for paths in starts.values():
        for p in paths:
            assert p.exists(), p
    linked = {kind: _system_libraries(paths, bundled) for kind, paths in starts.items()}
    assert "libxcb-cursor.so.0" in linked[qt_runtime.XCB] and "libQt6XcbQpa.so.6" not in linked[qt_runtime.XCB]

    declared: dict[str, set[str]] = {}
    for lib in RUNTIME.libraries:
        declared.setdefault(lib.needs, set()).update(lib.sonames)
    for kind in (qt_runtime.GUI, qt_runtime.XCB, qt_runtime.WAYLAND):
        allowed = declared[qt_runtime.GUI] | declared[kind] | RUNTIME.base
        assert linked[kind] <= allowed, f"{kind} links {sorted(linked[kind] - allowed)}: name them in qt-runtime.toml"
    assert declared[qt_runtime.GUI] <= linked[qt_runtime.GUI]
    for kind in (qt_runtime.XCB, qt_runtime.WAYLAND):
        # Linked by that plugin, and not already by Qt's Gui (then it is a "gui" library, needed on every display).
        assert declared[kind] <= linked[kind] - linked[qt_runtime.GUI], kind
    anywhere = set().union(*linked.values())
    assert not declared[qt_runtime.NONE] & anywhere, "linked after all: say by which kind in qt-runtime.toml"


# -- dev.py app, for real, on this machine ----------------------------------------------------------------------


def _dev_app(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM",
                                                                "XDG_SESSION_TYPE", qt_runtime.SKIP)}  # fmt: skip
    full = {**base, "RIGPILOT_VENV": str(tmp_path / "venv"), **env}
    return subprocess.run([sys.executable, str(REPO / "dev.py"), "app"], capture_output=True, text=True, env=full,
                          timeout=60)  # fmt: skip


def test_dev_py_app_names_the_missing_libraries_before_it_sets_anything_up(tmp_path):
    """dev.py app with an ldconfig that lacks the three libraries: one line, exit 2, no virtual environment."""
    ldconfig = shutil.which("ldconfig") or next((p for p in qt_runtime.LDCONFIG_PATHS if os.access(p, os.X_OK)), None)
    if ldconfig is None:
        pytest.skip("no ldconfig here")
    real = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
    gone = ("libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxcb-keysyms.so.1")
    # This machine's own libc lines (dev.py tells its kind of library by them), then every library the check
    # asks for but the three: a machine that lacks others too (headless, Wayland only) gets the same answer.
    libc = [line for line in real.splitlines() if line.split(" ", 1)[0].strip() == "libc.so.6"]
    label = libc[0].split("(", 1)[1].split(")", 1)[0] if libc else "libc6,x86-64"
    others = [f"\t{s} ({label}) => /usr/lib/{s}" for s in sorted(everything() - set(gone) - {"libc.so.6"})]
    (tmp_path / "listing").write_text("\n".join(["1 libs found in cache", *libc, *others]) + "\n")
    fake = tmp_path / "bin" / "ldconfig"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nexec cat {tmp_path / 'listing'}\n")
    fake.chmod(0o755)
    path = f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"

    r = _dev_app(tmp_path, {"DISPLAY": ":0", "PATH": path})
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    family = qt_runtime.distribution_family(qt_runtime.read_os_release())
    missing = [lib for lib in CHECKED if set(lib.sonames) & set(gone)]
    assert qt_runtime.install_hint(missing, family, os.geteuid() == 0) + "; then" in r.stderr, r.stderr
    assert not (tmp_path / "venv").exists()

    # Skipped, the set-up starts at once: here it fails making the environment under a file, so nothing is made.
    (tmp_path / "a-file").write_text("")
    skipped = _dev_app(tmp_path, {"DISPLAY": ":0", "PATH": path, qt_runtime.SKIP: "1",
                                  "RIGPILOT_VENV": str(tmp_path / "a-file" / "venv")})  # fmt: skip
    assert skipped.returncode == 1 and "needs system libraries" not in skipped.stderr, skipped.stderr
    assert "Set-up failed at: create the virtual environment" in skipped.stderr


def test_dev_py_app_without_a_display_says_so_before_setting_up(tmp_path):
    r = _dev_app(tmp_path, {})
    assert r.returncode == 2 and r.stderr.startswith("dev.py app: no display found"), r.stderr
    assert len(r.stderr.splitlines()) == 1 and not (tmp_path / "venv").exists()


def test_dev_py_help_tells_of_the_check():
    r = subprocess.run([sys.executable, str(REPO / "dev.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert qt_runtime.SKIP in r.stdout and "qt-runtime.toml" in r.stdout
