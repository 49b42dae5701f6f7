"""The Python libraries the .deb carries: Rigpilot's dependency closure for each supported CPython.

pip installs the closure once per CPython (binary wheels only, for manylinux
x86-64), each into its own folder. A distribution whose installed files are the
same for every version (pure Python, abi3) is kept once in `common/`; the rest
(numpy, PyYAML: compiled per CPython) go to `cp311/`, `cp312/`, `cp313/`. On the
target, a virtual environment on the system python3 gets a .pth with
`cpXY` and `common`; dpkg owns every file.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import lockfile
import qt_trim

PYTHONS = ("3.11", "3.12", "3.13")
# Debian 12 has glibc 2.36, Ubuntu 24.04 2.39, Debian 13 2.41: any manylinux wheel up to 2.36 runs on all of them.
PLATFORMS = ["manylinux2014_x86_64", *(f"manylinux_2_{m}_x86_64" for m in range(17, 37))]
# Files pip writes per install rather than per distribution: they say nothing about the wheel's contents.
INSTALL_NOISE = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def tag(python: str) -> str:
    return "cp" + python.replace(".", "")


@dataclass
class Dist:
    """One installed distribution: its dist-info folder and the files it installed (relative to the target)."""

    dist_info: str
    files: dict[str, str] = field(default_factory=dict)  # path -> sha256 of the bytes on disk

    @property
    def name(self) -> str:
        return self.dist_info.removesuffix(".dist-info").rsplit("-", 1)[0]


def pip_environment() -> dict[str, str]:
    """The environment of every pip the build runs: none of the builder's pip configuration applies.

    PIP_CONFIG_FILE=/dev/null makes pip skip every configuration file (global, user and site), and no
    PIP_* variable is passed on; with --isolated on the command line too, what pip installs depends only
    on the build's own options (the index and wheel folders given to build_deb.py) and the lock.
    SOURCE_DATE_EPOCH is kept: Rigpilot's own wheel dates its files by it.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def pip_install(python_cmd: str, requirements: list[str], target: Path, py: str, sources: list[str],
                report: Path) -> list[lockfile.Wheel]:  # fmt: skip
    """Install `requirements` for CPython `py` into `target`; return the wheels pip installed them from."""
    cmd = [
        python_cmd, "-m", "pip", "--isolated", "install", "--quiet", "--no-compile", "--disable-pip-version-check",
        "--no-warn-script-location", "--target", str(target), "--only-binary=:all:",
        "--implementation", "cp", "--python-version", py, "--abi", tag(py),
        *(arg for p in PLATFORMS for arg in ("--platform", p)),
        *sources, "--report", str(report), *requirements,
    ]  # fmt: skip
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=pip_environment())
    return lockfile.from_report(json.loads(report.read_text()), py)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def tidy(target: Path) -> None:
    """Drop what pip wrote for the build machine, not for the target.

    Console scripts in bin/ carry the build interpreter's path in their
    shebang; the app needs none of them. uv's binary stays: uv.find_uv_bin()
    looks for it in bin/ beside the package, as `pip install --target` lays it
    out.
    """
    bin_dir = target / "bin"
    if bin_dir.is_dir():
        for f in bin_dir.iterdir():
            if not _is_elf(f):
                f.unlink()
    # direct_url.json records the build folder; REQUESTED says which distributions the pip command named,
    # which differs between a build from the lock (all of them) and one that resolves afresh (Rigpilot only).
    for f in [*target.glob("*.dist-info/direct_url.json"), *target.glob("*.dist-info/REQUESTED")]:
        f.unlink()
    # Byte-code some wheels carry for one version: the postinst compiles for the target's Python instead.
    for d in sorted(target.rglob("__pycache__"), reverse=True):
        shutil.rmtree(d)
    for record in target.glob("*.dist-info/RECORD"):
        rows = list(csv.reader(io.StringIO(record.read_text())))
        kept = []
        for row in rows:
            rel = _normalise(row[0])
            if (target / rel).exists() or rel.endswith("/RECORD"):
                kept.append(row)
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(kept)
        record.write_text(out.getvalue())


def _normalise(record_path: str) -> str:
    # pip --target installs through a home scheme: scripts are recorded as ../../bin/NAME.
    while record_path.startswith("../"):
        record_path = record_path[3:]
    return record_path


def read_dists(target: Path) -> list[Dist]:
    dists = []
    for info in sorted(target.glob("*.dist-info")):
        d = Dist(info.name)
        for row in csv.reader(io.StringIO((info / "RECORD").read_text())):
            rel = _normalise(row[0])
            if Path(rel).name in INSTALL_NOISE and rel.startswith(info.name + "/"):
                continue
            d.files[rel] = _sha256(target / rel)
        for f in info.rglob("*"):
            if f.is_file():
                d.files.setdefault(f.relative_to(target).as_posix(), "")
        dists.append(d)
    return dists


def _owned(dists: list[Dist]) -> set[str]:
    return {p for d in dists for p in d.files}


