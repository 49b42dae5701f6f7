"""Keep only the part of Qt for Python that Rigpilot runs: the rest is weight and unpatched code.

The PySide6-Essentials wheel carries some 60 Qt modules, Qt Quick and QML, Designer, Linguist and
Assistant, SQL drivers, and image plugins with their own copies of libjpeg, libtiff and libwebp that
Debian's security updates never reach. The app (app/) imports QtCore, QtGui and QtWidgets only, and
pyqtgraph adds QtOpenGL (imported when its curves load) and QtSvg (its SVG exporter). This keeps:

- those modules and the Qt libraries they load (followed through DT_NEEDED, so nothing they need
  can be left out by a list that drifts);
- the plugins the app loads at run time: the X11 (xcb), Wayland and offscreen platforms with their
  GL, shell and decoration plugins, GTK's and the desktop portal's themes (file dialogs), compose and
  IBus input, and SVG icons and images for icon themes (PNG, BMP, XPM are built into QtGui);
- PySide6's own Python files;

and removes everything else from the install before it is packaged, rewriting the RECORD so the
metadata still describes the files as installed. It is an allow-list: a module a newer wheel adds
stays out until someone decides the app needs it. tests/packaging/test_packaging.py checks that app/ imports
nothing beyond MODULES, and the installed package's self-test renders every page with what is left.
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import elf

MODULES = ("QtCore", "QtGui", "QtWidgets", "QtOpenGL", "QtOpenGLWidgets", "QtSvg")
# plugin folder -> the file names kept there (fnmatch patterns)
PLUGINS: dict[str, tuple[str, ...]] = {
    "platforms": ("libqxcb.so", "libqwayland.so", "libqoffscreen.so", "libqminimal.so"),
    "xcbglintegrations": ("*",),
    "wayland-graphics-integration-client": ("*",),
    "wayland-shell-integration": ("*",),
    "wayland-decoration-client": ("*",),
    "platformthemes": ("*",),
    "platforminputcontexts": ("libcomposeplatforminputcontextplugin.so", "libibusplatforminputcontextplugin.so"),
    "iconengines": ("libqsvgicon.so",),
    "imageformats": ("libqsvg.so",),
}
# PySide6's own Python files (the package's __init__ and configuration, the signature support).
PYTHON_FILES = ("__init__.py", "_config.py", "_git_pyside_version.py", "py.typed", "support/*.py")


def _kept_files(pyside: Path) -> set[Path]:
    """Every file under `pyside` (an installed PySide6 folder) that the trimmed package keeps."""
    qt_lib = pyside / "Qt" / "lib"
    keep: set[Path] = set()
    for pattern in PYTHON_FILES:
        keep.update(p for p in pyside.glob(pattern) if p.is_file())
    roots = [pyside / f"{m}.abi3.so" for m in MODULES]
    for folder, names in PLUGINS.items():
        for p in sorted((pyside / "Qt" / "plugins" / folder).glob("*")):
            if any(fnmatch.fnmatchcase(p.name, n) for n in names):
                roots.append(p)
    missing = [r for r in roots if not r.is_file()]
    if missing:
        raise SystemExit(f"qt_trim: the PySide6 wheel lacks {', '.join(str(m.relative_to(pyside)) for m in missing)}")
    # What the kept binaries load from the wheel itself: Qt/lib, and PySide6's own libpyside beside the modules.
    local = {p.name: p for p in [*qt_lib.glob("*.so*"), *pyside.glob("libpyside6*.so*")]}
    todo = list(roots)
    while todo:
        binary = todo.pop()
        if binary in keep:
            continue
        keep.add(binary)
        for name in elf.needed(binary):
            if name in local:
                todo.append(local[name])
            elif name.startswith(("libQt6", "libicu", "libpyside6")):
                raise SystemExit(f"qt_trim: {binary.relative_to(pyside)} needs {name}, which the wheel does not have")
    return keep


def trim(target: Path) -> list[str]:
    """Remove what the app does not use from the PySide6 installed under `target`; return the removed paths."""
    pyside = target / "PySide6"
    if not pyside.is_dir():
        return []
    keep = _kept_files(pyside)
    removed = []
    for p in sorted(pyside.rglob("*"), reverse=True):  # files before their folders
        if p.is_symlink() or p.is_file():
            if p not in keep:
                removed.append(p.relative_to(target).as_posix())
                p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()
    # The wheel's RECORD still lists them: bundle.tidy drops the rows of files that are gone.
    for cache in pyside.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    return removed
