"""A path the user gave, checked once before anything opens it.

Every path that comes from a person — a CLI flag, a field of a socket request, a
wizard field — goes through `check_given_path` before it is opened, so each way
a path can be wrong is refused the same way, in one line that names it:

- a name longer than NAME_MAX (255 bytes) or a path longer than PATH_MAX (4096
  bytes with its terminating NUL), which the kernel would refuse with
  ENAMETOOLONG deep inside whatever touched it first;
- a NUL character or an unencodable name, which Python refuses with ValueError;
- a missing path, a part of it that is a file, no permission, a symlink loop;
- a file where a folder is expected and the other way round;
- anything that is neither a regular file nor a folder: a named pipe (FIFO), a
  socket, a device. Opening a FIFO for reading blocks until someone writes to
  it, so such paths are refused from `stat` alone (which follows symlinks: a
  link to a FIFO is refused too), and `open_given_file` opens without blocking
  and checks the opened file again, for one swapped in between.

`PathRefused` carries the path and a `problem` code; the engine service sends it
as the protocol's `bad_path` error with both as fields.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO, Literal

from rigpilot.engine.errors import UserError

NAME_MAX = 255  # bytes in one file name on Linux's file systems
PATH_MAX = 4096  # bytes in a path the kernel takes, its terminating NUL included

Expect = Literal["file", "folder", "file or folder"]
FILE: Expect = "file"
FOLDER: Expect = "folder"
EITHER: Expect = "file or folder"

# PathRefused.problem: what a client may act on (the message is for people).
EMPTY = "empty"
BAD_NAME = "bad_name"  # a NUL character, or text that is no file name
NAME_TOO_LONG = "name_too_long"
PATH_TOO_LONG = "path_too_long"
MISSING = "missing"
NOT_A_FILE = "not_a_file"
NOT_A_FOLDER = "not_a_folder"
SPECIAL = "special_file"  # a FIFO, socket or device
NO_ACCESS = "no_access"
LINK_LOOP = "link_loop"
UNREADABLE = "unreadable"

_SHOWN_MAX = 80  # characters of a path shown in a message
_KINDS = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


class PathRefused(UserError):
    """A path the user gave that cannot be what it is meant to be; `problem` says why (the codes above)."""

    def __init__(self, message: str, *, path: str, problem: str):
        super().__init__(message, reason="bad_path", path=path, problem=problem)
        self.path = path
        self.problem = problem


def shown(path: str | os.PathLike[str]) -> str:
    """`path` fit for a one-line message: control characters escaped, the middle of a long one elided."""
    text = os.fspath(path)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                       for c in text)  # fmt: skip
    if len(text) > _SHOWN_MAX:
        text = text[: _SHOWN_MAX // 2 - 1] + "…" + text[-(_SHOWN_MAX // 2) :]
    return text


def check_given_path(
    path: str | os.PathLike[str],
    what: str,
    *,
    expect: Expect = FILE,
    base: Path | None = None,
    missing_ok: bool = False,
) -> Path:
    """`path` (relative ones under `base` when given, else under the current folder), checked as a `what`.

    Raises PathRefused unless it names an existing `expect` (a regular file, a folder, or either).
    `missing_ok`: a path that does not exist yet passes (a file about to be written, or a name that
    may be something other than a path); everything else is still checked.
    """
    text = os.fspath(path)
    if not text.strip():
        raise PathRefused(f"no {what} given", path=text, problem=EMPTY)
    if "\x00" in text:
        raise PathRefused(f"{what} {shown(text)}: a file name cannot hold a NUL character", path=text, problem=BAD_NAME)
    p = Path(text)
    if text.startswith("~"):
        try:
            p = p.expanduser()
        except RuntimeError:  # ~name of no user here
            raise PathRefused(
                f"{what} {shown(text)} does not exist (no user {text[1:].split('/')[0]!r} on this machine)",
                path=text, problem=MISSING,
            ) from None  # fmt: skip
    if base is not None and not p.is_absolute():
        p = base / p
    _check_length(p, text, what)
    try:
        st = os.stat(p)
    except OSError as e:
        if missing_ok and e.errno in (errno.ENOENT, errno.ENOTDIR):
            return p
        raise _refusal(e, text, what) from None
    kind = stat.S_IFMT(st.st_mode)
    if kind == stat.S_IFREG:
        if expect == FOLDER:
            raise PathRefused(f"{what} {shown(text)} is a file; give a folder", path=text, problem=NOT_A_FOLDER)
    elif kind == stat.S_IFDIR:
        if expect == FILE:
            raise PathRefused(f"{what} {shown(text)} is a folder; give a file", path=text, problem=NOT_A_FILE)
    else:
        linked = " links to" if os.path.islink(p) else " is"
        wanted = "regular file" if expect == FILE else "folder" if expect == FOLDER else "regular file or folder"
        raise PathRefused(
            f"{what} {shown(text)}{linked} {_KINDS.get(kind, 'a special file')}, not a {wanted}",
            path=text, problem=SPECIAL,
        )  # fmt: skip
    return p


def is_given_file(path: str | os.PathLike[str], *, base: Path | None = None) -> bool:
    """Whether `path` is a regular file `check_given_path` takes; never raises (for probes, not for refusals)."""
    try:
        check_given_path(path, "file", expect=FILE, base=base)
    except PathRefused:
        return False
    return True


def is_given_folder(path: str | os.PathLike[str], *, base: Path | None = None) -> bool:
    """Whether `path` is a folder `check_given_path` takes; never raises."""
    try:
        check_given_path(path, "folder", expect=FOLDER, base=base)
    except PathRefused:
        return False
    return True


def open_given_file(path: str | os.PathLike[str], what: str, *, base: Path | None = None) -> BinaryIO:
    """The regular file `path`, checked by `check_given_path`, opened for reading in binary mode.

    Opened without blocking, so a FIFO swapped in after the check cannot hang the caller, and
    checked again on the open file descriptor.
    """
    p = check_given_path(path, what, expect=FILE, base=base)
    text = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise _refusal(e, text, what) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PathRefused(f"{what} {shown(text)} is not a regular file", path=text, problem=SPECIAL)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_path_length(path: str | os.PathLike[str], what: str) -> None:
    """Refuse a path no file system could hold (PATH_MAX, NAME_MAX, in bytes), whatever it names or whether it
    exists: for a path that is only stored now and opened later, and the first of check_given_path's checks."""
    _check_length(Path(os.fspath(path)), os.fspath(path), what)


