"""debian/copyright in the machine-readable format (DEP-5), for Rigpilot and every bundled distribution.

Each bundled distribution gets a Files paragraph generated from its own
metadata: the license from License-Expression (else License, else the trove
classifiers), the copyright lines and license text from the license files it
ships. Texts Debian keeps in /usr/share/common-licenses (Apache-2.0, the GPLs,
MPL-2.0) are referred to, not repeated. What a wheel does not say about itself
(Qt's libraries inside PySide6, ICU, NVIDIA's binding without a license file)
is stated in EXTRA below, each with where it comes from.
"""

from __future__ import annotations

import email.parser
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
FORMAT = "https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/"
COMMON = {"Apache-2.0", "GPL-2", "GPL-3", "LGPL-2.1", "LGPL-3", "MPL-2.0", "CC0-1.0"}

# SPDX identifiers as DEP-5 spells them (its short names predate SPDX's; "MIT" is ambiguous there: Expat).
SPDX_TO_DEP5 = {
    "MIT": "Expat", "BSD-2-Clause": "BSD-2-clause", "BSD-3-Clause": "BSD-3-clause", "Apache-2.0": "Apache-2.0",
    "GPL-2.0-only": "GPL-2", "GPL-2.0-or-later": "GPL-2+", "GPL-3.0-only": "GPL-3", "GPL-3.0-or-later": "GPL-3+",
    "LGPL-2.1-only": "LGPL-2.1", "LGPL-2.1-or-later": "LGPL-2.1+", "LGPL-3.0-only": "LGPL-3",
    "LGPL-3.0-or-later": "LGPL-3+", "MPL-2.0": "MPL-2.0", "PSF-2.0": "PSF-2.0", "0BSD": "0BSD", "Zlib": "Zlib",
    "CC0-1.0": "CC0-1.0", "ISC": "ISC", "BSD-3-Clause-Open-MPI": "BSD-3-clause-Open-MPI",
    "Unicode-DFS-2016": "Unicode-DFS-2016",
}  # fmt: skip
CLASSIFIERS = {
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
    "License :: OSI Approved :: Mozilla Public License 2.0 (MPL 2.0)": "MPL-2.0",
    "License :: OSI Approved :: Python Software Foundation License": "PSF-2.0",
}

# Full license texts that common-licenses holds: (name, markers that all appear in the full text).
FULL_TEXTS = [
    ("Apache-2.0", ("Apache License", "Version 2.0, January 2004", "TERMS AND CONDITIONS FOR USE")),
    ("GPL-3", ("GNU GENERAL PUBLIC LICENSE", "Version 3, 29 June 2007", "TERMS AND CONDITIONS")),
    ("GPL-2", ("GNU GENERAL PUBLIC LICENSE", "Version 2, June 1991", "TERMS AND CONDITIONS")),
    ("LGPL-3", ("GNU LESSER GENERAL PUBLIC LICENSE", "Version 3, 29 June 2007")),
    ("MPL-2.0", ("Mozilla Public License Version 2.0", "1. Definitions")),
]


@dataclass
class Extra:
    """What a distribution's metadata does not say, stated here with its source."""

    license: str | None = None  # DEP-5 expression
    copyright: str | None = None
    text: str | None = None
    comment: str | None = None
    files: list[str] = field(default_factory=list)  # extra paragraphs: (pattern, license, copyright, text/comment)


QT_COMMENT = (
    "The Qt libraries, plugins and tools that Qt for Python bundles, built by The Qt Company. Most Qt modules "
    "are offered under LGPL-3 or GPL-2 or GPL-3 (https://doc.qt.io/qt-6/licensing.html); a few add-ons only "
    "under GPL-3 (paragraphs below). Qt itself contains third-party code under permissive licenses, listed "
    "with their texts at https://doc.qt.io/qt-6/licenses-used-in-qt.html."
)

