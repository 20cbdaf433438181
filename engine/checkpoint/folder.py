"""A whole output folder written under a temporary name beside its target, then renamed into place: the Hugging
Face export and import (engine/model/hf.py, launch/convert.py).

Why: writing straight into the target mixed two exports (step 6's ``model.safetensors`` beside step 3's index
and shards, and readers prefer the index: ``model.init_from`` silently loaded step 3) and left half a folder
behind a failure. Now ``written`` does it in three parts: ``begin`` refuses a target that is a file, cannot be
written, or is not empty (unless ``overwrite``), and makes ``.<name>.tmp-<token>`` beside it; the caller writes
there; ``finish`` fsyncs the files and renames the folder to the target. With ``overwrite`` the old target is
renamed aside first and deleted only once the new one is in place, so nothing of it (weights, index, config,
tokenizer files) survives into the new folder, and a failure before the rename leaves it whole. A crash leaves
at most a ``.<name>.tmp-*`` (or ``.old-*``) folder beside the target, never a mixed target.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from engine.checkpoint.format import CheckpointError
from engine.checkpoint.lock import probe_writable
from engine.checkpoint.publish import fsync_dir


def begin(target: Path, overwrite: bool, what: str) -> Path:
    """Check ``target`` (``what``: how the user named it) and create the empty temporary folder beside it."""
    target = Path(os.path.abspath(target))
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{what} '{target}' is a file; give a directory (new or empty)")
    if target.is_dir():
        if any(target.iterdir()) and not overwrite:
            raise CheckpointError(f"{what} '{target}' exists and is not empty; give a new or empty directory, or "
                                  f"--overwrite to replace it as a whole")
        probe_writable(target, uuid.uuid4().hex[:8], what, "give a writable directory")
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise CheckpointError(f"{what} '{target}': cannot create {tmp} beside it to write into "
                              f"({e.strerror or e}); give a directory in a writable place") from None
    return tmp


def finish(tmp: Path, target: Path) -> None:
    """Make the files of ``tmp`` durable and rename it to ``target`` (an old target is replaced as a whole)."""
    target = Path(os.path.abspath(target))
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
    for path in [*(p for p in tmp.rglob("*") if p.is_dir()), tmp]:
        fsync_dir(path)
    aside = tmp.with_name(tmp.name.replace(".tmp-", ".old-")) if target.exists() else None
    if aside is not None:
        target.rename(aside)
    try:
        tmp.rename(target)
    except OSError:
        if aside is not None:
            aside.rename(target)  # the old folder back in place, whole
        raise
    fsync_dir(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def written(target: Path, overwrite: bool, what: str) -> Iterator[Path]:
    """``begin``; the caller writes into the folder yielded; ``finish`` (or, on any error, the temporary folder
    is removed and the target is as it was)."""
    tmp = begin(target, overwrite, what)
    try:
        yield tmp
        finish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
