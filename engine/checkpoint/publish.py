"""How a checkpoint directory comes into being: written under a temporary name, then published atomically.

Every writer of a checkpoint (a training save, engine/checkpoint/checkpointer.py, and the Hugging Face import,
engine/hf/convert.py) writes its shards into ``staging_dir(root, step, token)`` = ``<root>/step_N.tmp-<token>`` and
then calls ``publish``, the only code that makes a ``step_N`` directory or ``latest`` appear: the locator and then
index.json written and fsynced last into the temporary directory (each rank wrote its shard and part before), the
directory renamed to ``step_N`` (a stale one of the same step moved aside first), ``latest`` replaced by write +
fsync + os.replace, and the directories fsynced so that the renames survive a crash. A reader therefore sees a
complete checkpoint or none; ``list_checkpoints`` never matches a temporary directory. A publish that fails or is
interrupted before ``latest`` names the new step (a full disk, a read-only remount, a second SIGINT) puts the
directory back under its temporary name, so the last good checkpoint stays ``latest`` and no complete step lies
above it (which the next start-up would refuse, engine/checkpoint/lineage.py); the caller then ``discard``s the
staging directory where the file system lets it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

from engine.checkpoint.format import INDEX, fsync_write
from engine.storage import say

STEP_DIR = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Committed ``step_*`` directories, newest first (temporary ``.tmp-*`` ones never match)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def enclosing_step(path: Path) -> Path | None:
    """The checkpoint step folder that ``path`` (resolved) is or lies inside: a folder holding index.json, or a
    ``step_N`` beside a ``latest``; None when there is none. Pruning (``prune``) deletes such a folder whole."""
    for folder in (path, *path.parents):
        try:
            if (folder / INDEX).is_file() or (STEP_DIR.match(folder.name) and (folder.parent / "latest").exists()):
                return folder
        except OSError:  # a folder on the way that cannot be searched holds nothing we can see
            continue
    return None


def staging_path(root: Path, step: int, token: str) -> Path:
    return root / f"{step_name(step)}.tmp-{token}"


def staging_dir(root: Path, step: int, token: str) -> Path:
    """Create (with ``root``) the temporary directory the shards of checkpoint ``step`` are written into."""
    tmp = staging_path(root, step, token)
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def discard(root: Path, step: int, token: str) -> None:
    """Remove a failed save's staging directory, if the file system still lets us (not once read-only)."""
    shutil.rmtree(staging_path(root, step, token), ignore_errors=True)


def latest_name(root: Path) -> str:
    """What ``latest`` names, for messages ("none" without one)."""
    try:
        return (root / "latest").read_text().strip() or "none"
    except (OSError, UnicodeDecodeError):  # an unreadable or damaged latest (resume: auto skips it, choose.py)
        return "none"


def fsync_dir(path: Path) -> None:
    """Make the entries (renames, new files) of directory ``path`` durable, where the file system can."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory; their renames are as durable as they get
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def publish(root: Path, step: int, token: str, index: dict, keep: int = 0, extra: dict[str, str] | None = None) -> Path:
    """One process (rank 0): commit ``staging_dir(root, step, token)``, whose shards and parts are written and
    fsynced by their ranks, with ``extra`` ({file name: text}: the locator, format.py ``merge_index``) and then
    ``index`` as its index.json; point ``latest`` at it; ``prune`` to ``keep`` checkpoints (0: all) and delete
    the temporary directories a crash left. Returns the published ``root/step_N``."""
    tmp, final = staging_path(root, step, token), root / step_name(step)
    for name, text in (extra or {}).items():
        fsync_write(tmp / name, text)
    fsync_write(tmp / INDEX, json.dumps(index))
    fsync_dir(tmp)
    aside = _commit(root, tmp, final, token)
    fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    prune(root, step, keep)
    for pattern in ("step_*.tmp-*", "step_*.old-*"):  # left by a crash (never ours: one save in flight)
        for stale in root.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _commit(root: Path, tmp: Path, final: Path, token: str) -> Path | None:
    """Rename ``tmp`` to ``final`` and point ``latest`` at it; on any failure (a BaseException too: a second
    SIGINT) undo the renames, best effort, so ``latest`` and the steps below it are as before. Returns the stale
    same-step directory moved aside (deleted by the caller once ``latest`` is durable)."""
    aside, renamed, latest_tmp = None, False, root / f"latest.tmp-{token}"
    try:
        if final.exists():  # a stale save of the same step (a resume from an older one): replaced, not merged
            aside = final.with_name(f"{final.name}.old-{token}")
            final.rename(aside)
        tmp.rename(final)
        renamed = True
        fsync_write(latest_tmp, final.name + "\n")
        os.replace(latest_tmp, root / "latest")
    except BaseException:
        for undo in (
            (lambda: final.rename(tmp)) if renamed else None,
            (lambda: aside.rename(final)) if aside is not None else None,
            latest_tmp.unlink,
        ):
            try:
                if undo is not None:
                    undo()
            except OSError:
                pass
        raise
    return aside


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def prune(root: Path, step: int, keep: int) -> list[Path]:
    """Delete all but ``keep`` checkpoints (0: none deleted), counting the one just committed, ``step``; returns
    what was deleted, each named in one line, and a step that could not be deleted (a permission, a busy file) in
    one line saying so and why (it said "pruned" before). Only steps *below* ``step`` are candidates: the new
    checkpoint (which ``latest`` names, and which is the newest that validates: it was just written and checked)
    and anything above it survive. (Steps above it cannot be this run's: the start-up check,
    engine/checkpoint/lineage.py, sets aside or refuses them; deleting by rank of step number alone once deleted
    the save just made.)"""
    if keep <= 0:
        return []
    older = [p for p in list_checkpoints(root) if step_of(p) < step]
    gone = []
    for old in older[keep - 1 :]:  # newest first: the keep - 1 newest older ones stay beside the new one
        kept = f"checkpoint.keep={keep}; kept {step_name(step)} and {keep - 1} older"
        try:
            shutil.rmtree(old)
        except OSError as e:  # after `latest`: say() never fails the save
            say(
                f"checkpoint: could not prune {old} ({kept}): {e.filename or old}: {e.strerror or e}; it is still "
                f"there, perhaps in part (resume: auto skips a damaged step): delete it by hand"
            )
        else:
            say(f"checkpoint: pruned {old} ({kept})")
            gone.append(old)
    return gone
