"""Debian roots for tests: a real Debian release built from Debian's own packages, to install into.

The packaging test installs Rigpilot's .deb into a Debian 13 root to prove it works with that
release's Python (3.13), not only with this machine's. Typical use in a test:

    reason = debian_root.unavailable()          # None where roots can be made here
    base = debian_root.root("trixie", ["python3", "python3-venv"])   # cached, never modified
    with debian_root.writable_copy(base, tmp_path) as r:             # this test's own copy
        debian_root.run(r, ["python3", "--version"])

`root()` builds with mmdebstrap once per (release, packages) and keeps the result under
$XDG_CACHE_HOME/rigpilot-tests/debian-roots (~/.cache/... by default); delete that folder to get
fresh packages. The cached root is only ever read: every test works in `writable_copy()`, an
overlay over it (a copy where overlayfs cannot be mounted), so installing or purging a package in
one test cannot change what the next one starts from.

Commands run as root (or as a user of the root) through chroot in a private mount namespace:
/proc, /sys, /dev, /dev/pts and a fresh /dev/shm are mounted for each command and disappear with
it, whatever happens. Processes the command leaves behind keep running (a service started by one
command must answer the next); `writable_copy()` kills them on the way out, `stop_processes()` at
any time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from support.processes import alive
from support.waiting import poll_until

MIRROR = "http://deb.debian.org/debian"
# "apt" is the smallest variant with apt and dpkg: Essential packages plus apt. Everything else a
# test needs is named in `packages`, so a missing dependency of the .deb shows up as one.
VARIANT = "apt"
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Bumped when the way roots are built changes, so old cache entries are not reused.
_FORMAT = 1
# What the copied 3.11 must import in the root: these load the shared libraries (libssl,
# libsqlite3, libffi, ...) it was linked against here. Debian 13's python3 already pulls in every
# one (checked with ldd inside the root); python311() names any that is missing.
_PYTHON_MODULES = "ssl, sqlite3, ctypes, venv, zlib, bz2, lzma, uuid, hashlib, readline, curses"
_OPTIONAL_EXTENSIONS = ("_tkinter", "nis")  # GUI toolkit and NIS: not needed, their libraries not installed


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rigpilot-tests" / "debian-roots"


# ---------------------------------------------------------------------------------------------
# Can it work here?


@functools.cache
def _probe(url: str, timeout: float) -> str | None:
    """Why `url` cannot be fetched within `timeout` seconds, DNS included; None when it can."""
    outcome: list[str | None] = []

    def fetch() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
                outcome.append(None)
        except Exception as e:  # every failure is a reason to skip, said in words
            outcome.append(f"{type(e).__name__}: {e}")

    # getaddrinfo ignores socket timeouts (a silent resolver takes 10 s or more); a daemon thread
    # that is given up on bounds the whole probe, name lookup included.
    worker = threading.Thread(target=fetch, daemon=True)
    worker.start()
    worker.join(timeout)
    if not outcome:
        return f"no answer within {timeout:.0f} s"
    return outcome[0]


@functools.cache
def _can_mount() -> str | None:
    if shutil.which("unshare") is None or shutil.which("chroot") is None:
        return "unshare or chroot is not installed"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"cannot make a mount namespace here: {r.stderr.strip() or r.returncode}"
    return None


def unavailable(release: str = "trixie", packages: Sequence[str] = (), cache_dir: Path | None = None,
                timeout: float = 5.0) -> str | None:
    """Why a Debian root cannot be made and used here, in one line; None when it can.

    Does not install anything. Network is only needed when the root for (release, packages) is
    not cached yet.
    """
    if not sys.platform.startswith("linux"):
        return "Debian roots need Linux"
    if os.geteuid() != 0:
        return "making a Debian root needs root (mmdebstrap, chroot, mounts)"
    if reason := _can_mount():
        return reason
    if (_entry(release, packages, cache_dir) / "root").is_dir():
        return None
    if shutil.which("mmdebstrap") is None and shutil.which("apt-get") is None:
        return "mmdebstrap is not installed and there is no apt-get to install it"
    if reason := _probe(f"{MIRROR}/dists/{release}/InRelease", timeout):
        return f"cannot fetch {MIRROR}/dists/{release}/InRelease: {reason}"
    return None


# ---------------------------------------------------------------------------------------------
# Building and caching


def _key(release: str, packages: Sequence[str]) -> str:
    spec = json.dumps({"format": _FORMAT, "release": release, "variant": VARIANT, "mirror": MIRROR,
                       "packages": sorted(set(packages))}, sort_keys=True)
    return f"{release}-{hashlib.sha256(spec.encode()).hexdigest()[:16]}"


def _entry(release: str, packages: Sequence[str], cache_dir: Path | None) -> Path:
    return (cache_dir or default_cache_dir()) / _key(release, packages)


APT_WAIT = ("-o", "DPkg::Lock::Timeout=300")


def _apt_install(*names: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # DPkg::Lock::Timeout: another test process (or unattended-upgrades) may be installing right now.
    cmd = ["apt-get", *APT_WAIT, "install", "-y", "-q", "--no-install-recommends", *names]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:  # stale package lists on a fresh machine
        subprocess.run(["apt-get", *APT_WAIT, "update", "-q"], capture_output=True, env=env, timeout=600)
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"apt-get install {' '.join(names)} failed: {(r.stdout + r.stderr)[-2000:]}")


def _ensure_mmdebstrap() -> None:
    # mmdebstrap checks the release's signature with Debian's keyring: on Ubuntu it is not there
    # by default, and an old one lacks the keys of a newer release.
    missing = [n for n, present in (("mmdebstrap", shutil.which("mmdebstrap")),
                                    ("debian-archive-keyring", DEBIAN_KEYRING.exists())) if not present]
    if missing:
        _apt_install(*missing)


def root(release: str = "trixie", packages: Sequence[str] = (), cache_dir: Path | None = None) -> Path:
    """The cached root of Debian `release` with `packages` installed, built on first use.

    Treat it as read-only and work in `writable_copy(root(...), tmp_path)`. Built with mmdebstrap
    (variant apt, main only) from Debian's mirror, installed with apt-get first where missing.
    Package lists are removed as mmdebstrap does by default: name every package a test needs.
    """
    entry = _entry(release, packages, cache_dir)
    if (entry / "root").is_dir():
        return entry / "root"
    _ensure_mmdebstrap()
    entry.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final place (same file system) and renamed there when complete, so a run
    # that is interrupted, or a second one building at the same time, never leaves half a root.
    build = Path(tempfile.mkdtemp(prefix=f".build-{entry.name}-", dir=entry.parent))
    build.chmod(0o755)
    try:
        cmd = ["mmdebstrap", "--mode=root", f"--variant={VARIANT}", "--components=main",
               "--aptopt=Acquire::Retries \"3\""]
        if DEBIAN_KEYRING.exists():
            cmd.append(f"--keyring={DEBIAN_KEYRING}")
        if packages:
            cmd.append("--include=" + ",".join(packages))
        cmd += [release, str(build / "root"), MIRROR]
        started = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"mmdebstrap {release} failed ({r.returncode}): {(r.stdout + r.stderr)[-3000:]}")
        (build / "manifest.json").write_text(json.dumps({
            "release": release, "variant": VARIANT, "mirror": MIRROR, "packages": sorted(set(packages)),
            "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.monotonic() - started, 1),
        }, indent=1) + "\n")
        try:
            os.rename(build, entry)
        except OSError:
            if not (entry / "root").is_dir():
                raise
            # Another run finished the same root first: use theirs.
    finally:
        if build.exists():
            shutil.rmtree(build, ignore_errors=True)
    return entry / "root"


# ---------------------------------------------------------------------------------------------
# A writable copy per test


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True, timeout=60).returncode == 0


def _unmount(target: Path) -> None:
    if subprocess.run(["umount", str(target)], capture_output=True, timeout=60).returncode != 0:
        subprocess.run(["umount", "--lazy", str(target)], capture_output=True, timeout=60)


def _memory_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _mount_overlay(lower: Path, changes: Path, target: Path) -> bool:
    if any(c in str(p) for p in (lower, changes) for c in ",:"):
        return False  # overlayfs option syntax has no quoting for these
    (changes / "upper").mkdir()
    (changes / "work").mkdir()
    opts = f"lowerdir={lower},upperdir={changes / 'upper'},workdir={changes / 'work'}"
    # volatile: no syncs, as nothing is ever read back from this copy (on disk, unmounting a root
    # with torch installed otherwise writes a gigabyte back first: 20 s).
    return any(_mount("-t", "overlay", "overlay", "-o", opts + extra, str(target)) for extra in (",volatile", ""))


@contextmanager
def writable_copy(base: Path, workdir: Path, in_memory: bool | None = None) -> Iterator[Path]:
    """A writable root that starts as `base`, under `workdir`; gone (and its processes) on exit.

    An overlay mount over `base` where overlayfs works: mounting takes milliseconds and only what
    the test changes is written. The changes go to a tmpfs when `in_memory` (by default when 6 GiB
    of memory is available; it may take half of that), because on disk deleting them afterwards is
    the slowest part (8 to 30 s for a torch install here, ext4 with discard). Where overlayfs
    cannot be mounted, a full copy (cp --reflink=auto: instant on btrfs and XFS).
    """
    workdir = Path(workdir).resolve()
    changes, target = workdir / "changes", workdir / "root"
    changes.mkdir(parents=True)
    target.mkdir()
    mounted: list[Path] = []  # unmounted in reverse order
    if in_memory is None:
        in_memory = _memory_available() >= 6 << 30
    if in_memory and _mount("-t", "tmpfs", "-o", f"size={_memory_available() // 2},mode=0700",
                            "rigpilot-test-root", str(changes)):
        mounted.append(changes)
    if _mount_overlay(Path(base).resolve(), changes, target):
        mounted.append(target)
    else:
        for m in reversed(mounted):
            _unmount(m)
        mounted.clear()
        target.rmdir()
        r = subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(target)],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"copying {base} failed: {r.stderr.strip()}")
    try:
        yield target
    finally:
        stop_processes(target)
        for m in reversed(mounted):
            _unmount(m)
        shutil.rmtree(workdir, ignore_errors=True)


def stop_processes(root: Path, timeout: float = 10.0) -> list[int]:
    """Kill every process whose root directory is `root` (or inside it); their pids."""
    prefix = str(Path(root).resolve())
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            where = os.readlink(proc / "root")
        except OSError:
            continue  # gone, or a kernel thread
        if where == prefix or where.startswith(prefix + "/"):
            found.append(int(proc.name))
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    poll_until(lambda: not any(alive(pid) for pid in found), timeout, 0.05)
    return found


# ---------------------------------------------------------------------------------------------
# Running commands inside


# Runs in the host's /bin/sh inside a new mount namespace whose mounts are private: nothing it
# mounts is seen outside, and the kernel removes it all when the last process in it ends, however
# that happens. Arguments: the root, then pairs of (host path, path in root) to bind read-only,
# then "--", then what chroot runs.
_ENTER = r"""
r=$1; shift
mount -t proc proc "$r/proc"
mount --rbind /sys "$r/sys"
mount --bind /dev "$r/dev"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 devpts "$r/dev/pts"
mount --bind "$r/dev/pts/ptmx" "$r/dev/ptmx"
mount -t tmpfs -o mode=1777,nosuid,nodev shm "$r/dev/shm"
while [ "$1" != "--" ]; do
    mkdir -p "$r$2"
    mount --bind "$1" "$r$2"
    mount -o remount,bind,ro "$r$2"
    shift 2
