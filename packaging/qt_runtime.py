"""What the bundled Qt needs from the system, read from qt-runtime.toml, and whether this system has it.

packaging/build_deb.py takes the .deb's Depends from here; `python3 dev.py app` asks `check()` before it
sets anything up, so that a missing library is one line naming the packages to install, not a Qt abort
seven minutes later. It runs on the bare system python3: standard library only, no PySide6 (which is
what is being set up).

Which platform plugin Qt 6 picks (QGuiApplication's platform choice): QT_QPA_PLATFORM if set (a
";"-separated list, each "name:options"); else "wayland" first where WAYLAND_DISPLAY is set or
XDG_SESSION_TYPE is wayland, then "xcb". Qt goes down the list until one plugin loads and connects, and
aborts when none does. So the window opens when some plugin in that list has its display and all its
libraries; when none has, the line names what the first one with a display lacks.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().with_name("qt-runtime.toml")
SKIP = "RIGPILOT_SKIP_DISPLAY_CHECK"  # =1: dev.py app starts without asking (a library Qt finds some other way)
GUI, XCB, WAYLAND, NONE = "gui", "xcb", "wayland", "none"
LDCONFIG_PATHS = ("/sbin/ldconfig", "/usr/sbin/ldconfig", "/usr/bin/ldconfig")
OS_RELEASE = (Path("/etc/os-release"), Path("/usr/lib/os-release"))
# Package managers by the distribution family /etc/os-release names in ID or ID_LIKE.
FAMILIES = {"debian": "debian", "ubuntu": "debian", "fedora": "fedora", "rhel": "fedora", "centos": "fedora",
            "arch": "arch"}  # fmt: skip
INSTALL = {"debian": "apt install", "fedora": "dnf install", "arch": "pacman -S --needed"}
PLUGIN_WORDS = {XCB: "X11 (Qt's xcb plugin)", WAYLAND: "Wayland (Qt's wayland plugin)"}


@dataclass(frozen=True)
class Library:
    """One Debian package of qt-runtime.toml and what it stands for elsewhere."""

    debian: str  # the Depends entry, "new | old" for a package renamed in Debian 13's time_t transition
    sonames: tuple[str, ...]
    needs: str  # GUI, XCB, WAYLAND or NONE
    fedora: str | None = None
    arch: str | None = None

    @property
    def apt_name(self) -> str:
        # The old name: Debian 12 has only it, and on 64-bit the t64 package provides it, so it installs on both.
        return self.debian.split("|")[-1].strip()

    def package(self, distribution: str) -> str | None:
        """Its name in a family of distributions ("debian", "fedora", "arch")."""
        return {"debian": self.apt_name, "fedora": self.fedora, "arch": self.arch}.get(distribution)


@dataclass(frozen=True)
class Runtime:
    libraries: tuple[Library, ...]
    base: frozenset[str]  # sonames every system that runs python3 has: never asked for

    def debian_depends(self) -> list[str]:
        return [lib.debian for lib in self.libraries]

    def needed(self, plugin: str) -> list[Library]:
        """What Qt's Gui and `plugin` (a platform name, as in QT_QPA_PLATFORM) link."""
        return [lib for lib in self.libraries if lib.needs in (GUI, family(plugin))]


def load(path: Path = DATA) -> Runtime:
    import tomllib  # here: dev.py imports this module before it has said that a Python older than 3.11 will not do

    data = tomllib.loads(path.read_text())
    libraries = tuple(Library(debian=e["debian"], sonames=tuple(e["sonames"]), needs=e["needs"], fedora=e.get("fedora"),
                              arch=e.get("arch")) for e in data["library"])  # fmt: skip
    return Runtime(libraries, frozenset(data["base"]["sonames"]))


def family(plugin: str) -> str:
    """The libraries a platform plugin needs besides Qt's own: wayland-egl is a wayland, offscreen none extra."""
    if plugin == XCB:
        return XCB
    return WAYLAND if plugin.startswith(WAYLAND) else GUI


def plugins(env: Mapping[str, str]) -> list[str]:
    """The platform plugins Qt 6 tries, in its order."""
    forced = env.get("QT_QPA_PLATFORM", "")
    if forced:
        return [p.split(":")[0] for p in forced.split(";") if p]
    wayland = [WAYLAND] if env.get("WAYLAND_DISPLAY") or env.get("XDG_SESSION_TYPE") == "wayland" else []
    return [*wayland, XCB]


def has_display(plugin: str, env: Mapping[str, str]) -> bool:
    if family(plugin) == XCB:
        return bool(env.get("DISPLAY"))
    if family(plugin) == WAYLAND:
        return bool(env.get("WAYLAND_DISPLAY"))
    return True  # offscreen, minimal, vnc, eglfs, linuxfb: no display server to reach


# -- what is installed --------------------------------------------------------------------------------------------

_LDCONFIG_LINE = re.compile(r"^\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)\s*$")


