"""How a checkpoint directory comes into being: written under a temporary name, then published atomically.

Every writer of a checkpoint (a training save, engine/checkpoint/checkpointer.py, and the Hugging Face import,
engine/model/hf.py) writes its shards into ``staging_dir(root, step, token)`` = ``<root>/step_N.tmp-<token>`` and
then calls ``publish``, the only code that makes a ``step_N`` directory or ``latest`` appear: index.json written
and fsynced last into the temporary directory, the directory renamed to ``step_N`` (a stale one of the same step
moved aside first), ``latest`` replaced by write + fsync + os.replace, and the directories fsynced so that the
renames survive a crash. A reader therefore sees a complete checkpoint or none; ``list_checkpoints`` never
matches a temporary directory.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

from engine.checkpoint.format import INDEX, fsync_write

STEP_DIR = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Committed ``step_*`` directories, newest first (temporary ``.tmp-*`` ones never match)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def _staging_path(root: Path, step: int, token: str) -> Path:
    return root / f"{step_name(step)}.tmp-{token}"


def staging_dir(root: Path, step: int, token: str) -> Path:
    """Create (with ``root``) the temporary directory the shards of checkpoint ``step`` are written into."""
    tmp = _staging_path(root, step, token)
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def _fsync_dir(path: Path) -> None:
    """Make the entries (renames, new files) of directory ``path`` durable, where the file system can."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory; their renames are as durable as they get
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def publish(root: Path, step: int, token: str, index: dict, keep: int = 0) -> Path:
    """One process (rank 0): commit ``staging_dir(root, step, token)``, whose shards are written and fsynced,
    with ``index`` as its index.json; point ``latest`` at it; keep the newest ``keep`` checkpoints (0: all) and
    delete the temporary directories a crash left. Returns the published ``root/step_N``."""
    tmp, final = _staging_path(root, step, token), root / step_name(step)
    fsync_write(tmp / INDEX, json.dumps(index))
    _fsync_dir(tmp)
    aside = None
    if final.exists():  # a stale save of the same step (a resume from an older one): replaced, not merged
        aside = final.with_name(f"{final.name}.old-{token}")
        final.rename(aside)
    tmp.rename(final)
    latest_tmp = root / f"latest.tmp-{token}"
    fsync_write(latest_tmp, final.name + "\n")
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    for old in list_checkpoints(root)[keep:] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for pattern in ("step_*.tmp-*", "step_*.old-*"):  # left by a crash (never ours: one save in flight)
        for stale in root.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    return final
