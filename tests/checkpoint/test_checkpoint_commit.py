"""checkpoint.keep prunes only after the new step is committed (engine/checkpoint/publish.py ``publish``).

A crash injected at each step of the commit (the rename of the staging directory to ``step_N``; the replacement
of ``latest``) must leave every older step in place and ``latest`` naming the previous one: a restart then resumes
from it. Mutation testing found that pruning moved before the commit passed every test (issue 34, part D); here
it deletes steps 1-3 before the injected crash and fails. The crash-free case checks that the same call does
prune (the injection is not vacuous).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from engine.checkpoint.publish import publish, staging_dir, step_name

OLDER = [step_name(s) for s in (1, 2, 3)]


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
    root = tmp_path / "ckpt"
    for name in OLDER:
        (root / name).mkdir(parents=True)
        (root / name / "index.json").write_text("{}")
    (root / "latest").write_text(f"{OLDER[-1]}\n")
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