def own_abi(ldconfig_output: str, maps: str) -> str | None:
    """ldconfig's tag for libraries this process can load ("libc6,x86-64"): that of the libc it has mapped.

    A 64-bit system with 32-bit libraries lists both; only the ones of our own kind count. None (all
    count) when the libc in /proc/self/maps is not in the cache.
    """
    mapped = {os.path.realpath(line.split()[-1]) for line in maps.splitlines()
              if re.search(r"/libc(\.so\.6|-[\d.]+\.so)$", line)}  # fmt: skip
    for line in ldconfig_output.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if m and m.group(1) == "libc.so.6" and os.path.realpath(m.group(3)) in mapped:
            return _kind(m.group(2))
    return None


def _kind(label: str) -> str:
    """"libc6,x86-64" of ldconfig's label: older ldconfigs add ", OS ABI: Linux 3.2.0" or ", hwcap: …" to some."""
    return ",".join(part.strip() for part in label.split(",")[:2])


def cached_sonames(ldconfig_output: str, abi: str | None) -> set[str]:
    """The sonames in `ldconfig -p` output, of the kind `abi` (all when None)."""
    found = set()
    for line in ldconfig_output.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if m and (abi is None or _kind(m.group(2)) == abi):
            found.add(m.group(1))
    return found


def library_dirs() -> list[Path]:
    """Where the dynamic linker looks without its cache: the standard folders, multiarch ones included."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    dirs = ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", f"/lib/{multiarch}", f"/usr/lib/{multiarch}"]
    return [Path(d) for d in dirs]


def files_in(dirs: Iterable[Path]) -> set[str]:
    found: set[str] = set()
    for d in dirs:
        try:
            found.update(p.name for p in d.iterdir())
        except OSError:
            continue  # not there, or not readable: nothing found in it
    return found


def installed_sonames(env: Mapping[str, str]) -> set[str]:
    """The shared libraries the dynamic linker finds here: its cache (`ldconfig -p`), else the standard
    folders; and LD_LIBRARY_PATH's folders either way, as the linker looks there first."""
    extra = files_in(Path(d) for d in env.get("LD_LIBRARY_PATH", "").split(":") if d)
    ldconfig = shutil.which("ldconfig") or next((p for p in LDCONFIG_PATHS if os.access(p, os.X_OK)), None)
    if ldconfig:
        try:
            r = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            r = None
        if r is not None and r.returncode == 0 and " => " in r.stdout:
            try:
                maps = Path("/proc/self/maps").read_text()
            except OSError:
                maps = ""
            return cached_sonames(r.stdout, own_abi(r.stdout, maps)) | extra
    return files_in(library_dirs()) | extra


def distribution_family(os_release: str) -> str | None:
    """The family: "debian", "fedora" or "arch", as ID or ID_LIKE in /etc/os-release says; None for any other."""
    fields = dict(re.findall(r'^(\w+)=["\']?([^"\'\n]*)["\']?\s*$', os_release, re.M))
    for word in [fields.get("ID", ""), *fields.get("ID_LIKE", "").split()]:
        if word in FAMILIES:
            return FAMILIES[word]
    return None


def read_os_release() -> str:
    for path in OS_RELEASE:
        try:
            return path.read_text()
        except OSError:
            continue
    return ""


# -- the one line -------------------------------------------------------------------------------------------------


def install_hint(missing: list[Library], family_name: str | None, root: bool) -> str:
    """The command that installs `missing` on this family of distributions; their sonames for any other."""
    names = [lib.package(family_name) for lib in missing] if family_name else []
    if not names or None in names:
        sonames = ", ".join(s for lib in missing for s in lib.sonames)
        return f"{sonames} (install them with your distribution's package manager)"
    unique = list(dict.fromkeys(n for n in names if n))
    return f"{'' if root else 'sudo '}{INSTALL[family_name]} {' '.join(unique)}"


def problem(runtime: Runtime, env: Mapping[str, str], sonames: set[str], os_release: str, root: bool) -> str | None:
    """Why Rigpilot's window cannot open here, in one line; None when some plugin Qt tries has its display
    and its libraries."""
    reachable = [p for p in plugins(env) if has_display(p, env)]
    if not reachable:
        return ("dev.py app: no display found (DISPLAY and WAYLAND_DISPLAY are unset, e.g. over SSH): run it in "
                "a desktop session; python3 dev.py setup sets up without opening a window, and .venv/bin/rigpilot "
                "watch is a live view in a terminal.")  # fmt: skip
    lacking: list[tuple[str, list[Library]]] = []
    for plugin in reachable:
        missing = [lib for lib in runtime.needed(plugin) if not set(lib.sonames) <= sonames]
        if not missing:
            return None
        lacking.append((plugin, missing))
    plugin, missing = lacking[0]
    where = PLUGIN_WORDS.get(family(plugin), f"Qt's {plugin} platform")
    return (f"dev.py app: Rigpilot's window on {where} needs system libraries that are not installed: "
            f"{install_hint(missing, distribution_family(os_release), root)}; then run python3 dev.py app again "
            f"({SKIP}=1 skips this check).")  # fmt: skip


def check(env: Mapping[str, str] | None = None) -> str | None:
    """This machine's `problem()`, unless the environment says to skip the check."""
    env = os.environ if env is None else env
    if env.get(SKIP) == "1":
        return None
    return problem(load(), env, installed_sonames(env), read_os_release(), os.geteuid() == 0)
