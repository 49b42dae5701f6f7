#!/usr/bin/env python3
"""Build the Rigpilot Debian package from a clean checkout.

    python3 packaging/build_deb.py            # -> dist/rigpilot_<version>-1_amd64.deb

Needs a CPython 3.11-3.13 with pip (it fetches the wheels and imports the CLI
for the man page), dpkg-deb and gzip. The builder's pip configuration never
applies (no pip.conf, no PIP_* variable): wheels come from PyPI, or from the
--index-url / --find-links / --no-index given here. What is bundled is pinned:
packaging/bundle.lock names every wheel's version and sha256, pip installs
exactly those (hash-checking mode), and the same record is printed and kept in
the package as /opt/rigpilot/bundle.lock. So two builds of a commit bundle the
same files. `--update-lock` resolves the newest wheels that fit pyproject.toml
instead, and rewrites packaging/bundle.lock. The package carries Rigpilot and its
dependency closure for CPython 3.11, 3.12 and 3.13 as installed files under
/opt/rigpilot/lib (packaging/bundle.py), so dpkg tracks every one of them; its
postinst only makes a small virtual environment on the system python3 that
points at them. PyTorch is not in the package: each user's engine environment
gets the build that matches their driver (engine/runtime.py), installing
Rigpilot itself from the wheel in /opt/rigpilot/wheels.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import marshal
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bundle
import debcopyright
import lockfile
import qt_runtime

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "packaging"
APP_ID = "io.rigpilot.Rigpilot"
PREFIX = "opt/rigpilot"
DEBIAN_REVISION = "1"
MAINTAINER = "The Rigpilot developers <maintainers@rigpilot.io>"
ICON_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
PYPI = "https://pypi.org/simple"
LOCK_NAME = "bundle.lock"  # in /opt/rigpilot: the versions and hashes of every bundled wheel (packaging/lockfile.py)
LOCK = HERE / LOCK_NAME  # what a build installs, pinned: the same wheels whenever the same commit is built

# What the bundled Qt (PySide6 wheels) loads from the system for X11, Wayland and offscreen: the list
# dev.py app checks too (packaging/qt-runtime.toml).
QT_RUNTIME = qt_runtime.load().debian_depends()
# The interpreters the bundled libraries are built for (bundle.PYTHONS). Not python3-venv: Debian splits
# off only ensurepip and pip's wheels, and `venv --without-pip` (all the postinst runs) works without them.
PYTHON_DEPENDS = ["python3 (>= 3.11)", "python3 (<< 3.14)"]

DESCRIPTION = """\
run AI training and inference on a multi-GPU workstation
 Rigpilot detects the GPUs of a workstation and how they are wired (NVLink,
 PCIe switches, CPU sockets), recommends how to split a model across them,
 and runs training, fine-tuning and sharded-inference jobs under that plan
 in a background PyTorch engine, with live charts.
 .
 PyTorch itself is installed per user, matching the driver."""


def version() -> str:
    text = (ROOT / "engine" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def source_date() -> int:
    """SOURCE_DATE_EPOCH, else the last commit's time: the dates in the package follow the source."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    r = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip() else int(time.time())


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def write(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)
    path.chmod(mode)


def copy(src: Path, dst: Path, mode: int = 0o644) -> None:
    write(dst, src.read_bytes(), mode)