def split(targets: dict[str, Path], out: Path) -> dict[str, list[str]]:
    """Lay the per-version installs out as out/common + out/cpXY; return which distributions went where."""
    per_version = {py: {d.dist_info: d for d in read_dists(t)} for py, t in targets.items()}
    for py, t in targets.items():
        owned = _owned(list(per_version[py].values()))
        unowned = sorted(p for p in _files(t) if p not in owned)
        if unowned:
            raise SystemExit(f"bundle: files no distribution owns in the {py} install: {unowned[:5]}")
    first = next(iter(per_version.values()))
    common = [
        name for name, d in first.items()
        if all(name in v and v[name].files == d.files for v in per_version.values())
    ]  # fmt: skip
    placed: dict[str, list[str]] = {"common": sorted(common)}
    first_target = next(iter(targets.values()))
    for name in common:
        for rel in first[name].files:
            _move(first_target / rel, out / "common" / rel)
    for py, t in targets.items():
        specific = sorted(set(per_version[py]) - set(common))
        placed[tag(py)] = specific
        for name in specific:
            for rel in per_version[py][name].files:
                _move(t / rel, out / tag(py) / rel)
    clash = {p for p in _files(out / "common")} & {p for py in targets for p in _files(out / tag(py))}
    if clash:
        raise SystemExit(f"bundle: files both common and version-specific: {sorted(clash)[:5]}")
    pth = [p for p in out.rglob("*.pth")]
    if pth:
        # A .pth inside these folders would never run: they are on sys.path, not site directories.
        raise SystemExit(f"bundle: a distribution relies on a .pth file, which this layout does not run: {pth}")
    return placed


def _files(root: Path) -> set[str]:
    return {f.relative_to(root).as_posix() for f in root.rglob("*") if f.is_file()} if root.exists() else set()


def _move(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(src, dst)


def debianise(lib: Path) -> None:
    """What dh_python3 does to a Debian package's modules, applied to the wheels' files.

    Modules that start with a #! line (examples, helpers behind the console
    scripts left out here) lose it and any executable bit: on the target they
    are modules, imported and never run as scripts. Every RECORD is rewritten
    with the new hashes, so importlib.metadata and `pip check` still describe
    the files as installed.

    Binaries are not stripped as dh_strip would: auditwheel patched many of
    them with patchelf, and strip turns those into files the loader refuses
    ("ELF load command address/offset not page-aligned", numpy's OpenBLAS).
    """
    changed = False
    for f in sorted(lib.rglob("*.py")):
        data = f.read_bytes()
        if data.startswith(b"#!"):
            f.write_bytes(data[data.find(b"\n") + 1 :] if b"\n" in data else b"")
            f.chmod(0o644)
            changed = True
    if changed:
        for record in lib.glob("*/*.dist-info/RECORD"):
            _rewrite_record(record)


def _rewrite_record(record: Path) -> None:
    root = record.parent.parent
    rows = []
    for row in csv.reader(io.StringIO(record.read_text())):
        rel = _normalise(row[0])
        path = root / rel
        if rel == record.relative_to(root).as_posix():
            rows.append([rel, "", ""])
        elif path.is_file():
            digest = hashlib.sha256(path.read_bytes()).digest()
            rows.append(
                [rel, "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode(), str(path.stat().st_size)]
            )
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    record.write_text(out.getvalue())


def build(
    python_cmd: str, own_wheel: Path, work: Path, out: Path, sources: list[str], lock: Path | None = None
) -> tuple[dict[str, list[str]], list[lockfile.Wheel]]:
    """Install Rigpilot's wheel and its dependencies for every supported CPython under work/, trim Qt, and
    split them into out/; return which distributions went where, and every wheel installed.

    `sources`: pip's index options (--index-url, --find-links, --no-index). With `lock` (a bundle.lock
    from an earlier build), pip installs exactly the wheels it names, in hash-checking mode: a wheel with
    another hash, or a dependency it does not pin, stops the build.
    """
    work.mkdir(parents=True, exist_ok=True)
    requirement = [str(own_wheel)]
    if lock is not None:
        digest = hashlib.sha256(own_wheel.read_bytes()).hexdigest()
        pinned = work / "requirements.txt"
        pinned.write_text(f"{lock.read_text()}\nrigpilot @ {own_wheel.as_uri()} --hash=sha256:{digest}\n")
        requirement = ["--require-hashes", "-r", str(pinned)]
    targets = {}
    wheels: list[lockfile.Wheel] = []
    for py in PYTHONS:
        t = work / tag(py)
        shutil.rmtree(t, ignore_errors=True)
        wheels += pip_install(python_cmd, requirement, t, py, sources, work / f"report-{tag(py)}.json")
        qt_trim.trim(t)
        tidy(t)
        targets[py] = t
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    placed = split(targets, out)
    for t in targets.values():
        shutil.rmtree(t)
    debianise(out)
    return placed, wheels


LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def glibc_needed(lib: Path) -> str | None:
    """The oldest glibc every bundled binary wheel runs on: the newest of each wheel's oldest manylinux tag."""
    need = None
    for wheel_file in lib.glob("*/*.dist-info/WHEEL"):
        oldest = None
        for line in wheel_file.read_text().splitlines():
            if not line.startswith("Tag:"):
                continue
            for plat in line.split("-")[-1].split("."):
                m = re.match(r"manylinux_(\d+)_(\d+)_", plat)
                v = (int(m.group(1)), int(m.group(2))) if m else LEGACY_MANYLINUX.get(plat.rsplit("_", 2)[0])
                if v and (oldest is None or v < oldest):
                    oldest = v
        if oldest and (need is None or oldest > need):
            need = oldest
    return f"{need[0]}.{need[1]}" if need else None