done
shift
exec chroot "$r" "$@"
"""


def _passwd(root: Path, user: str) -> tuple[int, int, str]:
    for line in (Path(root) / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) >= 6 and fields[0] == user:
            return int(fields[2]), int(fields[3]), fields[5]
    raise KeyError(f"no user {user!r} in {root}/etc/passwd")


def run(root: Path, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 600,
        user: str | None = None, cwd: str | None = None, input: str | None = None,
        binds: Mapping[str | Path, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `cmd` inside `root` as root, or as `user` (a name in the root's /etc/passwd).

    The environment is PATH, HOME, LANG=C.UTF-8 (and USER, LOGNAME) merged with `env`, nothing
    from this process. The command starts in `cwd`, by default the user's home if it exists, else
    "/". `binds` maps host paths to paths in the root, mounted read-only for this command only (a
    folder of wheels, say, without copying it). Output is captured as text. On timeout the
    command's process group is killed and subprocess.TimeoutExpired raised.
    """
    root = Path(root).resolve()
    name = user or "root"
    uid, gid, home = _passwd(root, name)
    full_env = {"PATH": ROOT_PATH, "HOME": home, "LANG": "C.UTF-8", "USER": name, "LOGNAME": name,
                **(env or {})}
    if cwd is None:
        cwd = home if user and (root / home.lstrip("/")).is_dir() else "/"
    inner = ["/usr/bin/env", f"--chdir={cwd}"]
    if user:
        inner += ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "--"]
    bind_args = [a for host, inside in (binds or {}).items() for a in (str(Path(host).resolve()), inside)]
    argv = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-ec", _ENTER, "sh",
            str(root), *bind_args, "--", *inner, *cmd]
    # Its own session, so that a timeout kills everything it started, not only its first process.
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env, start_new_session=True)
    out: list[bytes] = []
    err: list[bytes] = []
    # A service the command starts may keep its stdout open: the command is done when its own
    # process exits, not when every descendant closed the pipe. The readers keep draining after
    # that (closing the pipe would kill such a service with SIGPIPE on its next write).
    readers = [threading.Thread(target=_drain, args=(stream, sink), daemon=True)
               for stream, sink in ((proc.stdout, out), (proc.stderr, err))]
    for reader in readers:
        reader.start()
    if input is not None:
        try:
            proc.stdin.write(input.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for reader in readers:
            reader.join(_PIPE_GRACE)
        raise subprocess.TimeoutExpired(list(cmd), timeout, _text(out), _text(err)) from None
    for reader in readers:
        reader.join(_PIPE_GRACE)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, _text(out), _text(err))


