#!/usr/bin/env python3
"""Build the Rigpilot Debian package from a clean checkout.

    python3 packaging/build_deb.py            # -> dist/rigpilot_<version>_amd64.deb

Needs python3 with pip, and dpkg-deb. The package carries Rigpilot and its
light dependencies (Qt, NVML binding, psutil, huggingface_hub, uv) as wheels;
its postinst builds /opt/rigpilot/venv from them on the system Python, offline.
PyTorch is not in the package: each user's engine environment gets the build
that matches their driver on first run (engine/runtime.py).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP_ID = "io.rigpilot.Rigpilot"
PREFIX = "/opt/rigpilot"
ICON_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)

# What the bundled Qt (PySide6 wheels) loads from the system on Debian 12 for X11, Wayland and offscreen.
QT_RUNTIME = [
    "libegl1", "libgl1", "libopengl0", "libxkbcommon0", "libxkbcommon-x11-0", "libfontconfig1", "libfreetype6",
    "libdbus-1-3", "libglib2.0-0", "libx11-xcb1", "libxcb-cursor0", "libxcb-icccm4", "libxcb-image0",
    "libxcb-keysyms1", "libxcb-randr0", "libxcb-render-util0", "libxcb-shape0", "libxcb-xinerama0",
    "libxcb-xkb1", "libxrender1", "libxi6", "libsm6", "libice6", "libwayland-client0", "libwayland-cursor0",
]

POSTINST = f"""\
#!/bin/sh
set -e
case "$1" in
  configure)
    # The virtual environment is built here, on the target's own Python, from the shipped wheels:
    # no network, and no interpreter paths baked in at build time.
    rm -rf {PREFIX}/venv
    /usr/bin/python3 -m venv {PREFIX}/venv
    {PREFIX}/venv/bin/python -m pip install --quiet --no-index --no-cache-dir --disable-pip-version-check \\
        --find-links {PREFIX}/wheels rigpilot
    ;;
esac
exit 0
"""

PRERM = f"""\
#!/bin/sh
set -e
case "$1" in
  remove|upgrade|deconfigure|failed-upgrade)
    # dpkg does not know the files pip wrote; remove them so nothing is left in {PREFIX}.
    rm -rf {PREFIX}/venv
    find {PREFIX} -name __pycache__ -type d -prune -exec rm -rf {{}} + 2>/dev/null || true
    ;;
esac
exit 0
"""

POSTRM = f"""\
#!/bin/sh
set -e
case "$1" in
  remove)
    rm -rf {PREFIX}/venv
    rmdir --ignore-fail-on-non-empty {PREFIX} 2>/dev/null || true
    ;;
  purge)
    rm -rf {PREFIX}
    # Purge also removes every user's Rigpilot data (see /usr/share/doc/rigpilot/README.Debian):
    # settings, job records, logs, checkpoints, telemetry history and the PyTorch engine environment.
    getent passwd | while IFS=: read -r name _ uid _ _ home _; do
      [ -d "$home" ] || continue
      for d in .config/rigpilot .local/state/rigpilot .local/share/rigpilot .cache/rigpilot; do
        if [ -e "$home/$d" ]; then
          echo "rigpilot: removing $home/$d"
          rm -rf "$home/$d"
        fi
      done
    done
    ;;
esac
exit 0
"""

# Activating the folders' file triggers makes desktop-file-utils and the icon theme caches refresh
# right after install and removal, even where a package that watches them was installed later.
TRIGGERS = """\
activate-noawait /usr/share/applications
activate-noawait /usr/share/icons/hicolor
"""

README_DEBIAN = """\
Rigpilot for Debian
===================

The app lives in /opt/rigpilot: the shipped wheels and a virtual environment built
from them on install. /usr/bin/rigpilot starts it.

PyTorch is not part of this package. The first time a job needs it, Rigpilot
installs a per-user engine environment into ~/.local/share/rigpilot/engine-env
with uv, choosing the PyTorch build for the installed NVIDIA driver. Repair or
reinstall it with `rigpilot engine-env repair`, or from Settings in the app.

Removing the package (apt remove rigpilot) keeps each user's data.

Purging it (apt purge rigpilot) removes, for every user on the machine:
  ~/.config/rigpilot          settings
  ~/.local/state/rigpilot     job records, logs, metrics, checkpoints, telemetry history
  ~/.local/share/rigpilot     the PyTorch engine environment and trained models saved there
  ~/.cache/rigpilot           caches
