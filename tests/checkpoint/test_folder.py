"""engine/checkpoint/folder.py's write-then-rename, in-process (no launcher: milliseconds): every file and folder of
the new folder reaches the disk before the rename; a failed second rename puts the old folder back whole; a folder
that cannot be deleted at the end neither fails a finished write nor hides the caller's error; the refusals' lines
say the system's reason and name a checkpoint's first three steps. The launcher's lines for the same refusals (one
``error:`` line, exit 2) are tests/checkpoint/test_overwrite.py's and tests/hf/test_convert_publish.py's."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.checkpoint.folder import MARKER, begin, written
from engine.checkpoint.format import INDEX, CheckpointError
from tests.checkpoint.runs import read_only


def write_folder(target: Path, overwrite: bool, files: dict[str, str]) -> Path:
    """``files`` (relative name -> text) written as one folder at ``target``; returns the temporary folder used."""
    with written(target, overwrite, "folder") as tmp:
        for name, text in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text)
    return tmp


def contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file() and p.name != MARKER}


@contextlib.contextmanager
def undeletable(folder: Path):
    """``folder`` made immutable (chattr +i: even root cannot delete what is in it); whatever the code under test
    renamed it to, its folder's copies found by name at the end are made mutable again."""
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr to make a folder undeletable")
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("the file system here has no immutable flag")
    try:
        yield
    finally:
        for path in folder.parents[1].rglob(folder.name):
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def test_every_file_and_folder_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """The new folder is durable when it appears under its name: a power cut after the rename must not leave
    an export whose files are empty (ext4 and XFS keep a renamed folder's unsynced data only in memory)."""
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    tmp = write_folder(tmp_path / "out", False, {"a.txt": "a", "sub/b.txt": "b", "sub/deeper/c.txt": "c"})
    wanted = {tmp / n for n in ("a.txt", "sub/b.txt", "sub/deeper/c.txt", MARKER, "sub", "sub/deeper")} | {tmp}
    assert wanted <= set(synced), sorted(map(str, wanted - set(synced)))
    assert contents(tmp_path / "out") == {"a.txt": "a", "sub/b.txt": "b", "sub/deeper/c.txt": "c"}


def test_a_failed_second_rename_puts_the_old_folder_back_whole(tmp_path, monkeypatch):
    """--overwrite renames the old folder aside, then the new one into place; when the second rename fails (another
    process creating the target between the two, a file system error), the old folder is renamed back: the user
    keeps the earlier export, whole, and sees the error."""
    target = tmp_path / "out"
    write_folder(target, False, {"old.txt": "old", "sub/kept.txt": "kept"})
    real = Path.rename

    def rename(self, dst):
        if ".tmp-" in self.name:  # the new folder's rename into place
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(self, dst)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        write_folder(target, True, {"new.txt": "new"})
    assert contents(target) == {"old.txt": "old", "sub/kept.txt": "kept"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "a temporary or set-aside folder was left"


def test_an_old_folder_that_cannot_be_deleted_does_not_fail_the_replaced_write(tmp_path):
    """The new folder is in place before the old one is deleted: a part of the old one that cannot be deleted
    (immutable, on a read-only mount) leaves it beside the target, and the write has succeeded."""
    target = tmp_path / "out"
    write_folder(target, False, {"old.txt": "old", "stuck/kept.txt": "kept"})
    with undeletable(target / "stuck"):
        write_folder(target, True, {"new.txt": "new"})
        assert contents(target) == {"new.txt": "new"}
        (aside,) = (p for p in tmp_path.iterdir() if p.name.startswith(".out.old-"))
        assert contents(aside) == {"stuck/kept.txt": "kept"}


def test_the_callers_error_is_raised_even_when_the_temporary_folder_cannot_be_deleted(tmp_path):
    """A write that fails (a bad source, a full disk) is reported as itself, not as the clean-up's failure to
    delete what it had written so far."""
    with contextlib.ExitStack() as stack, pytest.raises(ValueError, match="the caller's own error"):
        with written(tmp_path / "out", False, "folder") as tmp:
            (tmp / "stuck").mkdir()
            (tmp / "stuck" / "part.txt").write_text("part")
            stack.enter_context(undeletable(tmp / "stuck"))  # still immutable when written() cleans up
            raise ValueError("the caller's own error")
    assert not (tmp_path / "out").exists()


def test_a_target_whose_folder_is_not_writable_gives_the_systems_reason(tmp_path):
    """The line says why the temporary folder beside the target cannot be made, in the system's words, not an
    errno and a path it already names."""
    parent = tmp_path / "parent"
    parent.mkdir()
    with read_only(parent), pytest.raises(CheckpointError) as e:
        begin(parent / "out", False, "folder")
    assert re.search(r"beside it to write into \((Operation not permitted|Permission denied)\); give", str(e.value))


@pytest.mark.parametrize("steps", [3, 4])
def test_a_target_inside_a_checkpoint_directory_names_three_of_its_steps(tmp_path, steps):
    """A checkpoint directory known by its committed steps (no ``latest``): its first three are named, in order, and
    ', ...' says when there are more."""
    ckpt = tmp_path / "ckpt"
    for n in range(1, steps + 1):
        (ckpt / f"step_{n:06d}").mkdir(parents=True)
        (ckpt / f"step_{n:06d}" / INDEX).write_text("{}")
    with pytest.raises(CheckpointError) as e:
        begin(ckpt / "export", False, "folder")
    named = ", ".join(f"step_{n:06d}" for n in range(1, 4)) + (", ..." if steps > 3 else "")
    assert f"a checkpoint directory ({named})," in str(e.value), str(e.value)


@pytest.mark.parametrize("extra", [3, 4, 5])
@pytest.mark.parametrize("marker", [False, True])
def test_a_folder_overwrite_may_not_replace_names_three_of_its_files_and_counts_the_rest(tmp_path, extra, marker):
    """--overwrite over a folder that holds files no earlier convert wrote (no marker, or files its marker does not
    list): the refusal names the first three and says how many more, so the user knows what would be lost."""
    target = tmp_path / "out"
    if marker:
        write_folder(target, False, {"a.txt": "a"})
    else:
        target.mkdir()
    for n in range(extra):
        (target / f"x{n}").write_text("theirs")
    with pytest.raises(CheckpointError) as e:
        begin(target, True, "folder")
    more = f" and {extra - 3} more" if extra > 3 else ""
    why = "which the earlier convert did not write" if marker else f"not written by launch/convert.py (no {MARKER})"
    assert f"holds x0, x1, x2{more}, {why}" in str(e.value), str(e.value)


@pytest.mark.parametrize("steps", [3, 4])
def test_a_target_in_a_folder_of_steps_names_three_of_them(tmp_path, steps):
    """A non-empty target whose folder holds step_* folders (a checkpoint directory without ``latest``) is refused
    even with --overwrite: the line names its first three steps and ', ...' for more."""
    ckpt = tmp_path / "ckpt"
    for n in range(1, steps + 1):
        (ckpt / f"step_{n:06d}").mkdir(parents=True)
    (ckpt / "export").mkdir()
    (ckpt / "export" / "model.safetensors").write_text("weights")
    with pytest.raises(CheckpointError) as e:
        begin(ckpt / "export", True, "folder")
    named = ", ".join(f"step_{n:06d}" for n in range(1, 4)) + (", ..." if steps > 3 else "")
    assert f"lies inside {ckpt}, a checkpoint directory ({named});" in str(e.value), str(e.value)