_PIPE_GRACE = 2.0  # seconds to wait for the last output once the command has exited


def _drain(stream, sink: list[bytes]) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        sink.append(chunk)


def _text(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode("utf-8", errors="replace")


def copy_in(root: Path, src: Path, dest: str) -> Path:
    """Copy a host file or folder to `dest` (an absolute path in the root); the copy's host path."""
    if not dest.startswith("/"):
        raise ValueError(f"dest must be an absolute path inside the root: {dest!r}")
    target = Path(root) / dest.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if Path(src).is_dir():
        shutil.copytree(src, target, symlinks=True, dirs_exist_ok=True)
    else:
        shutil.copy2(src, target)
    return target


# ---------------------------------------------------------------------------------------------
# CPython 3.11 for the engine environment


def _python311_prefix() -> Path:
    """The installation prefix of a CPython 3.11 on this machine.

    $RIGPILOT_TEST_PYTHON311 (an interpreter) if set, else the interpreter running the tests if it
    is 3.11 (the dev venv's base, /root/.pyenv/versions/3.11.7 here), else python3.11 on PATH.
    """
    exe = os.environ.get("RIGPILOT_TEST_PYTHON311")
    if not exe and sys.version_info[:2] == (3, 11):
        return Path(sys.base_prefix)
    exe = exe or shutil.which("python3.11")
    if not exe:
        raise RuntimeError("no CPython 3.11 here: set RIGPILOT_TEST_PYTHON311 to one")
    r = subprocess.run([exe, "-c", "import sys; assert sys.version_info[:2] == (3, 11); print(sys.base_prefix)"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"{exe} is not a working CPython 3.11: {r.stderr.strip()[-500:]}")
    return Path(r.stdout.strip())


def python311(root: Path, source: Path | None = None) -> str:
    """Install this machine's CPython 3.11 in the root as /usr/local/bin/python3.11; that path.

    The only CPU torch wheel at hand is cp311 and Debian 13's Python is 3.13. The interpreter is
    laid out as `make altinstall` would (/usr/local/bin/python3.11, /usr/local/lib/python3.11,
    libpython in /usr/local/lib), not at its path here: /root is 0700 on Debian, so a second
    user's engine could not run it there, and python3 stays Debian's. Its own site-packages are
    left out (the interpreter is clean, as a fresh build is). It uses the root's shared libraries,
    never this machine's: a library missing in the root is an error naming it.
    """
    root = Path(root)
    prefix = Path(source) if source else _python311_prefix()
    local = root / "usr/local"
    for sub in ("bin", "lib"):
        (local / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(prefix / "bin/python3.11", local / "bin/python3.11")
    for lib in (prefix / "lib").glob("libpython3.11.so*"):
        if lib.is_symlink():
            (local / "lib" / lib.name).unlink(missing_ok=True)
            (local / "lib" / lib.name).symlink_to(os.readlink(lib))
        else:
            shutil.copy2(lib, local / "lib" / lib.name)
    stdlib = prefix / "lib/python3.11"
    shutil.copytree(stdlib, local / "lib/python3.11", symlinks=True, dirs_exist_ok=True,
                    ignore=lambda d, names: _stdlib_ignored(stdlib, Path(d), names))
    (local / "lib/python3.11/site-packages").mkdir(exist_ok=True)
    ldconfig = run(root, ["ldconfig"], timeout=120)
    if ldconfig.returncode != 0:
        raise RuntimeError(f"ldconfig in the root failed: {ldconfig.stderr.strip()}")
    exe = "/usr/local/bin/python3.11"
    check = run(root, [exe, "-c", f"import {_PYTHON_MODULES}; print('ok')"], timeout=120)
    if check.returncode != 0 or check.stdout.strip() != "ok":
        raise RuntimeError(f"{exe} does not run in the root ({check.stderr.strip()[-800:]}); "
                           f"missing there: {', '.join(_missing_libraries(root)) or 'nothing ldd sees'}")
    return exe


def _stdlib_ignored(stdlib: Path, folder: Path, names: list[str]) -> set[str]:
    if folder == stdlib:
        return {"test", "idlelib", "turtledemo"} & set(names)
    if folder == stdlib / "site-packages":
        return set(names)  # the machine's own packages stay on the machine
    return {n for n in names if n.endswith(".a")}  # the static libpython in config-3.11-*


def _missing_libraries(root: Path) -> list[str]:
    """Shared libraries the 3.11 interpreter or its needed extensions cannot find in the root."""
    files = ["/usr/local/bin/python3.11", *(
        "/" + str(p.relative_to(root)) for p in (root / "usr/local/lib/python3.11/lib-dynload").glob("*.so")
        if not p.name.startswith(_OPTIONAL_EXTENSIONS))]
    r = run(root, ["ldd", *files], timeout=120)
    return sorted({line.split()[0] for line in r.stdout.splitlines() if "not found" in line})

