"""Which checkpoints a resume or an export tries: a user-given PATH, or ``checkpoint.dir``'s ``latest`` and then its
``step_*`` directories, newest first (engine/checkpoint/checkpointer.py validates each in turn).

``latest`` is read defensively: a file that cannot be read, is not text or does not hold a ``step_*`` name of its
own directory (publish, engine/checkpoint/publish.py, writes nothing else) is a damaged pointer, not a path to
follow. Under ``resume: auto`` it costs one line and the step directories are tried without it (issue 34: it was
a traceback, and a name like ``../x`` would have been followed out of the directory); for an explicit PATH or an
export it is one CheckpointError.
"""

from __future__ import annotations

from pathlib import Path

from engine.checkpoint.format import INDEX, CheckpointError
from engine.checkpoint.publish import STEP_DIR, list_checkpoints


def resolve(path: Path, what: str = "checkpoint path") -> list[Path]:
    """A user-given PATH: a checkpoint (has index.json) or a checkpoint directory (follow ``latest``)."""
    try:
        return _resolve(path, what)
    except OSError as e:  # a directory on the way that cannot be searched
        raise CheckpointError(f"{what} '{path}' cannot be read ({e.strerror or e})") from None


def _resolve(path: Path, what: str) -> list[Path]:
    if not path.exists():
        raise CheckpointError(
            f"{what} '{path}' does not exist; give a step_* directory or a checkpoint directory with a 'latest' file"
        )
    if (path / INDEX).exists() or STEP_DIR.match(path.name):
        return [path]
    if (path / "latest").exists():
        named, error = read_latest(path)
        if error is not None:
            raise CheckpointError(f"{what} '{path}': {error}; give a step_* directory instead")
        return [named]
    raise CheckpointError(f"{what} '{path}' has neither {INDEX} nor a 'latest' file")


def read_latest(root: Path) -> tuple[Path | None, str | None]:
    """The step ``root/latest`` names, or (None, why it names none)."""
    latest = root / "latest"
    try:
        name = latest.read_bytes().decode().strip()
    except OSError as e:
        return None, f"cannot read {latest} ({e.strerror or e})"
    except UnicodeDecodeError:
        return None, f"{latest} is not text (a damaged file)"
    if not STEP_DIR.match(name):
        return None, f"{latest} holds {name[:40]!r}, not the name of a step_* directory"
    return root / name, None


def to_try(mode: str, root: Path | None, announce: bool) -> list[Path]:
    """The checkpoints ``checkpoint.resume`` = ``mode`` tries, in order; ``announce``: print the line on a damaged
    ``latest`` (rank 0)."""
    if mode == "none":
        return []
    if mode != "auto":
        return resolve(Path(mode), "checkpoint.resume")
    if root is None:
        return []
    found = list_checkpoints(root)
    if not (root / "latest").exists():
        return found
    named, error = read_latest(root)
    if error is not None:  # the step_* directories still say what there is, newest first
        if announce:
            print(
                f"checkpoint: ignoring {root / 'latest'}: {error}; trying the step_* directories, newest first",
                flush=True,
            )
        return found
    return [named] + [p for p in found if p != named]
