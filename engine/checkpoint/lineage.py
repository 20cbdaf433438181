"""Start-up: checkpoints in ``checkpoint.dir`` above the step this run starts from, handled before the first save.

Why: a directory may hold steps above this run's start: another run's (``checkpoint.resume none``, or a PATH to
an older step), or corrupt ones that ``resume: auto`` skipped. Saving beside them mixes two lineages, and pruning
(engine/checkpoint/publish.py ``prune``) or a later ``resume: auto`` would then pick by step number across them:
the new save was pruned at once, or a restart resumed another run's weights. The policy, per step above the start:
  - it does not validate (index, sizes, CRCs, pieces: what resume checks): it is moved, never deleted, to
    ``<dir>/set_aside/step_NNNNNN-<run token>/`` with a ``SET_ASIDE.txt`` saying why, and one line on rank 0.
    Nothing can resume from it, and keeping it in place would let it outrank the good steps this run writes;
  - it validates: the run is refused (CheckpointError, exit 2) naming the steps and the ways out, and nothing in
    the directory is touched: which of two good lineages the user wants cannot be guessed. (Under ``auto`` this
    means ``latest`` names a step below a valid one: a directory two runs wrote, or a crash in the instant between
    a save's rename and its ``latest``; the line names the step to give as checkpoint.resume.)
Afterwards every step in the directory is at or below the start, so ``prune`` and ``resume: auto`` see one lineage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from engine.checkpoint.format import CheckpointError
from engine.checkpoint.publish import list_checkpoints, step_of

SET_ASIDE = "set_aside"


def settle(
    root: Path, start: int, mode: str, validate: Callable[[Path], str | None], known: dict[Path, str]
) -> dict[Path, str]:
    """Collective (``validate`` is): the steps of ``root`` above ``start`` and why each is unusable; raises the
    refusal (on every rank alike) if any validates. ``known``: the errors resume already found (not validated
    twice); ``mode``: checkpoint.resume, for the refusal's advice."""
    above = [p for p in list_checkpoints(root) if step_of(p) > start]  # newest first
    errors = {p: known[p] if p in known else validate(p) for p in above}
    good = [p.name for p in above if errors[p] is None]
    if good:
        way = (
            f"resume from it with checkpoint.resume={root / good[0]}"
            if mode == "auto"
            else "continue the newest with checkpoint.resume=auto"
        )
        raise CheckpointError(
            f"checkpoint.dir '{root}' holds valid checkpoints above step {start}, where this run "
            f"starts: {', '.join(reversed(good))}; saving beside another run's steps would mix "
            f"them (and prune the wrong ones): use another checkpoint.dir, move them out of "
            f"'{root}', or {way}"
        )
    return errors


def set_aside(root: Path, start: int, unusable: dict[Path, str], token: str) -> None:
    """One process (rank 0): move each unusable step to ``root/set_aside/<name>-<token>``, with one line each."""
    for path, error in unusable.items():
        dest = root / SET_ASIDE / f"{path.name}-{token}"
        dest.parent.mkdir(exist_ok=True)
        path.rename(dest)
        try:
            (dest / "SET_ASIDE.txt").write_text(f"set aside at start-up by run {token}: {error}\n")
        except OSError:  # the note is a courtesy; the rename is what matters
            pass
        print(
            f"checkpoint: set aside {path} as {dest}: it lies above step {start}, where this run starts, and is "
            f"unusable ({error})",
            flush=True,
        )
