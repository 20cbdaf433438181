"""checkpoint.keep prunes only after the new step is committed (engine/checkpoint/publish.py ``publish``).

A crash injected at each step of the commit (the rename of the staging directory to ``step_N``; the replacement
of ``latest``) must leave every older step in place and ``latest`` naming the previous one: a restart then resumes
from it. Mutation testing found that pruning moved before the commit passed every test (issue 34, part D); here
it deletes steps 1-3 before the injected crash and fails. The crash-free case checks that the same call does
prune (the injection is not vacuous).

Issue 45 (mutation testing of publish.py): ``checkpoint.keep 0`` keeps every step; a stale same-step folder whose
remains cannot be deleted does not fail a committed save; ``latest_name`` (the "latest checkpoint stays ..." of every
failed save's line) names the step; a crash moving a stale same step aside leaves it; what a crash left (temporary
and set-aside folders) goes at the next commit, and one that cannot be deleted fails nothing; a step pruning cannot
delete is named with the file and why; the locator (``extra``) is committed; ``discard`` of a staging folder that is
gone or cannot be deleted raises nothing (it runs inside a failed save's error path); a file system that cannot
fsync a directory commits; ``enclosing_step`` finds the step a folder lies in (checkpoint.dir's refusal,
engine/checkpoint/lock.py).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

import pytest

from engine.checkpoint.publish import (
    discard,
    enclosing_step,
    latest_name,
    list_checkpoints,
    prune,
    publish,
    staging_dir,
    step_name,
)
from tests.checkpoint.runs import read_only

OLDER = [step_name(s) for s in (1, 2, 3)]


def older_steps(tmp_path: Path) -> Path:
    """A checkpoint root holding steps 1-3, ``latest`` naming step 3."""
    root = tmp_path / "ckpt"
    for name in OLDER:
        (root / name).mkdir(parents=True)
        (root / name / "index.json").write_text("{}")
    (root / "latest").write_text(f"{OLDER[-1]}\n")
    return root


def injected(crash: str, real):
    """``os.rename`` / ``os.replace`` (pathlib's rename and replace call them) failing at the named commit step."""

    def op(src, dst, *args, **kwargs):
        if (crash == "rename to step_N" and Path(src).name.startswith(f"{step_name(4)}.tmp-")) or (
            crash == "latest repointed" and Path(dst).name == "latest"
        ):
            raise OSError(errno.EIO, f"injected crash at {crash}")
        return real(src, dst, *args, **kwargs)

    return op


@pytest.mark.parametrize("crash", ["rename to step_N", "latest repointed", "none"])
def test_a_crash_during_the_commit_prunes_nothing(tmp_path, monkeypatch, crash):
    root = older_steps(tmp_path)
    staging_dir(root, 4, "run")
    monkeypatch.setattr(os, "rename", injected(crash, os.rename))
    monkeypatch.setattr(os, "replace", injected(crash, os.replace))
    if crash == "none":
        publish(root, 4, "run", {"step": 4}, keep=1)
        assert sorted(p.name for p in root.iterdir()) == ["latest", step_name(4)], "keep=1 pruned nothing"
        return
    with pytest.raises(OSError, match="injected crash"):
        publish(root, 4, "run", {"step": 4}, keep=1)
    kept = [name for name in OLDER if (root / name / "index.json").is_file()]
    assert kept == OLDER, f"a crash at '{crash}' left only {kept} of {OLDER}: pruned before the commit"
    assert (root / "latest").read_text() == f"{OLDER[-1]}\n"


def test_keep_0_prunes_nothing(tmp_path):
    root = older_steps(tmp_path)
    staging_dir(root, 4, "run")
    publish(root, 4, "run", {"step": 4}, keep=0)
    assert sorted(p.name for p in root.iterdir()) == ["latest", *OLDER, step_name(4)]


def test_a_stale_same_step_that_cannot_be_deleted_does_not_fail_the_save(tmp_path):
    """A resume from step 3 saving step 4 again over an older step 4: that one is moved aside and deleted after
    ``latest`` names the new one; failing to delete it (a read-only part) must not turn the committed save into a
    failed one."""
    root = older_steps(tmp_path)
    stale = root / step_name(4) / "part"
    stale.mkdir(parents=True)
    (stale / "shard").write_text("old")
    staging_dir(root, 4, "run")
    (root / f"{step_name(4)}.tmp-run" / "shard").write_text("new")
    aside = root / f"{step_name(4)}.old-run"  # where publish moves it
    with read_only(stale, moved_to=aside / "part"):
        final = publish(root, 4, "run", {"step": 4})
        assert final == root / step_name(4) and (final / "shard").read_text() == "new"
        assert latest_name(root) == step_name(4)
    shutil.rmtree(aside)


def test_latest_name_names_the_step_or_none(tmp_path):
    root = older_steps(tmp_path)
    assert latest_name(root) == OLDER[-1]
    for text in (b"", b"\n", b"\xff\xfe"):
        (root / "latest").write_bytes(text)
        assert latest_name(root) == "none", text
    (root / "latest").unlink()
    assert latest_name(root) == "none"


def test_discard_raises_nothing_inside_a_failed_save(tmp_path):
    """A save that failed before its staging folder existed (no inode left), or on a read-only folder."""
    root = older_steps(tmp_path)
    discard(root, 4, "gone")
    staging_dir(root, 4, "run")
    (root / f"{step_name(4)}.tmp-run" / "shard").write_text("x")
    with read_only(root / f"{step_name(4)}.tmp-run"):
        discard(root, 4, "run")
    discard(root, 4, "run")
    assert sorted(p.name for p in root.iterdir()) == ["latest", *OLDER]


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP])
def test_a_file_system_that_cannot_fsync_a_directory_commits(tmp_path, monkeypatch, code):
    """Some file systems refuse fsync on a directory (EINVAL, ENOTSUP): their renames are as durable as they get,
    and the save goes on; any other error (EIO) fails it."""
    root = older_steps(tmp_path)
    staging_dir(root, 4, "run")
    real = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    publish(root, 4, "run", {"step": 4})
    assert latest_name(root) == step_name(4)


