"""The record of what a package carries: every bundled distribution's version and wheel hashes.

build_deb.py installs what packaging/bundle.lock (in the repository) pins, writes the same record
into the package as /opt/rigpilot/bundle.lock, and prints it. It is a pip
requirements file in hash-checking form, one requirement per distribution with the sha256 of each
wheel file installed from (one per CPython where the wheel is built per version):

    numpy==2.4.6 \\
        --hash=sha256:… \\
        --hash=sha256:…

so a build installs exactly those wheels (pip refuses any other file, and any distribution the lock
does not pin), and anyone can check a wheel against it. Comment lines
name each wheel file, in the order of the hashes. Rigpilot's own wheel is built from the source, so
it is named in a comment, not pinned.
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, order=True)
class Wheel:
    """One wheel file a bundled distribution was installed from."""

    name: str  # normalised: lower case, runs of -_. as one -
    version: str
    python: str  # the CPython it was installed for, "3.11"
    filename: str
    sha256: str


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def from_report(report: dict, python: str) -> list[Wheel]:
    """The wheels in a `pip install --report` (pip's installation report, format 1)."""
    wheels = []
    for item in report["install"]:
        url = item["download_info"]["url"]
        sha256 = item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
        if sha256 is None and url.startswith("file://"):  # a wheel from a folder: pip read it, but gives no hash
            sha256 = hashlib.sha256(Path(urllib.parse.unquote(url.removeprefix("file://"))).read_bytes()).hexdigest()
        if sha256 is None:
            raise SystemExit(f"lockfile: pip reported no sha256 for {url}")
        meta = item["metadata"]
        wheels.append(Wheel(normalise(meta["name"]), meta["version"], python, url.rsplit("/", 1)[-1], sha256))
    return wheels


def render(wheels: list[Wheel], own: Wheel, title: str, packaged: bool = True) -> str:
    """The lock file: every wheel but `own` (Rigpilot's, built from the source) pinned by version and hash.

    `packaged`: the copy in the package, which also names Rigpilot's own wheel; else packaging/bundle.lock.
    """
    lines = [
        f"# {title}: every Python distribution under /opt/rigpilot/lib{', as built' if packaged else ''}.",
        "# A pip requirements file in hash-checking mode: each distribution's exact version and the sha256 of each",
        "# wheel file it was installed from (named above it, in the order of the hashes).",
    ]
    if packaged:
        lines += [
            "# Rebuild from exactly these wheels: python3 packaging/build_deb.py --lock /opt/rigpilot/bundle.lock",
            "#",
            f"# {own.name} {own.version}, built from the source: {own.filename} sha256:{own.sha256}",
        ]
    else:
        lines += [
            "# packaging/build_deb.py installs exactly these; `build_deb.py --update-lock` resolves the newest wheels",
            "# that fit pyproject.toml afresh and rewrites this file (generated: do not edit).",
        ]
    by_name: dict[str, list[Wheel]] = {}
    for w in sorted(set(wheels)):
        if w.name != own.name:
            by_name.setdefault(w.name, []).append(w)
    for name, found in by_name.items():
        versions = {w.version for w in found}
        if len(versions) != 1:
            raise SystemExit(f"lockfile: {name} was installed in different versions: {', '.join(sorted(versions))}")
        files: dict[str, list[str]] = {}  # sha256 -> the Pythons it was installed for, and its file name
        for w in found:
            files.setdefault(w.sha256, [w.filename]).append(w.python)
        lines.append("")
        for filename, *pythons in files.values():
            lines.append(f"# {', '.join(pythons)}: {filename}")
        pins = [f"{name}=={found[0].version}", *(f"    --hash=sha256:{sha}" for sha in files)]
        lines.append(" \\\n".join(pins))
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """name -> (version, sha256 hashes) of a lock file's requirements (comments and Rigpilot's own line skipped)."""
    joined = re.sub(r"\\\n", " ", text)
    pins = {}
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        if m is None:
            raise ValueError(f"not a pinned, hashed requirement: {line[:80]}")
        pins[normalise(m.group(1))] = (m.group(2), frozenset(re.findall(r"sha256:([0-9a-f]{64})", m.group(3))))
    return pins
