"""A write of the run that the file system refuses, as one line: the path, the error and the space left there.

Every file a run writes (metrics.jsonl, TensorBoard events, checkpoint shards, the staging directory, index.json,
``latest``, LOCK) can meet a full disk (ENOSPC, also when the inodes run out), a read-only remount (EROFS), a
quota (EDQUOT), permissions (EACCES) or a path of the wrong kind (EISDIR, ENOTDIR). Those writers turn the error
into ``describe(path, e)``: what could not be written, the error by name, and the free bytes and inodes of the
file system holding the nearest existing parent (os.statvfs), so the line says what to free. safetensors reports
an OSError as its own exception with "(os error N)" in the text; ``errno_of`` reads both.

A run stopped by such a failure exits with ``EXIT_STATUS`` (3), not 2 (a bad configuration) nor 1 (training
aborted, or stopped with nothing saved): the job was fine, the disk was not; free space and rerun the same command
to resume from the last good checkpoint. No torch: the launcher imports it.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from engine.errors import CheckpointError

EXIT_STATUS = 3


class StorageError(CheckpointError):
    """A write refused by the file system mid-run; ``str(e)`` is one line (launch/pretrain.py: exit status 3)."""


def errno_of(e: BaseException) -> int | None:
    if isinstance(e, OSError) and e.errno:
        return e.errno
    found = re.search(r"os error (\d+)", str(e))  # safetensors' SafetensorError wraps the io::Error's text
    return int(found.group(1)) if found else None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _reachable(path: Path) -> bool:
    """``path`` exists and can be looked up: a folder we may not search (EACCES) hides what is under it, and
    Path.exists() raises there (Python < 3.13), which would turn the refused write's one line into a traceback."""
    try:
        return path.exists()
    except OSError:
        return False


def free_space(path: Path) -> str:
    """Free bytes and inodes of the file system holding ``path`` (its nearest existing parent we can look up)."""
    where = Path(os.path.abspath(path))
    while not _reachable(where) and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError as e:
        return f"free space of '{where}' unknown ({e.strerror})"
    inodes = f", {st.f_favail} of {st.f_files} inodes" if st.f_files else ""  # some file systems report none
    ro = ", mounted read-only" if st.f_flag & os.ST_RDONLY else ""
    return (
        f"{_size(st.f_bavail * st.f_frsize)} of {_size(st.f_blocks * st.f_frsize)}{inodes} free on the file "
        f"system of '{where}'{ro}"
    )


def describe(path: Path | str, e: BaseException) -> str:
    """One line: ``cannot write 'PATH': No space left on device (ENOSPC); 0 B of 1.0 MiB, ... free on ...``."""
    code = errno_of(e)
    path = getattr(e, "filename", None) or path  # the file the OS named, when deeper than the one we opened
    why = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})" if code else f"{type(e).__name__}: {e}"
    return f"cannot write '{path}': {why}; {free_space(Path(path))}"


def say(line: str) -> None:
    """Print a line on stdout; a terminal that is gone (a dropped ssh session's SIGHUP: EIO, EPIPE) is no reason
    to fail the save or the stop that follows, and the records still go to metrics.jsonl."""
    try:
        print(line, flush=True)
    except OSError:
        pass


def append(path: Path, data: bytes) -> None:
    """Append ``data`` whole or not at all: a write cut short by a full disk is truncated away, so the file still
    ends at a record boundary (metrics.jsonl: a resume reads every line as a record)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size, view = os.fstat(fd).st_size, memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            os.ftruncate(fd, size)  # frees blocks, needs none
            raise
    finally:
        os.close(fd)