def test_enclosing_step_is_the_step_a_folder_lies_in(tmp_path):
    root = older_steps(tmp_path)
    inside = root / OLDER[0] / "a" / "b"
    inside.mkdir(parents=True)
    assert enclosing_step(inside) == root / OLDER[0]
    (root / OLDER[0] / "index.json").unlink()  # a step folder beside `latest` without its index (damaged)
    assert enclosing_step(inside) == root / OLDER[0]
    assert enclosing_step(root) is None and enclosing_step(tmp_path / "elsewhere") is None
    (root / "logs").mkdir()  # beside `latest`, but no step
    assert enclosing_step(root / "logs") is None
    imported = tmp_path / "hf" / "x"  # an import's folder: index.json, no step name
    imported.mkdir(parents=True)
    (imported.parent / "index.json").write_text("{}")
    assert enclosing_step(imported) == imported.parent


def test_list_checkpoints_is_committed_steps_newest_first(tmp_path):
    root = older_steps(tmp_path)
    (root / "step_000010").mkdir()  # numeric order: step 10 is newer than step 3
    staging_dir(root, 4, "run")
    (root / "step_000005.old-x").mkdir()
    (root / "step_000006").write_text("")  # a file named like a step is none
    assert list_checkpoints(root) == [root / n for n in ("step_000010", *OLDER[::-1])]
    assert list_checkpoints(tmp_path / "missing") == []


def test_a_crash_moving_a_stale_same_step_aside_leaves_it(tmp_path, monkeypatch):
    root = older_steps(tmp_path)
    (root / step_name(4)).mkdir()
    (root / step_name(4) / "shard").write_text("old")
    staging_dir(root, 4, "run")
    real = os.rename

    def rename(src, dst, *args, **kwargs):
        if ".old-" in Path(dst).name:
            raise OSError(errno.EIO, "injected crash at moving aside")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="injected crash"):
        publish(root, 4, "run", {"step": 4})
    assert (root / step_name(4) / "shard").read_text() == "old" and latest_name(root) == OLDER[-1]
    assert (root / f"{step_name(4)}.tmp-run").is_dir()


def test_what_a_crash_left_goes_at_the_next_commit_even_in_part(tmp_path):
    root = older_steps(tmp_path)
    for name in ("step_000004.tmp-dead", "step_000002.old-dead", "step_000005.tmp-stuck"):
        (root / name / "part").mkdir(parents=True)
    staging_dir(root, 4, "run")
    stuck = root / "step_000005.tmp-stuck" / "part"
    with read_only(stuck):
        publish(root, 4, "run", {"step": 4})
        assert sorted(p.name for p in root.iterdir()) == ["latest", *OLDER, step_name(4), "step_000005.tmp-stuck"]
    publish_again = staging_dir(root, 5, "next")
    publish(root, 5, "next", {"step": 5})
    assert not publish_again.exists() and sorted(p.name for p in root.iterdir()) == [
        "latest",
        *OLDER,
        step_name(4),
        step_name(5),
    ]


def test_a_step_pruning_cannot_delete_is_named_with_the_file_and_why(tmp_path, capsys):
    root = older_steps(tmp_path)
    (root / OLDER[0] / "shard").write_text("x")
    staging_dir(root, 4, "run")
    with read_only(root / OLDER[0]):
        publish(root, 4, "run", {"step": 4}, keep=2)
    out = capsys.readouterr().out
    assert f"checkpoint: pruned {root / OLDER[1]} (checkpoint.keep=2; kept {step_name(4)} and 1 older)" in out
    failed = re.escape(f"checkpoint: could not prune {root / OLDER[0]} (checkpoint.keep=2; kept {step_name(4)} and 1 ")
    assert re.search(
        failed + r"older\): (shard|index\.json): (Operation not permitted|Permission denied); it is still there",
        out,
    ), out
    assert prune(root, 4, 0) == []


def test_the_locator_is_committed_and_every_rank_may_make_the_staging_folder(tmp_path):
    root = tmp_path / "ckpt"
    for _rank in range(2):  # each rank calls staging_dir (one shared folder)
        staging_dir(root, 1, "run")
    final = publish(root, 1, "run", {"step": 1}, extra={"locator.json": "{}"})
    assert sorted(p.name for p in final.iterdir()) == ["index.json", "locator.json"]
    assert (final / "locator.json").read_text() == "{}"


def test_a_folder_that_cannot_be_searched_is_passed_over(tmp_path, monkeypatch):
    """checkpoint.dir inside a step, in a folder the user may not search (mode 0600; root searches any, so the
    lookup's EACCES is injected): the step around it is still found."""
    root = older_steps(tmp_path)
    locked = root / OLDER[0] / "locked"
    locked.mkdir()
    real = Path.is_file

    def is_file(self):
        if self.parent == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self)

    monkeypatch.setattr(Path, "is_file", is_file)
    assert enclosing_step(locked) == root / OLDER[0]