def gzip_n(data: bytes) -> bytes:
    """gzip -9n: no name, no time stamp, best compression (what lintian and reproducible builds want)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(data)
    return buf.getvalue()


def changelog(deb_version: str, when: int) -> str:
    date = time.strftime("%a, %d %b %Y %H:%M:%S +0000", time.gmtime(when))
    return textwrap.dedent(f"""\
        rigpilot ({deb_version}) unstable; urgency=medium

          * Rigpilot {deb_version.rsplit("-", 1)[0]}: the app and its Python libraries for CPython
            {", ".join(bundle.PYTHONS)}, installed as package files under /opt/rigpilot.

         -- {MAINTAINER}  {date}
        """)


def own_wheel(python: str, dest: Path, sources: list[str], when: int) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    # setuptools builds in build/lib and never deletes from it: a module removed or moved since an earlier
    # build (the top-level engine/ and app/ of before the rigpilot package) would ride along into the wheel.
    for stale in (ROOT / "build" / "lib", *(ROOT / "build").glob("bdist.*")):
        shutil.rmtree(stale, ignore_errors=True)
    # The wheel's files are dated SOURCE_DATE_EPOCH, so the same commit makes the same wheel, byte for byte.
    run([python, "-m", "pip", "--isolated", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
         *sources, "-w", str(dest), str(ROOT)], env={**bundle.pip_environment(), "SOURCE_DATE_EPOCH": str(when)})  # fmt: skip
    wheel = next(dest.glob("rigpilot-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/")[0] for name in z.namelist()}
    if {t for t in top if not t.endswith(".dist-info")} != {"rigpilot"}:
        raise SystemExit(f"build_deb: {wheel.name} installs more than the rigpilot package: {sorted(top)}")
    return wheel


def python_tag(python: str) -> str:
    out = subprocess.run([python, "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout.strip()


def man_page(python: str, lib: Path, out: Path, when: int) -> None:
    """rigpilot(1) from the packaged CLI itself, run from the staged libraries."""
    tag = python_tag(python)
    if not (lib / tag).is_dir():
        raise SystemExit(f"build_deb: the build Python must be one of {', '.join(bundle.PYTHONS)} (it is {tag})")
    env = {
        **os.environ,
        "PYTHONPATH": f"{lib / tag}{os.pathsep}{lib / 'common'}",
        "SOURCE_DATE_EPOCH": str(when),
        "PYTHONDONTWRITEBYTECODE": "1",
    }  # nothing may be written into the staged tree
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "rigpilot.1"
        run([python, "-s", str(HERE / "manpage.py"), "--out", str(page)], env=env, cwd=tmp)
        write(out, gzip_n(page.read_bytes()))


def dpkg_size(paths: list[Path]) -> int:
    """Installed-Size as dpkg-gencontrol counts it: KiB per file rounded up, 1 per folder or link."""
    kib = 0
    for p in paths:
        if p.is_symlink() or p.is_dir():
            kib += 1
        else:
            kib += math.ceil(p.stat().st_size / 1024)
    return kib


def pyc_estimate(roots: list[Path]) -> int:
    """KiB the postinst's byte-compilation adds, measured with this interpreter's compiler.

    The target's Python writes one .pyc per module (a 16-byte header and the
    marshalled code) and a __pycache__ folder per package folder; other 3.1x
    versions' code objects differ by a few per cent.
    """
    kib, folders = 0, set()
    for root in roots:
        for src in root.rglob("*.py"):
            try:
                code = compile(src.read_bytes(), str(src), "exec", dont_inherit=True)
            except (SyntaxError, ValueError):
                continue
            kib += math.ceil((16 + len(marshal.dumps(code))) / 1024)
            folders.add(src.parent)
    return kib + len(folders)


def venv_estimate(python: str) -> int:
    """KiB of the environment the postinst makes (`venv --without-pip` and the .pth), made here the same way."""
    with tempfile.TemporaryDirectory() as tmp:
        env = Path(tmp) / "env"
        subprocess.run([python, "-I", "-m", "venv", "--without-pip", str(env)], check=True)
        (env / "rigpilot.pth").write_text(f"/{PREFIX}/lib/cp3XY\n/{PREFIX}/lib/common\n")
        return dpkg_size([env, *env.rglob("*")]) + 1  # and the venv link


def normalise_modes(tree: Path) -> None:
    """0755 folders and executables, 0644 everything else, whatever umask and wheels said."""
    for p in [tree, *tree.rglob("*")]:
        if p.is_symlink():
            continue
        if p.is_dir():
            p.chmod(0o755)
            continue
        with p.open("rb") as f:
            head = f.read(4)
        executable = p.stat().st_mode & 0o111 and (head[:2] == b"#!" or (head == b"\x7fELF" and ".so" not in p.name))
        p.chmod(0o755 if executable else 0o644)


def md5sums(stage: Path) -> str:
    lines = []
    for p in sorted(stage.rglob("*")):
        if p.is_file() and not p.is_symlink() and "DEBIAN" not in p.relative_to(stage).parts:
            lines.append(f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.relative_to(stage).as_posix()}")
    return "\n".join(lines) + "\n"


def pip_sources(index_url: str | None, find_links: list[Path], no_index: bool) -> list[str]:
    """pip's options for where wheels come from: PyPI alone unless build_deb.py's own options say otherwise."""
    args = ["--no-index"] if no_index else ["--index-url", index_url or PYPI]
    for folder in find_links:
        args += ["--find-links", str(folder.resolve())]
    return args


def build(out_dir: Path, python: str, fast: bool = False, sources: list[str] | None = None,
          lock: Path | None = LOCK, new_lock: Path | None = None) -> Path:  # fmt: skip
    """Build the .deb into out_dir from the wheels `lock` pins (None: the newest that fit, written to `new_lock`)."""
    started = time.monotonic()
    sources = pip_sources(None, [], False) if sources is None else sources
    v = version()
    deb_version = f"{v}-{DEBIAN_REVISION}"
    when = source_date()
    stage = ROOT / "build" / "deb" / f"rigpilot_{deb_version}_amd64"
    work = ROOT / "build" / "deb" / "work"
    shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    opt = stage / PREFIX
    lib = opt / "lib"

    # Rigpilot's own wheel: the engine environment installs it (--no-deps) for the workers.
    wheel = own_wheel(python, opt / "wheels", sources, when)
    placed, wheels = bundle.build(python, wheel, work, lib, sources, lock)
    for where, dists in placed.items():
        print(f"lib/{where}: {', '.join(d.removesuffix('.dist-info') for d in dists)}")
    shutil.rmtree(work, ignore_errors=True)
    own = lockfile.Wheel("rigpilot", v, "", wheel.name, hashlib.sha256(wheel.read_bytes()).hexdigest())
    pythons = ", ".join(bundle.PYTHONS)
    lock_text = lockfile.render(wheels, own, f"Rigpilot {deb_version} for CPython {pythons}")
    write(opt / LOCK_NAME, lock_text)
    print(f"build_deb: /{PREFIX}/{LOCK_NAME}, the wheels this package was built from:\n{lock_text}", end="")
    if new_lock is not None:
        new_lock.write_text(lockfile.render(wheels, own, f"Rigpilot for CPython {pythons}", packaged=False))
        print(f"build_deb: wrote {new_lock}")

    deb = HERE / "debian"
    copy(deb / "rigpilot", stage / "usr/bin/rigpilot", 0o755)
    copy(deb / "make-env", stage / "usr/lib/rigpilot/make-env", 0o755)
    copy(deb / "rigpilot.rtupdate", stage / "usr/share/python3/runtime.d/rigpilot.rtupdate", 0o755)
    copy(deb / "rigpilot-engine.service", stage / "usr/lib/systemd/user/rigpilot-engine.service")
    copy(deb / "lintian-overrides", stage / "usr/share/lintian/overrides/rigpilot")
    res = ROOT / "resources"
    copy(res / "desktop" / f"{APP_ID}.desktop", stage / f"usr/share/applications/{APP_ID}.desktop")
    copy(res / "desktop" / f"{APP_ID}.metainfo.xml", stage / f"usr/share/metainfo/{APP_ID}.metainfo.xml")
    copy(res / "icons" / f"{APP_ID}.svg", stage / f"usr/share/icons/hicolor/scalable/apps/{APP_ID}.svg")
    for size in ICON_SIZES:
        copy(res / "icons" / f"{size}x{size}" / f"{APP_ID}.png",
             stage / f"usr/share/icons/hicolor/{size}x{size}/apps/{APP_ID}.png")  # fmt: skip
    doc = stage / "usr/share/doc/rigpilot"
    copy(deb / "README.Debian", doc / "README.Debian")
    write(doc / "changelog.Debian.gz", gzip_n(changelog(deb_version, when).encode()))
    first_year = _first_commit_year() or time.gmtime(when).tm_year
    last_year = time.gmtime(when).tm_year
    years = str(last_year) if first_year == last_year else f"{first_year}-{last_year}"
    write(doc / "copyright", debcopyright.generate(lib, f"{PREFIX}/lib", {
        "name": "rigpilot", "contact": MAINTAINER, "source": "https://rigpilot.io",
        "copyright": f"{years} The Rigpilot developers",
    }))  # fmt: skip
    man_page(python, lib, stage / "usr/share/man/man1/rigpilot.1.gz", when)
    normalise_modes(stage)

    payload = [p for p in stage.rglob("*")]
    installed_kib = dpkg_size(payload)
    largest = max((lib / bundle.tag(py) for py in bundle.PYTHONS), key=lambda d: dpkg_size(list(d.rglob("*"))))
    made_on_install = pyc_estimate([lib / "common", largest]) + venv_estimate(python)
    glibc = bundle.glibc_needed(lib)
    libc = [f"libc6 (>= {glibc})"] if glibc else []
    control = "\n".join([
        "Package: rigpilot",
        f"Version: {deb_version}",
        "Architecture: amd64",
        f"Maintainer: {MAINTAINER}",
        f"Installed-Size: {installed_kib + made_on_install}",
        f"Depends: {', '.join([*PYTHON_DEPENDS, *libc, *QT_RUNTIME])}",
        "Recommends: desktop-file-utils, hicolor-icon-theme",
        "Section: science",
        "Priority: optional",
        "Homepage: https://rigpilot.io",
        f"Description: {DESCRIPTION}",
    ]) + "\n"  # fmt: skip
    control_dir = stage / "DEBIAN"
    write(control_dir / "control", control)
    for script in ("postinst", "prerm", "postrm"):
        copy(deb / script, control_dir / script, 0o755)
    copy(deb / "triggers", control_dir / "triggers")
    write(control_dir / "md5sums", md5sums(stage))

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"rigpilot_{deb_version}_amd64.deb"
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(when)}
    # xz -6: the smallest .deb that lintian and every dpkg accept (not zstd, which bookworm's lintian calls
    # malformed), in a minute and more. --fast (the tests): gzip -1, accepted by both, 130 MiB in 6 s where
    # xz -1 took 65 s for 92 MiB on two busy cores; no compression at all is a lintian error.
    compress = ["-Zgzip", "-z1"] if fast else ["-Zxz", "-z6"]
    run(["dpkg-deb", "--root-owner-group", *compress, "--build", str(stage), str(out)], env=env)
    print(f"build_deb: {out.name}: {out.stat().st_size / 2**20:.0f} MiB, Installed-Size {installed_kib} KiB "
          f"+ {made_on_install} KiB made on install, in {time.monotonic() - started:.0f} s")  # fmt: skip
    return out


def _first_commit_year() -> int | None:
    r = subprocess.run(["git", "-C", str(ROOT), "log", "--reverse", "--format=%cd", "--date=format:%Y"],
                       capture_output=True, text=True)  # fmt: skip
    return int(r.stdout.split()[0]) if r.returncode == 0 and r.stdout.strip() else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dist", help="where the .deb goes (default: dist/)")
    ap.add_argument("--python", default=sys.executable,
                    help="a CPython 3.11-3.13 whose pip fetches the wheels (default: this one)")  # fmt: skip
    ap.add_argument("--fast", action="store_true", help="compress quickly (a larger .deb: for tests)")
    ap.add_argument("--index-url", metavar="URL", help=f"the package index to fetch wheels from (default: {PYPI})")
    ap.add_argument("--find-links", type=Path, action="append", default=[], metavar="DIR",
                    help="also take wheels from this folder (repeatable)")  # fmt: skip
    ap.add_argument("--no-index", action="store_true", help="no index at all: only the --find-links folders")
    ap.add_argument("--lock", type=Path, default=LOCK, metavar="FILE",
                    help="install exactly the wheels this lock pins, hashes checked (default: packaging/bundle.lock; "
                    "a package's own /opt/rigpilot/bundle.lock rebuilds that package)")  # fmt: skip
    ap.add_argument("--update-lock", action="store_true",
                    help="ignore the lock: install the newest wheels that fit pyproject.toml, and write them to "
                    "packaging/bundle.lock")  # fmt: skip
    args = ap.parse_args()
    if shutil.which("dpkg-deb") is None:
        print("build_deb: dpkg-deb is missing (apt install dpkg)", file=sys.stderr)
        return 2
    if args.no_index and args.index_url:
        print("build_deb: --no-index and --index-url contradict each other", file=sys.stderr)
        return 2
    lock = None if args.update_lock else args.lock
    if lock is not None:
        try:
            lockfile.parse(lock.read_text())
        except OSError as e:
            print(f"build_deb: the lock {lock}: {e.strerror} (make one with --update-lock)", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"build_deb: the lock {lock}: {e}", file=sys.stderr)
            return 2
    sources = pip_sources(args.index_url, args.find_links, args.no_index)
    try:
        deb = build(args.out, args.python, args.fast, sources, lock, LOCK if args.update_lock else None)
    except subprocess.CalledProcessError as e:
        hint = (f"; if pyproject.toml's dependencies changed, the lock {lock} no longer fits them: make a new one "
                "with --update-lock") if lock is not None else ""  # fmt: skip
        print(f"build_deb: {Path(str(e.cmd[0])).name} {' '.join(map(str, e.cmd[1:3]))} … failed (exit "
              f"{e.returncode}): its own message is above{hint}", file=sys.stderr)  # fmt: skip
        return 1
    print(deb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