Copy anything you want to keep (e.g. trained models under the job folders) first.
"""


def version() -> str:
    text = (ROOT / "engine" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    dst.chmod(0o644)


def build(out_dir: Path, python: str) -> Path:
    v = version()
    stage = ROOT / "build" / "deb" / f"rigpilot_{v}_amd64"
    shutil.rmtree(stage, ignore_errors=True)
    wheels = stage / PREFIX.lstrip("/") / "wheels"
    wheels.mkdir(parents=True)

    run([python, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(ROOT)])
    own = next(wheels.glob("rigpilot-*.whl"))
    # The target is Debian 12's Python 3.11 on x86-64; take binary wheels only, so nothing compiles there.
    run([python, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", "3.11",
         "-d", str(wheels), str(own)])

    write(stage / "usr/bin/rigpilot", f'#!/bin/sh\nexec {PREFIX}/venv/bin/rigpilot "$@"\n', 0o755)
    res = ROOT / "resources"
    copy(res / "desktop" / f"{APP_ID}.desktop", stage / f"usr/share/applications/{APP_ID}.desktop")
    copy(res / "desktop" / f"{APP_ID}.metainfo.xml", stage / f"usr/share/metainfo/{APP_ID}.metainfo.xml")
    copy(res / "icons" / f"{APP_ID}.svg", stage / f"usr/share/icons/hicolor/scalable/apps/{APP_ID}.svg")
    for size in ICON_SIZES:
        copy(res / "icons" / f"{size}x{size}" / f"{APP_ID}.png",
             stage / f"usr/share/icons/hicolor/{size}x{size}/apps/{APP_ID}.png")
    # The wizard's ready-to-run first job (a tiny Llama, Shakespeare, chat data): a few hundred KB.
    for f in sorted((ROOT / "examples").rglob("*")):
        if f.is_file() and f.suffix in {".json", ".jinja", ".jsonl", ".txt", ".md"}:
            copy(f, stage / PREFIX.lstrip("/") / "examples" / f.relative_to(ROOT / "examples"))
    doc = stage / "usr/share/doc/rigpilot"
    write(doc / "README.Debian", README_DEBIAN)
    write(doc / "copyright", "Rigpilot\nLicense: Apache-2.0\nSee /usr/share/common-licenses/Apache-2.0\n")

    debian = stage / "DEBIAN"
    installed_kb = sum(f.stat().st_size for f in stage.rglob("*") if f.is_file()) // 1024
    # The venv built on install roughly triples what the wheels take.
    control = textwrap.dedent(f"""\
        Package: rigpilot
        Version: {v}
        Architecture: amd64
        Maintainer: The Rigpilot developers <maintainers@rigpilot.io>
        Section: science
        Priority: optional
        Installed-Size: {installed_kb * 4}
        Depends: python3 (>= 3.11), python3-venv, {", ".join(QT_RUNTIME)}
        Recommends: desktop-file-utils, hicolor-icon-theme
        Homepage: https://rigpilot.io
        Description: run AI training and inference on a multi-GPU workstation
         Rigpilot detects the GPUs of a workstation and how they are wired (NVLink,
         PCIe switches, CPU sockets), recommends how to split a model across them,
         and runs training, fine-tuning and sharded-inference jobs under that plan
         in a background PyTorch engine, with live charts.
         .
         PyTorch itself is installed per user on first run, matching the driver.
        """)
    write(debian / "control", control)
    write(debian / "postinst", POSTINST, 0o755)
    write(debian / "prerm", PRERM, 0o755)
    write(debian / "postrm", POSTRM, 0o755)
    write(debian / "triggers", TRIGGERS)

    out_dir.mkdir(parents=True, exist_ok=True)
    deb = out_dir / f"rigpilot_{v}_amd64.deb"
    # The payload is mostly wheels, already compressed: gzip is as small as xz here and much faster.
    run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(stage), str(deb)])
    return deb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dist", help="where the .deb goes (default: dist/)")
    ap.add_argument("--python", default=sys.executable, help="the Python whose pip fetches the wheels")
    args = ap.parse_args()
    if shutil.which("dpkg-deb") is None:
        print("build_deb: dpkg-deb is missing (apt install dpkg)", file=sys.stderr)
        return 2
    deb = build(args.out, args.python)
    print(deb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
