"""What the checkpointer (engine/checkpoint/checkpointer.py) says and does at a resume and a failed save, in process:

- ``resume: auto`` with a damaged ``latest`` names it once (rank 0) and goes on with the step directories;
- a fresh start (``resume: none``) sets aside the unusable steps above step 0, not step 0 itself (a model-only
  import's step), and names the step it starts from; at two ranks rank 0 alone moves them;
- a set-aside that cannot move the steps is one CheckpointError naming the folder, not an OSError's traceback;
- a resume checked against its digests refuses a probe loss beyond fp32's bound (one within bf16's looser bound:
  the check follows train.dtype), and a clean resume at the same layout says one line;
- a due save that fails raises its own line, prefixed by the failed metrics write that stopped the run if one did,
  and gives checkpoint.dir's lock back.

Issue 45: the mutants that made each of these pass silently survived the module's end-to-end tests. The first three
run a Checkpointer at rank 0 of 1 (no training, well under a second); the next two one rank's Trainer in a fork,
the last two forked ranks' Checkpointers.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.checkpoint.checkpointer import Checkpointer, CheckpointError
from engine.checkpoint.parts import RunPosition
from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from engine.trust.saved import FIELD
from tests.checkpoint.runs import SMALL, edit_index
from tests.dist import run_ranks


def _checkpointer(ckpt: Path, *args: str) -> Checkpointer:
    out_dir = ckpt.parent / "out"  # beside checkpoint.dir in tmp_path, not the default runs/tiny of the checkout
    cfg = load(["--checkpoint.dir", str(ckpt), "--train.out_dir", str(out_dir), *args])
    return Checkpointer(cfg, SimpleNamespace(rank=0, world_size=1))


def _resume(ckpt: Path, mode: str):
    """(resume's return, what it printed): a start with nothing resumable never touches the parts."""
    ckpt.mkdir(exist_ok=True)
    checkpointer = _checkpointer(ckpt, "--checkpoint.resume", mode)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as said:
            got = checkpointer.resume(None)
    finally:
        checkpointer.release()
    return got, said.getvalue()


def test_a_damaged_latest_is_named_once_and_auto_starts_fresh(tmp_path):
    """The line that says why ``latest`` was not followed comes from rank 0 (before: a mutant that gave the
    announcement to no rank, or to the others, passed)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("../elsewhere\n")
    got, said = _resume(ckpt, "auto")
    assert got is None, got
    assert said.splitlines() == [
        f"checkpoint: ignoring {ckpt / 'latest'}: {ckpt / 'latest'} holds '../elsewhere', not the name of a "
        "step_* directory; trying the step_* directories, newest first"
    ], said


def test_a_fresh_start_sets_aside_the_unusable_steps_above_step_0_only(tmp_path):
    """``resume: none`` starts at step 0: an unusable step 1 is moved aside (it would outrank this run's saves),
    step 0 stays where it is (before: mutants that settled above step 1 or above step -1 passed)."""
    ckpt = tmp_path / "ckpt"
    for step in (0, 1):
        (ckpt / f"step_{step:06d}").mkdir(parents=True)  # no index.json: unusable
    got, said = _resume(ckpt, "none")
    assert got is None, got
    assert sorted(p.name for p in ckpt.iterdir() if p.name != "LOCK") == ["set_aside", "step_000000"]
    assert [p.name.split("-")[0] for p in (ckpt / "set_aside").iterdir()] == ["step_000001"]
    lines = said.splitlines()
    assert len(lines) == 1 and "it lies above step 0, where this run starts" in lines[0], said


def test_a_set_aside_that_cannot_move_the_steps_is_one_checkpoint_error(tmp_path):
    """``set_aside`` a file (a user's, a sync tool's): the unusable step cannot be moved, and the run is refused
    with one line naming the folder (before: a mutant that let the OSError through as a traceback passed)."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_000003").mkdir(parents=True)
    (ckpt / "set_aside").write_text("not a folder\n")
    with pytest.raises(CheckpointError, match=f"cannot set aside the unusable steps above step 0 in {ckpt}: "):
        _resume(ckpt, "none")
    assert (ckpt / "step_000003").is_dir()


def _probe_resumes(root: str) -> dict:
    """Rank function (1 rank): a step and its due save (what it printed); a clean resume of it (what it printed),
    then the same resume with the saved probe loss moved by rel 1e-3 (over fp32's bound 2e-5, under bf16's 4e-3):
    its refusal."""
    argv = ["--checkpoint.dir", root, "--checkpoint.every", "1", "--train.out_dir", f"{root}/o"]
    cfg = load([*SMALL, *argv])
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    trainer.train_step(trainer.next_local_batch())
    with contextlib.redirect_stdout(io.StringIO()) as said:  # no streak, no stop: the save's line alone
        trainer.checkpointer.after_step(trainer.parts, RunPosition(1, 16), streak=0, agreed=False)
    trainer.checkpointer.finish()
    path = Path(root) / "step_000001"
    out = {"path": str(path), "saved": said.getvalue()}
    again = load([*SMALL, "--checkpoint.resume", str(path), "--train.out_dir", f"{root}/a"])
    with contextlib.redirect_stdout(io.StringIO()) as said:
        Trainer(again, ParallelContext.from_config(again)).checkpointer.finish()
    out["clean"] = said.getvalue()
    edit_index(path, lambda index: index[FIELD].update(probe_loss=index[FIELD]["probe_loss"] * (1 + 1e-3)))
    moved = load([*SMALL, "--checkpoint.resume", str(path), "--train.out_dir", f"{root}/b"])
    try:
        Trainer(moved, ParallelContext.from_config(moved))
    except CheckpointError as e:
        out["moved"] = str(e)
    return out


def test_a_save_and_a_clean_resume_say_one_line_each_and_a_probe_loss_beyond_fp32s_bound_is_refused(tmp_path):
    """checkpoint.verify at train.dtype fp32: the probe batch's loss is compared, at fp32's bound (before: mutants
    that skipped the probe loss at the same batch, took bf16's bound for fp32 weights, or called every save a
    skipped step of a NaN streak, passed)."""
    got = run_ranks(_probe_resumes, 1, str(tmp_path / "c"), timeout_s=300)[0]
    assert got["saved"].splitlines() == [f"checkpoint: saved {got['path']}"], got["saved"]
    lines = got["clean"].splitlines()  # the trainer's start-up lines, then the resume's: the same layout, no change
    resumed = [i for i, line in enumerate(lines) if line.startswith(f"resumed from {got['path']} (step 1, saved at ")]
    assert len(resumed) == 1 and lines[resumed[0] :] == lines[-1:], lines
    assert "the probe batch's loss " in got.get("moved", ""), got
    assert "(beyond rel 2e-05)" in got["moved"], got["moved"]


def _failed_saves(root: str) -> dict:
    """Rank function (1 rank): a due save whose staging folder cannot be made (a file in its place), alone and
    after a failed metrics write stopped the run: what each raised, and whether checkpoint.dir's LOCK was left."""
    cfg = load([*SMALL, "--checkpoint.dir", root, "--checkpoint.every", "1", "--train.out_dir", f"{root}/o"])
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    out = {}
    for step, failure in ((1, None), (2, "cannot write 'metrics.jsonl' (No space left on device)")):
        checkpointer = Checkpointer(cfg, trainer.ctx) if step > 1 else trainer.checkpointer
        (Path(root) / f"step_{step:06d}.tmp-{checkpointer.token}").write_text("in the way\n")
        if failure is not None:
            checkpointer.stop.fail(failure)  # as the metrics writer does (engine/metrics/logger.py)
        try:
            checkpointer.after_step(trainer.parts, RunPosition(step, 16 * step), agreed=failure is not None)
        except CheckpointError as e:
            out[step] = (type(e).__name__, str(e), (Path(root) / "LOCK").exists())
    return out


def test_a_failed_save_ends_the_run_with_its_line_and_the_directories_given_back(tmp_path):
    """A save that fails raises its own StorageError (exit 3), prefixed by the failed metrics write that stopped the
    run if one did, and gives checkpoint.dir's lock back either way (before: mutants that prefixed every failure
    with 'None; and', dropped the metrics line, or kept the lock passed)."""
    got = run_ranks(_failed_saves, 1, str(tmp_path / "c"), timeout_s=300)[0]
    assert set(got) == {1, 2}, got
    kind, line, locked = got[1]
    assert (kind, locked) == ("StorageError", False) and line.startswith("checkpoint: rank 0 could not save step 1"), (
        got
    )
    kind, line, locked = got[2]
    assert (kind, locked) == ("StorageError", False), got
    assert line.startswith(
        "cannot write 'metrics.jsonl' (No space left on device); and checkpoint: rank 0 could not save step 2"
    ), line


def _fresh_start_rank(ckpt: str) -> str | None:
    """Rank function (2 ranks): resume none beside an unusable step 1; the error this rank's resume raised, if any."""
    import torch.distributed as dist

    cfg = load(["--checkpoint.dir", ckpt, "--train.out_dir", f"{ckpt}/../o", "--checkpoint.resume", "none"])
    checkpointer = Checkpointer(cfg, SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size()))
    try:
        checkpointer.resume(None)
    except CheckpointError as e:
        return str(e)
    finally:
        checkpointer.release()
    return None


def test_rank_0_alone_sets_aside_the_unusable_steps_of_two_ranks(tmp_path):
    """Every rank finds the same unusable steps, but only rank 0 moves them (before: a mutant that let every rank
    with steps to move do it passed; the second rank's rename of a step already moved failed the start-up)."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_000001").mkdir(parents=True)  # no index.json: unusable
    assert run_ranks(_fresh_start_rank, 2, str(ckpt), timeout_s=120) == [None, None]
    assert [p.name.split("-")[0] for p in (ckpt / "set_aside").iterdir()] == ["step_000001"]