# Per distribution (normalised name). Sources: the distributions' own METADATA and files, and Qt's
# module licensing (doc.qt.io/qt-6/qtmodules.html, and the SPDX headers of the Qt sources).
EXTRA: dict[str, Extra] = {
    "cryptography": Extra(
        comment="Its compiled module (cryptography/hazmat/bindings/_rust.abi3.so) also statically links OpenSSL, "
        "which is under Apache-2.0 (https://openssl-library.org/source/license/).",
    ),
    "nvidia-ml-py": Extra(
        license="BSD-3-clause",
        comment="The wheel ships no license file; the text is the header of pynvml.py.",
    ),
    "pyside6-essentials": Extra(copyright="The Qt Company Ltd."),
    "shiboken6": Extra(copyright="The Qt Company Ltd."),
}


def _qt_paragraphs(prefix: str, lib: Path) -> list[str]:
    qt = next(lib.glob("*/PySide6/Qt"), None)
    if qt is None:
        return []
    out = [_paragraph(
        [f"{prefix}/*/PySide6/Qt/*"], "The Qt Company Ltd. and other contributors", "LGPL-3 or GPL-2 or GPL-3",
        None, QT_COMMENT,
    )]  # fmt: skip
    if list(qt.glob("lib/libQt6Lottie*")):
        out.append(_paragraph(
            [f"{prefix}/*/PySide6/Qt/lib/libQt6Lottie*"], "The Qt Company Ltd.", "GPL-3", None,
            "Qt Lottie Animation is offered under GPL-3 only (besides The Qt Company's commercial license).",
        ))  # fmt: skip
    if (qt / "libexec").is_dir():
        out.append(_paragraph(
            [f"{prefix}/*/PySide6/Qt/libexec/*"], "The Qt Company Ltd.", "GPL-3", None,
            "Qt's build tools (rcc, uic, qmlcachegen, ...): GPL-3 with The Qt Company GPL Exception 1.0, "
            "which frees their output; Rigpilot does not run them.",
        ))  # fmt: skip
    if list(qt.glob("lib/libicu*")):
        out.append(_paragraph(
            [f"{prefix}/*/PySide6/Qt/lib/libicu*"], "1991-2023 Unicode, Inc.", "Unicode-DFS-2016",
            (HERE / "licenses" / "Unicode-DFS-2016").read_text(),
            "ICU, bundled with Qt for Python.",
        ))  # fmt: skip
    return out


ICONS = HERE.parent / "resources" / "ui-icons"  # the app's interface icons, copied from lucide-static


def icon_paragraphs(prefix: str, icons: Path = ICONS) -> list[str]:
    """Lucide's icons in rigpilot/resources/ui-icons: ISC; the ones Lucide took from Feather are also under Feather's
    MIT license. Both texts, and which icons are Feather's, come from the LICENSE shipped beside them."""
    text = (icons / "LICENSE").read_text()
    isc, _, rest = text.partition("\n---\n")
    listed = re.search(r"derived from the Feather project:\s*\n(.+?)\n\s*\n", rest, re.S)
    if listed is None or "The MIT License" not in rest:
        # A new LICENSE worded otherwise must stop the build, not drop the MIT paragraph from the copyright file.
        raise ValueError(f"{icons / 'LICENSE'}: no list of Feather-derived icons or no MIT text where expected")
    feather = {n.strip() for n in listed.group(1).split(",")}
    mit = rest[rest.find("The MIT License") :].split("\n", 1)[-1]
    where = f"{prefix}/*/rigpilot/resources/ui-icons"
    out = [_paragraph(
        [f"{where}/*"], "\n".join(_copyrights([isc])), "ISC", isc.strip(),
        "Lucide icons (https://lucide.dev, the lucide-static npm package), the app's interface icons.",
    )]  # fmt: skip
    derived = sorted(p.stem for p in icons.glob("*.svg") if p.stem in feather)
    if derived:
        out.append(_paragraph(
            [f"{where}/{name}.svg" for name in derived], "\n".join(_copyrights([isc, mit])), "ISC and Expat",
            f"{isc.strip()}\n\n{mit.strip()}", "Lucide icons derived from Feather (https://feathericons.com).",
        ))  # fmt: skip
    return out


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dep5_expression(spdx: str) -> str:
    """An SPDX expression in DEP-5 words: `MIT OR Apache-2.0` -> `Expat or Apache-2.0`."""
    out = []
    for tok in re.split(r"(\s+|\(|\))", spdx.strip()):
        if not tok.strip():
            out.append(tok)
        elif tok in ("AND", "OR"):
            out.append(tok.lower())
        elif tok == "WITH":
            out.append("with")
        elif tok in "()":
            out.append(tok)
        else:
            out.append(SPDX_TO_DEP5.get(tok, tok))
    text = re.sub(r"\s+", " ", "".join(out)).strip()
    # DEP-5 names exceptions as `<license> with <name> exception`.
    return re.sub(r"with ([\w.-]+)", r"with \1 exception", text)


