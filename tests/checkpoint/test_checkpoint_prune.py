"""checkpoint.keep and steps above the start (issue 23, item 1), end to end through launch/pretrain.py.

- Another run's valid steps above this run's start (``resume none``): refused with one line and exit 2, the
  directory untouched. Before: the new save was pruned at once and ``latest`` named a deleted step (exit 0).
- Corrupt newest steps that ``resume: auto`` skips: set aside (not deleted), so that ``keep 1`` keeps the new save
  and a restart resumes from it with the losses of an uninterrupted run. Before: ``keep 1`` deleted the step
  resumed from and the new save, kept the corrupt one, and the restart found no usable checkpoint.
- publish's pruning alone (the start-up check above makes the end-to-end runs pass without it): only steps below
  the committed one are candidates, and each removal is named.
- Issue 42 item 11: a streak of skipped NaN steps saves nothing periodic and prunes nothing; a step folder as
  checkpoint.dir is refused; a step pruning cannot delete is named so; a resume with another tokenizer, corpus or
  seed says so in one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from engine.checkpoint.publish import publish, staging_dir
from tests.checkpoint.runs import SAME, SMALL, assert_curves, read_only
from tests.cli import ROOT, one_error_line, run_script


def pretrain(out_dir: Path, ckpt: Path, *args: str) -> subprocess.CompletedProcess:
    """One process of launch/pretrain.py on SMALL's model, its metrics in ``out_dir``."""
    return run_script(
        "launch/pretrain.py", *SMALL, "--train.out_dir", out_dir, "--checkpoint.dir", ckpt, *args, timeout=600
    )  # a fork of the test process (tests/cli.py): the script as a user runs it