def _check_length(p: Path, text: str, what: str) -> None:
    try:
        raw = os.fsencode(p)
    except UnicodeEncodeError:
        raise PathRefused(f"{what} {shown(text)} is not a valid file name", path=text, problem=BAD_NAME) from None
    if len(raw) >= PATH_MAX:
        raise PathRefused(
            f"{what} {shown(text)} is {len(raw):,} bytes long; paths have at most {PATH_MAX - 1:,} bytes",
            path=text, problem=PATH_TOO_LONG,
        )  # fmt: skip
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        raise PathRefused(
            f"{what} {shown(text)}: a name in it is {len(longest):,} bytes long; file names have at most {NAME_MAX} bytes",
            path=text, problem=NAME_TOO_LONG,
        )  # fmt: skip


def _refusal(e: OSError, text: str, what: str) -> PathRefused:
    if e.errno == errno.ENOENT:
        return PathRefused(f"{what} {shown(text)} does not exist", path=text, problem=MISSING)
    if e.errno == errno.ENOTDIR:
        return PathRefused(f"{what} {shown(text)} does not exist (a part of it is a file, not a folder)",
                           path=text, problem=MISSING)  # fmt: skip
    if e.errno in (errno.EACCES, errno.EPERM):
        return PathRefused(f"{what} {shown(text)}: permission denied", path=text, problem=NO_ACCESS)
    if e.errno == errno.ELOOP:
        return PathRefused(f"{what} {shown(text)}: too many levels of symbolic links (a loop?)",
                           path=text, problem=LINK_LOOP)  # fmt: skip
    if e.errno == errno.ENAMETOOLONG:  # a file system with shorter names than NAME_MAX
        return PathRefused(f"{what} {shown(text)}: a name in it is too long for its file system",
                           path=text, problem=NAME_TOO_LONG)  # fmt: skip
    return PathRefused(f"cannot read {what} {shown(text)}: {e.strerror or e}", path=text, problem=UNREADABLE)