def _is_spdx(expr: str) -> bool:
    return all(t in SPDX_TO_DEP5 or t in ("AND", "OR", "WITH", "(", ")") or t.endswith("exception-3.1")
               for t in re.findall(r"[()]|[^\s()]+", expr))  # fmt: skip


@dataclass
class Dist:
    name: str
    version: str
    dist_info: Path
    metadata: email.message.Message

    @property
    def key(self) -> str:
        return _normalise(self.name)


def _license_texts(d: Dist) -> list[tuple[str, str]]:
    files = d.metadata.get_all("License-File") or []
    out = []
    for rel in files:
        for cand in (d.dist_info / "licenses" / rel, d.dist_info / rel):
            if cand.is_file():
                out.append((rel, cand.read_text(errors="replace")))
                break
    if not out:
        for cand in sorted(d.dist_info.glob("LICEN[CS]E*")) + sorted(d.dist_info.glob("COPYING*")):
            out.append((cand.name, cand.read_text(errors="replace")))
    return out


def _leading_comment(path: Path) -> str:
    lines = []
    for raw in path.read_text().splitlines():
        if not raw.startswith("#"):
            break
        lines.append(raw.lstrip("#").rstrip("#").rstrip()[1:] if raw.strip("#") else "")
    return "\n".join(lines).strip("\n")


def _split_bundled(text: str) -> tuple[str, list[dict]]:
    """numpy-style license files: the project's own text, then `Name:/Files:/License:` blocks of bundled code.

    A block runs to the next block or `----` line; what follows such a line
    outside a block is the full text of a license the blocks name (in
    common-licenses, or quoted in the block).
    """
    marker = re.search(r"^This binary distribution of .* also bundles the following software:$", text, re.M)
    if not marker:
        return text, []
    own = re.sub(r"(\s*-{4,}\s*)+$", "", text[: marker.start()]).rstrip()
    blocks: list[dict] = []
    current: dict | None = None
    for ln in text[marker.end() :].splitlines():
        if ln.startswith("Name: "):
            current = {"name": ln[6:].strip(), "files": "", "license": "", "body": []}
            blocks.append(current)
        elif current is None:
            continue
        elif re.match(r"^-{4,}\s*$", ln):
            current = None
        elif not current["license"] and (m := re.match(r"^(Files|License): (.*)$", ln)):
            current[m.group(1).lower()] = m.group(2).strip()
        elif current["license"]:
            current["body"].append(ln)
    for b in blocks:
        b["text"] = _dedent("\n".join(b.pop("body"))).strip("\n")
    return own, [b for b in blocks if b["files"] and b["license"]]


def _dedent(text: str) -> str:
    lines = text.splitlines()
    indents = [len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()]
    cut = min(indents) if indents else 0
    return "\n".join(ln[cut:] for ln in lines)


def _strip_common(text: str) -> tuple[str, list[str]]:
    """Drop full texts common-licenses has; say which were dropped."""
    for name, markers in FULL_TEXTS:
        if all(m in text for m in markers):
            return "", [name]
    return text, []


