"""Opening what a checkpoint directory holds without trusting it: no links below the root, regular
files only, sizes known before a byte is read (`specs/checkpoint-format.md` §Reading a directory
nobody vouches for).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from .._errors import CheckpointError

__all__ = ["open_dir", "open_file", "read_small", "entry_kind", "is_real_dir", "is_real_file"]

_KINDS = {
    stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory",
    stat.S_IFREG: "a regular file",
}
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def entry_kind(name: str, dir_fd: int | None = None) -> str | None:
    """What `name` is (without following a link), in words; None when it does not exist."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except (FileNotFoundError, NotADirectoryError):  # (a path through a file: nothing there either)
        return None
    except OSError as e:  # permissions, a loop, a name too long
        raise CheckpointError(f"cannot look at {name!r}: {e.strerror}") from None
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def is_real_dir(name: str, dir_fd: int | None = None) -> bool:
    return entry_kind(name, dir_fd) == "a directory"


def is_real_file(name: str, dir_fd: int | None = None) -> bool:
    return entry_kind(name, dir_fd) == "a regular file"


def _refuse_link(where: str, kind: str) -> CheckpointError:
    if kind == "a symbolic link":
        return CheckpointError(f"{where} is a symbolic link; fnzero follows no links inside a checkpoint directory")
    return CheckpointError(f"{where} is {kind}, not what a checkpoint holds there")


def _open(name: str, dir_fd: int | None, where: str, want: str, flags: int) -> int:
    """Open `name` after checking (without following a link) that it is `want`; a link, another
    kind, or an open that fails is one `CheckpointError`, a missing entry `FileNotFoundError`."""
    if dir_fd is not None:
        kind = entry_kind(name, dir_fd)
        if kind is None:
            raise FileNotFoundError(errno.ENOENT, f"no such {want.split()[-1]}", where)
        if kind != want:
            raise _refuse_link(where, kind)
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse_link(where, "a symbolic link") from None
        if e.errno == errno.ENOENT:
            raise
        raise CheckpointError(f"cannot open {where}: {e.strerror}") from None


def open_dir(name: str, dir_fd: int | None, where: str) -> int:
    """A descriptor of directory `name` (relative to `dir_fd`; a link is refused). With `dir_fd`
    None, `name` is the caller's own path and may be a link."""
    flags = _DIR if dir_fd is not None else os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    return _open(name, dir_fd, where, "a directory", flags)


def open_file(name: str, dir_fd: int, where: str, max_bytes: int | None = None) -> tuple[int, int]:
    """(descriptor, size) of regular file `name` in directory `dir_fd`, opened for reading."""
    fd = _open(name, dir_fd, where, "a regular file", _FILE)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between the lstat and the open
            raise _refuse_link(where, _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file"))
        if max_bytes is not None and st.st_size > max_bytes:
            raise CheckpointError(f"{where} is {st.st_size} bytes; a file there is at most {max_bytes}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_small(name: str, dir_fd: int, where: str, max_bytes: int) -> bytes:
    """The whole of regular file `name` (at most `max_bytes`; the size is checked first)."""
    fd, size = open_file(name, dir_fd, where, max_bytes)
    try:
        chunks, got = [], 0
        while got < size:
            piece = os.pread(fd, size - got, got)
            if not piece:
                break
            chunks.append(piece)
            got += len(piece)
        return b"".join(chunks)
    finally:
        os.close(fd)
