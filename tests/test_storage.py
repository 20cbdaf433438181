"""engine/storage.py on its own, against real file systems (a small tmpfs per test, tests/conftest.py ``tmpfs``):
the line a refused write becomes, the free space it names, and an append cut short by a full disk. The launcher's
disk tests (tests/trainer/test_disks.py) drive the same code through a whole run; these pin each piece, cheaply,
so a boundary or a branch changed in it fails here (python -m tests.mutation engine/storage.py)."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import storage
from tests.cli import ROOT


def test_sizes_change_unit_at_1024():
    assert storage._size(0) == "0 B"
    assert storage._size(1023) == "1023 B"
    assert storage._size(1024) == "1.0 KiB"
    assert storage._size(1536) == "1.5 KiB"
    assert storage._size(5 * 1024**2) == "5.0 MiB"
    assert storage._size(3 * 1024**3) == "3.0 GiB"
    assert storage._size(2048 * 1024**4) == "2048.0 TiB"  # TiB is the last unit: never "2.0 PiB" nor ""


def test_errno_is_read_from_an_oserror_or_from_safetensors_text():
    assert storage.errno_of(OSError(errno.ENOSPC, "No space left on device")) == errno.ENOSPC
    wrapped = RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull }) (os error 28)")
    assert storage.errno_of(wrapped) == 28
    assert storage.errno_of(RuntimeError("no number here")) is None
    assert storage.errno_of(OSError("no errno")) is None


def test_free_space_names_the_nearest_existing_parent(tmp_path, tmpfs):
    disk = tmpfs(tmp_path / "disk", size="1m", nr_inodes=64)
    st = os.statvfs(disk)
    line = storage.free_space(disk / "not" / "yet" / "made.bin")
    assert line.endswith(f"free on the file system of '{disk}'"), line
    assert line.startswith(f"{storage._size(st.f_bavail * st.f_frsize)} of 1.0 MiB, "), line
    assert f", {st.f_favail} of 64 inodes " in line, line
    assert "read-only" not in line


def test_free_space_of_a_read_only_file_system_says_so(tmp_path, tmpfs):
    disk = tmpfs(tmp_path / "ro", size="1m", ro="")
    assert storage.free_space(disk / "x").endswith(f"'{disk}', mounted read-only")


def test_describe_names_the_file_the_os_named_else_the_one_opened(tmp_path, tmpfs):
    disk = tmpfs(tmp_path / "disk", size="1m")
    e = OSError(errno.ENOSPC, "No space left on device")
    line = storage.describe(disk / "a.bin", e)
    assert line.startswith(f"cannot write '{disk / 'a.bin'}': No space left on device (ENOSPC); "), line
    assert line.endswith(f"free on the file system of '{disk}'"), line
    deeper = OSError(errno.EROFS, "Read-only file system", str(disk / "shard" / "b.bin"))
    assert storage.describe(disk, deeper).startswith(f"cannot write '{disk / 'shard' / 'b.bin'}': ")
    odd = storage.describe(disk / "c", ValueError("bad header"))
    assert odd.startswith(f"cannot write '{disk / 'c'}': ValueError: bad header; "), odd


def test_append_cut_short_by_a_full_disk_leaves_the_file_at_a_record_boundary(tmp_path, tmpfs):
    disk = tmpfs(tmp_path / "disk", size="64k")
    path = disk / "metrics.jsonl"
    storage.append(path, b'{"step": 1}\n')
    assert path.read_bytes() == b'{"step": 1}\n'
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()
    with pytest.raises(OSError) as e:
        storage.append(path, b"x" * (1 << 20))  # 1 MiB into a 64 KiB disk: a partial write, then ENOSPC
    assert e.value.errno == errno.ENOSPC
    assert path.read_bytes() == b'{"step": 1}\n'  # the partial record truncated away
    storage.append(path, b'{"step": 2}\n')  # and the disk usable again
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _GoneTerminal(io.TextIOBase):
    """stdout of a dropped ssh session: every write fails with EIO."""

    def write(self, s):
        raise OSError(errno.EIO, "Input/output error")


def test_say_prints_and_survives_a_terminal_that_is_gone(monkeypatch, capsys):
    storage.say("saved step 4")
    assert capsys.readouterr().out == "saved step 4\n"
    monkeypatch.setattr(sys, "stdout", _GoneTerminal())
    storage.say("saved step 5")  # no exception: the save and the stop go on


def test_a_write_refused_under_a_folder_we_cannot_search_is_one_line(tmp_path):
    """Was: PermissionError from Path.exists() inside describe(), a traceback instead of the line (a user's run
    writing under a folder of another user's, mode 0700). Run in a fork as nobody: root searches every folder."""
    closed = tmp_path / "theirs"
    closed.mkdir(mode=0o700)
    target = closed / "ckpt" / "a.bin"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os calls and describe(), then os._exit
        os.close(read)
        try:
            os.setuid(65534)
            line = storage.describe(target, OSError(errno.EACCES, "Permission denied"))
        except BaseException as e:
            line = f"raised {type(e).__name__}: {e}"
        os.write(write, line.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        line = f.read()
    os.waitpid(pid, 0)
    assert line.startswith(f"cannot write '{target}': Permission denied (EACCES); "), line
    named = Path(line.rsplit("free on the file system of '", 1)[1].rstrip("'"))
    assert named in target.parents and named.exists(), line  # the nearest parent nobody may look up


def test_say_flushes_each_line(tmp_path):
    """A line said just before the process is ended (os._exit after a fault, a SIGKILL) still reaches the log a
    scheduler keeps: stdout is a pipe there, block-buffered."""
    script = "import os; from engine import storage; storage.say('saved step 4'); os._exit(3)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a scheduler's default
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env)
    assert (run.returncode, run.stdout) == (3, "saved step 4\n"), run.stderr[-2000:]