def _copyrights(texts: list[str]) -> list[str]:
    found = []
    for text in texts:
        for ln in text.splitlines():
            m = re.match(r"^\s*(?:Copyright\s*)?(?:\(c\)|\(C\)|©)?\s*Copyright\s*(?:\(c\)|\(C\)|©)?\s*(.+)$", ln)
            if (
                m
                and re.search(r"\d{4}|[A-Z][a-z]", m.group(1))
                and "notice" not in m.group(1).lower()
                and "holder" not in m.group(1).lower()
                and "[yyyy]" not in m.group(1)
            ):
                c = m.group(1).strip().rstrip(".")
                if c not in found:
                    found.append(c)
    return found


def _license_of(d: Dist, texts: list[str]) -> str:
    extra = EXTRA.get(d.key)
    if extra and extra.license:
        return extra.license
    expr = d.metadata.get("License-Expression") or ""
    if not expr:
        lic = (d.metadata.get("License") or "").strip()
        if lic and "\n" not in lic and _is_spdx(lic):
            expr = lic
    if not expr:
        ids = [CLASSIFIERS[c] for c in d.metadata.get_all("Classifier") or [] if c in CLASSIFIERS]
        if len(ids) == 1:
            expr = ids[0]
    if not expr:
        joined = "\n".join(texts)
        if "Neither the name" in joined and "Redistributions in binary form" in joined:
            expr = "BSD-3-Clause"
        elif "Redistributions in binary form" in joined:
            expr = "BSD-2-Clause"
    if not expr:
        raise SystemExit(f"debcopyright: cannot tell the license of {d.name} {d.version}: add it to EXTRA")
    return dep5_expression(expr)


def _paragraph(files: list[str], copyright: str, license: str, text: str | None, comment: str | None = None) -> str:
    out = ["Files: " + "\n       ".join(files), "Copyright: " + _continued(copyright), "License: " + license]
    if text:
        out.append(_body(text))
    if comment:
        out.append("Comment: " + _continued(comment))
    return "\n".join(out)


def _continued(text: str) -> str:
    lines = text.splitlines() or [""]
    return "\n".join([lines[0], *(" " + ln for ln in lines[1:])])


def _body(text: str) -> str:
    return "\n".join(" " + ln.rstrip() if ln.strip() else " ." for ln in text.strip("\n").splitlines())


def _top_level(d: Dist, lib_dir: Path) -> list[str]:
    tops = set()
    for row in (d.dist_info / "RECORD").read_text().splitlines():
        path = row.rsplit(",", 2)[0].strip('"')
        while path.startswith("../"):
            path = path[3:]
        first = path.split("/", 1)[0]
        if first == d.dist_info.name:
            continue
        tops.add(first if "/" not in path else first + "/*")
    tops.add(d.dist_info.name + "/*")
    if "bin/*" in tops:  # bin/ is shared: name its files
        tops.discard("bin/*")
        tops.update(f"bin/{f.name}" for f in (lib_dir / "bin").iterdir()
                    if f"bin/{f.name}" in (d.dist_info / "RECORD").read_text())  # fmt: skip
    return sorted(tops)


def _sbom_comment(d: Dist) -> str | None:
    boms = sorted(d.dist_info.glob("sboms/*.json"))
    crates, licenses = 0, set()
    for bom in boms:
        data = json.loads(bom.read_text())
        for comp in data.get("components", []):
            crates += 1
            for lic in comp.get("licenses", []):
                val = lic.get("expression") or lic.get("license", {}).get("id") or lic.get("license", {}).get("name")
                if val:
                    licenses.add(" ".join(val.split()))
    if not crates:
        return None
    rel = ", ".join(b.relative_to(d.dist_info.parent).as_posix() for b in boms)
    return (f"Its compiled code statically links {crates} third-party components (Rust crates), each named with "
            f"its version and license in the SBOM shipped beside it ({rel}). Their licenses: "
            + "; ".join(sorted(licenses)) + ".")  # fmt: skip