def losses(out_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def listing(ckpt: Path) -> dict[str, str]:
    """Every step directory and ``latest``'s text: what a run must leave (or not) in checkpoint.dir."""
    return {p.name: (p.read_text() if p.is_file() else "") for p in ckpt.iterdir() if p.name != "LOCK"}


def ok(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_resume_none_beside_another_runs_newer_steps_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ok(pretrain(tmp_path / "old", ckpt, "--train.steps", "6", "--checkpoint.every", "2", "--checkpoint.keep", "0"))
    before = listing(ckpt)
    assert before == {"step_000002": "", "step_000004": "", "step_000006": "", "latest": "step_000006\n"}
    out = pretrain(
        tmp_path / "new", ckpt, "--train.steps", "3", "--checkpoint.resume", "none", "--checkpoint.keep", "1"
    )
    line = one_error_line(out, "step_000002, step_000004, step_000006", "another checkpoint.dir")
    assert "checkpoint.resume=auto" in line, line
    assert listing(ckpt) == before, "the refused run changed checkpoint.dir"
    # resume: auto, `latest` naming a step below two valid ones (two runs wrote the folder, or a crash between a
    # save's rename and its `latest`): refused, and the step to give is the newest valid one (issue 45: the advice
    # named another)
    (ckpt / "latest").write_text("step_000002\n")
    before = listing(ckpt)
    line = one_error_line(pretrain(tmp_path / "auto", ckpt, "--train.steps", "8"), "step_000004, step_000006")
    assert f"resume from it with checkpoint.resume={ckpt / 'step_000006'};" in line + ";", line
    assert listing(ckpt) == before, "the refused run changed checkpoint.dir"


def test_corrupt_newest_is_set_aside_and_keep_1_keeps_the_good_lineage(tmp_path):
    ckpt = tmp_path / "ckpt"
    ok(pretrain(tmp_path / "full", ckpt, "--train.steps", "6", "--checkpoint.every", "3", "--checkpoint.keep", "0"))
    full = losses(tmp_path / "full")  # the uninterrupted run: steps 1..6
    shard = ckpt / "step_000006" / "rank_00000.safetensors"
    with open(shard, "r+b") as f:  # a truncated newest checkpoint: resume: auto falls back to step 3
        f.truncate(shard.stat().st_size // 2)
    shutil.copytree(ckpt / "step_000006", ckpt / "step_000007")  # a second unusable step above it
    keep1 = ["--checkpoint.every", "1", "--checkpoint.keep", "1", "--checkpoint.resume", "auto"]
    first = pretrain(tmp_path / "a", ckpt, "--train.steps", "4", *keep1)  # as if killed after step 4's save
    ok(first)
    assert f"resumed from {ckpt / 'step_000003'}" in first.stdout, first.stdout[-3000:]
    skipped = [line.split(":")[1] for line in first.stdout.splitlines() if line.startswith("checkpoint: skipping ")]
    assert skipped == [f" skipping {ckpt / 'step_000006'}", f" skipping {ckpt / 'step_000007'}"], first.stdout[-3000:]
    assert {k: v for k, v in listing(ckpt).items() if k != "set_aside"} == {
        "step_000004": "",
        "latest": "step_000004\n",
    }, first.stdout[-3000:]
    restart = pretrain(tmp_path / "b", ckpt, "--train.steps", "6", *keep1)
    ok(restart)
    assert f"resumed from {ckpt / 'step_000004'}" in restart.stdout, restart.stdout[-3000:]
    got = {**losses(tmp_path / "a"), **losses(tmp_path / "b")}
    assert sorted(got) == [4, 5, 6], got
    assert_curves([got[s] for s in (4, 5, 6)], [full[s] for s in (4, 5, 6)], SAME, "resumed vs uninterrupted")
    assert {k: v for k, v in listing(ckpt).items() if k != "set_aside"} == {
        "step_000006": "",
        "latest": "step_000006\n",
    }
    # The corrupt steps were moved aside whole, both into one set_aside folder (issue 45: the second crashed on
    # the folder the first made), with one line each; the prunes were named.
    aside = sorted((ckpt / "set_aside").iterdir())
    assert [p.name.split("-")[0] for p in aside] == ["step_000006", "step_000007"], aside
    assert all((p / shard.name).is_file() for p in aside), aside
    assert first.stdout.count("checkpoint: set aside") == 2, first.stdout[-3000:]
    assert f"checkpoint: pruned {ckpt / 'step_000003'}" in first.stdout, first.stdout[-3000:]


def test_prune_spares_the_new_checkpoint_and_steps_above_it(tmp_path, capsys):
    root = tmp_path / "ckpt"
    for step in (1, 2, 3, 6):  # step 6: whatever it is, a step above the new one is not this save's to delete
        (root / f"step_{step:06d}").mkdir(parents=True)
    staging_dir(root, 4, "run")
    publish(root, 4, "run", {"step": 4}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000003", "step_000004", "step_000006"]
    assert (root / "latest").read_text() == "step_000004\n"
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        f"checkpoint: pruned {root / name} (checkpoint.keep=2; kept step_000004 and 1 older)"
        for name in ("step_000002", "step_000001")
    ], printed


DIVERGES = ["--checkpoint.every", "1"]


def _nan_from_step(monkeypatch, first: int) -> None:
    """The loss and every gradient NaN from step ``first`` on, as a diverged run's are: a forward hook on the final
    norm multiplies its output by NaN (tests/trainer/test_bad_steps.py's injection), registered when the launcher
    builds its Trainer in run_script's fork of this process (train.lr is bounded to [0, 1] now, so a huge lr no
    longer diverges it)."""
    from engine.trainer import Trainer

    build = Trainer.__init__

    def init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        hook = lambda module, a, out: out * float("nan") if self.step + 1 >= first else out  # noqa: E731
        self.model.model.norm.register_forward_hook(hook)

    monkeypatch.setattr(Trainer, "__init__", init)


def test_a_nan_streak_never_prunes_the_checkpoints_before_it(tmp_path, monkeypatch):
    """Issue 42 item 11: saves went on through a streak of skipped NaN steps, so ``keep 3`` pruned the steps
    before it for steps holding the weights that diverged, and the abort's advice (resume from an earlier
    checkpoint) had none left. Inside a streak a periodic save is skipped, and the last step's (or a stop's) is
    saved without pruning: here steps 4-5 are skipped, step 4 is not saved, step 5 (the last) is, beside 2 and 3
    (before: step 5 and step 4, which pruned 2 and 3)."""
    ckpt = tmp_path / "ckpt"
    _nan_from_step(monkeypatch, 4)
    out = pretrain(
        tmp_path / "o", ckpt, *DIVERGES, "--checkpoint.keep", "2", "--train.max_bad_steps", "0", "--train.steps", "5"
    )
    ok(out)
    assert "step 4: loss is not finite" in out.stdout, out.stdout[-3000:]
    assert sorted(listing(ckpt)) == ["latest", "step_000002", "step_000003", "step_000005"], out.stdout[-3000:]
    assert "checkpoint: step 4 is skipped step 1 of a streak (NaN/inf loss or gradient): not saved" in out.stdout
    assert "checkpoint: step 5 is skipped step 2 of a streak (NaN/inf loss or gradient): saved without pruning" in (
        out.stdout
    )
    assert "stop signal" not in out.stdout, out.stdout[-3000:]  # a run that was not signalled never says it stopped


def test_a_step_folder_as_checkpoint_dir_is_refused(tmp_path):
    """Issue 42 item 11: ``--checkpoint.dir ck/step_000001`` started again at step 1 and saved its steps inside
    that step, which the next pruning deletes with them."""
    ckpt = tmp_path / "ckpt"
    ok(pretrain(tmp_path / "o", ckpt, "--train.steps", "1"))
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    for bad in (ckpt / "step_000001", ckpt / "step_000001" / "sub"):
        out = pretrain(tmp_path / "o2", bad, "--train.steps", "2")
        one_error_line(out, f"checkpoint.dir '{bad}'", f"a checkpoint step of {ckpt}", f"checkpoint.dir={ckpt}")
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


def test_a_step_that_cannot_be_pruned_is_named_so(tmp_path):
    """Issue 42 item 11: pruning said "pruned" of a step it could not delete (rmtree ignored the errors)."""
    ckpt = tmp_path / "ckpt"
    ok(pretrain(tmp_path / "o", ckpt, "--train.steps", "2", "--checkpoint.every", "1", "--checkpoint.keep", "0"))
    with read_only(ckpt / "step_000001"):
        out = pretrain(tmp_path / "o", ckpt, "--train.steps", "3", "--checkpoint.every", "1", "--checkpoint.keep", "1")
    ok(out)
    assert f"checkpoint: pruned {ckpt / 'step_000002'}" in out.stdout, out.stdout[-3000:]
    assert f"checkpoint: pruned {ckpt / 'step_000001'}" not in out.stdout, out.stdout[-3000:]
    assert f"checkpoint: could not prune {ckpt / 'step_000001'}" in out.stdout and "delete it by hand" in out.stdout
    assert sorted(listing(ckpt)) == ["latest", "step_000001", "step_000003"]


def test_a_resume_with_another_tokenizer_corpus_or_seed_says_so(tmp_path):
    """Issue 42 item 11: a resume with another tokenizer, corpus or seed said nothing; one line names each."""
    ckpt = tmp_path / "ckpt"
    ok(pretrain(tmp_path / "o", ckpt, "--train.steps", "1"))
    same = pretrain(tmp_path / "o", ckpt, "--train.steps", "2")
    ok(same)
    assert "the checkpoint's run had the first" not in same.stdout, same.stdout[-3000:]
    tokenizer, corpus = ROOT / "engine" / "assets" / "tokenizer", ROOT / "engine" / "assets" / "corpus.txt"
    out = pretrain(
        tmp_path / "o",
        ckpt,
        "--train.steps",
        "3",
        "--train.seed",
        "7",
        "--data.tokenizer",
        tokenizer,
        "--data.paths",
        f"[{corpus}]",
    )
    ok(out)
    notes = [line for line in out.stdout.splitlines() if "the checkpoint's run had the first" in line]
    assert len(notes) == 1, out.stdout[-3000:]
    for change in (f"data.tokenizer '' -> '{tokenizer}'", f"data.paths [] -> ['{corpus}']", "train.seed 1234 -> 7"):
        assert change in notes[0], notes[0]


def test_a_step_is_set_aside_even_where_its_note_cannot_be_written(tmp_path, capsys):
    """The note beside a set-aside step is a courtesy: where it cannot be written (here its name is taken by a
    directory; a disk filling between the move and the note) the step is still moved and named in one line, and
    the start-up goes on (an error here would end a run that has a good checkpoint to resume)."""
    from engine.checkpoint.lineage import SET_ASIDE, set_aside

    step = tmp_path / "step_00000009"
    (step / "SET_ASIDE.txt").mkdir(parents=True)  # the note's name taken
    set_aside(tmp_path, 4, {step: "its index.json is missing"}, "tok")
    moved = tmp_path / SET_ASIDE / "step_00000009-tok"
    assert moved.is_dir() and not step.exists() and (moved / "SET_ASIDE.txt").is_dir()
    said = capsys.readouterr().out
    assert (
        f"checkpoint: set aside {step} as {moved}: it lies above step 4" in said
        and "(its index.json is missing)" in said
    )
