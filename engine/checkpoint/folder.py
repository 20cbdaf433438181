"""A whole output folder written under a temporary name beside its target, then renamed into place: the Hugging
Face export and import (engine/hf/convert.py, launch/convert.py).

Why: writing straight into the target mixed two exports (step 6's ``model.safetensors`` beside step 3's index
and shards, and readers prefer the index: ``model.init_from`` silently loaded step 3) and left half a folder
behind a failure. Now ``written`` does it in three parts: ``begin`` refuses a target that is a file, cannot be
written, or is not empty (unless ``overwrite``), and makes ``.<name>.tmp-<token>`` beside it; the caller writes
there; ``finish`` writes the marker (``MARKER``: which files this export or import wrote), fsyncs the files and
renames the folder to the target. With ``overwrite`` the old target is renamed aside first and deleted only once
the new one is in place, so nothing of it survives into the new folder, and a failure before the rename leaves it
whole. A crash leaves at most a ``.<name>.tmp-*`` (or ``.old-*``) folder beside the target, never a mixed target.

What ``overwrite`` may replace (issue 34: it deleted checkpoints, a live run's out_dir, the source, ``.``, and
wrote a probe into ``/``): only a folder an earlier export or import wrote, as its marker says, holding nothing
the marker does not list. Never, marker or not: ``/``, the current directory or a folder holding it, the source
or a folder holding it or inside it, a folder inside a checkpoint directory or a run's out_dir, or a folder that
is one by its own files (``LOCK``, ``latest``, ``step_*``, ``index.json``, ``metrics.jsonl``). A new or empty
target is refused too inside a checkpoint directory or step (``latest``, ``index.json``, ``step_*`` folders
holding one): pruning deleted an export into a step folder with the step. Symlinks are
resolved first, so a link is followed, never replaced, and a link to the source is the source. Every check runs
before anything is written (the probe goes inside the target only once it passed), and again right before the
old target is moved aside.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Iterator

from engine.checkpoint.format import INDEX, CheckpointError
from engine.checkpoint.lock import LOCK, probe_writable
from engine.checkpoint.publish import STEP_DIR, fsync_dir, list_checkpoints

MARKER = ".written-by-convert.json"
# A run's and a checkpoint's own files: LOCK (engine/checkpoint/lock.py), the out_dir's metrics file
# (engine/metrics/logger.py), a checkpoint directory's `latest` and a step's index.json (publish.py, format.py).
RUN_FILES = (
    (LOCK, "a run's lock"),
    ("metrics.jsonl", "a run's out_dir"),
    ("latest", "a checkpoint directory"),
    (INDEX, "a checkpoint step"),
)


def _run_files(folder: Path) -> str | None:
    """What ``folder``'s own files make it (a locked or finished run's directory, a checkpoint), naming them."""
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return None
    for name, kind in RUN_FILES:
        if name in names:
            return f"{kind} ({name})"
    steps = [n for n in names if STEP_DIR.match(n) and (folder / n).is_dir()]
    return f"a checkpoint directory ({', '.join(steps[:3])}{', ...' if len(steps) > 3 else ''})" if steps else None


def _files(folder: Path) -> list[str]:
    """Every file and link under ``folder`` (links not followed), relative, sorted; the marker left out."""
    found = []
    for top, dirs, names in os.walk(folder):
        rel = Path(top).relative_to(folder)
        found += [str(rel / n) for n in names + [d for d in dirs if (Path(top) / d).is_symlink()]]
    return sorted(f for f in found if f != MARKER)


def _not_ours(target: Path) -> str | None:
    """Why ``target``'s contents are not only what an earlier export/import wrote; None if they are."""
    try:
        listed = set(json.loads((target / MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        run = _run_files(target)
        names = sorted(p.name for p in target.iterdir())
        held = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"is {run}" if run else f"holds {held}, not written by launch/convert.py (no {MARKER})"
    extra = [f for f in _files(target) if f not in listed]
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        return f"holds {', '.join(extra[:3])}{more}, which the earlier convert did not write"
    return None


def refusal(target: Path, sources: Iterable[Path]) -> str | None:
    """Why ``--overwrite`` must not replace the existing non-empty folder ``target`` (resolved), naming what it
    would destroy; None when it is an earlier export/import's folder, whole and nothing else."""
    cwd = Path.cwd().resolve()
    if target == Path(target.anchor):
        return "is the root directory"
    if target == cwd or target in cwd.parents:
        return f"is or holds the current directory {cwd}"
    for source in {Path(os.path.realpath(s)) for s in sources}:
        if target == source or target in source.parents:
            return f"is or holds the source {source}"
        if source in target.parents:
            return f"lies inside the source {source}"
    for parent in target.parents:
        run = _run_files(parent)
        if run:
            return f"lies inside {parent}, {run}"
    return _not_ours(target)


def begin(target: Path, overwrite: bool, what: str, sources: Iterable[Path] = ()) -> Path:
    """Check ``target`` (``what``: how the user named it; ``sources``: what is being read) and create the empty
    temporary folder beside it. Returns the temporary folder; the target is ``resolved(target)``."""
    target = resolved(target)
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{what} '{target}' is a file; give a directory (new or empty)")
    if target.is_dir():
        if any(target.iterdir()) or target == Path.cwd().resolve():
            reason = refusal(target, sources)
            if reason:
                only = "; --overwrite replaces only a folder an earlier export or import wrote" if overwrite else ""
                raise CheckpointError(f"{what} '{target}' {reason}{only}; give a new or empty directory")
            if not overwrite:
                raise CheckpointError(
                    f"{what} '{target}' exists and is not empty; give a new or empty directory, "
                    f"or --overwrite to replace it as a whole"
                )
    _refuse_inside_a_checkpoint(target, what)
    if target.is_dir():
        probe_writable(target, uuid.uuid4().hex[:8], what, "give a writable directory")
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise CheckpointError(
            f"{what} '{target}': cannot create {tmp} beside it to write into "
            f"({e.strerror or e}); give a directory in a writable place"
        ) from None
    return tmp


def _checkpoint_kind(folder: Path) -> str | None:
    """``folder`` as a checkpoint directory (``latest``, or committed ``step_*`` folders) or step (index.json)."""
    try:
        if (folder / "latest").exists() or (folder / INDEX).exists():
            return f"a checkpoint {'directory (latest)' if (folder / 'latest').exists() else 'step (index.json)'}"
        steps = [p.name for p in reversed(list_checkpoints(folder)) if (p / INDEX).is_file()]
    except OSError:  # a folder on the way that cannot be searched
        return None
    return f"a checkpoint directory ({', '.join(steps[:3])}{', ...' if len(steps) > 3 else ''})" if steps else None


def _refuse_inside_a_checkpoint(target: Path, what: str) -> None:
    """A new (or empty) ``target`` inside a checkpoint directory or step: the training run prunes and replaces what
    lies there (``convert export ck/step_4 ck/step_4/hf`` was deleted with step 4 by the next save's pruning).
    Where ``refusal`` keeps ``--overwrite`` out, for a folder not written yet (a ``step_*`` folder an export wrote,
    without index.json, does not count: exports may be named by step)."""
    for parent in target.parents:
        kind = _checkpoint_kind(parent)
        if kind:
            raise CheckpointError(
                f"{what} '{target}' lies inside {parent}, {kind}, whose steps a training run prunes with "
                f"everything in them (checkpoint.keep); give a folder outside it"
            )


def resolved(target: Path) -> Path:
    """The real path of ``target``: a symlink is followed (the folder it names is replaced, the link kept)."""
    return Path(os.path.realpath(Path(target).expanduser()))


def finish(tmp: Path, target: Path, what: str = "folder", sources: Iterable[Path] = ()) -> None:
    """Write the marker, make the files of ``tmp`` durable and rename it to ``target`` (an old target, checked
    again, is replaced as a whole)."""
    target = resolved(target)
    (tmp / MARKER).write_text(
        json.dumps({"written_by": f"launch/convert.py ({what})", "files": _files(tmp)}, indent=1) + "\n"
    )
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
    for path in [*(p for p in tmp.rglob("*") if p.is_dir()), tmp]:
        fsync_dir(path)
    if target.is_dir() and any(target.iterdir()):
        reason = refusal(target, sources)  # a run may have started in it since begin
        if reason:
            raise CheckpointError(f"{what} '{target}' {reason} (since this began); nothing was replaced")
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
def written(target: Path, overwrite: bool, what: str, sources: Iterable[Path] = ()) -> Iterator[Path]:
    """``begin``; the caller writes into the folder yielded; ``finish`` (or, on any error, the temporary folder
    is removed and the target is as it was). ``sources``: the folders being read, never replaced."""
    sources = list(sources)
    tmp = begin(target, overwrite, what, sources)
    try:
        yield tmp
        finish(tmp, target, what, sources)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