def generate(lib: Path, prefix: str, own: dict[str, str]) -> str:
    """The copyright file for a staged /opt/rigpilot/lib at `lib`, installed under `prefix` (no leading slash)."""
    head = [
        f"Format: {FORMAT}",
        f"Upstream-Name: {own['name']}",
        f"Upstream-Contact: {own['contact']}",
        f"Source: {own['source']}",
        "Comment: Besides Rigpilot, this package contains the Python distributions it runs on, installed from\n"
        f" their PyPI wheels into /{prefix}. Their paragraphs below are generated from each distribution's\n"
        " own metadata and license files.",
    ]
    paragraphs = ["\n".join(head), _paragraph(["*"], own["copyright"], "Apache-2.0", None)]
    seen: dict[str, Dist] = {}
    for info in sorted(lib.glob("*/*.dist-info")):
        meta = email.parser.Parser().parsestr((info / "METADATA").read_text())
        d = Dist(meta["Name"], meta["Version"], info, meta)
        if d.key == _normalise(own["name"]) or d.key in seen:
            continue
        seen[d.key] = d
    used: set[str] = {"Apache-2.0"}
    for key in sorted(seen):
        d = seen[key]
        extra = EXTRA.get(key, Extra())
        texts = _license_texts(d)
        if key == "nvidia-ml-py":
            pynvml = next(lib.glob("*/pynvml.py"), None)
            if pynvml:
                texts = [("pynvml.py", _leading_comment(pynvml))]
        own_texts, blocks = [], []
        for _, t in texts:
            mine, bundled = _split_bundled(t)
            own_texts.append(mine)
            blocks += bundled
        license = _license_of(d, own_texts)
        kept, dropped = [], []
        for t in own_texts:
            k, dr = _strip_common(t)
            if k.strip():
                kept.append(k.strip("\n"))
            dropped += dr
        copyright = extra.copyright or "\n".join(_copyrights(own_texts)) or _authors(d)
        comments = [c for c in (extra.comment, _sbom_comment(d)) if c]
        files = [f"{prefix}/*/{t}" for t in _top_level(d, d.dist_info.parent)]
        body = "\n\n".join(kept) if kept else None
        if not body:
            used.update(_names(license))
        paragraphs.append(_paragraph(files, copyright, license, body, " ".join(comments) or None))
        # Blocks naming the same files (OpenBLAS and the LAPACK inside it) make one paragraph.
        by_files: dict[str, list[dict]] = {}
        for b in blocks:
            by_files.setdefault(b["files"], []).append(b)
        for pattern, group in by_files.items():
            blic = " and ".join(dep5_expression(b["license"]) for b in group)
            texts = [t for t in (_strip_common(b["text"])[0] for b in group) if t.strip()]
            if len(texts) < len(group):
                used.update(_names(blic))
            bcopy = "\n".join(c for b in group for c in _copyrights([b["text"]])) or group[0]["name"]
            names = " and ".join(b["name"] for b in group)
            paragraphs.append(_paragraph(
                [f"{prefix}/*/{pattern}"], bcopy, blic, "\n\n".join(texts) or None, f"{names}, bundled with {d.name}.",
            ))  # fmt: skip
    paragraphs += _qt_paragraphs(prefix, lib)
    paragraphs += icon_paragraphs(prefix)
    used.update({"GPL-3", "LGPL-3", "GPL-2"} if any("PySide6" in p for p in paragraphs) else set())
    for name in sorted(n for n in used if n.rstrip("+") in COMMON):
        base = name.rstrip("+")
        paragraphs.append(f"License: {name}\n On Debian systems, the complete text of this license is in\n"
                          f" /usr/share/common-licenses/{base}.")  # fmt: skip
    return "\n\n".join(paragraphs) + "\n"


def _names(expr: str) -> set[str]:
    return {t for t in re.findall(r"[^\s()]+", expr) if t not in ("and", "or", "with", "exception")}


def _authors(d: Dist) -> str:
    for key in ("Author", "Author-email", "Maintainer", "Maintainer-email"):
        if d.metadata.get(key):
            return f"{d.metadata[key]} (the authors named in its metadata; the wheel carries no notice)"
    return f"the {d.name} authors"
