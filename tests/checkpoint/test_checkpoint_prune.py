"""checkpoint.keep and steps above the start (issue 23, item 1), end to end through launch/pretrain.py.

- Another run's valid steps above this run's start (``resume none``): refused with one line and exit 2, the
  directory untouched. Before: the new save was pruned at once and ``latest`` named a deleted step (exit 0).
- A corrupt newest step that ``resume: auto`` skips: set aside (not deleted), so that ``keep 1`` keeps the new save
  and a restart resumes from it with the losses of an uninterrupted run. Before: ``keep 1`` deleted the step
  resumed from and the new save, kept the corrupt one, and the restart found no usable checkpoint.
- publish's pruning alone (the start-up check above makes the end-to-end runs pass without it): only steps below
  the committed one are candidates, and each removal is named.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from engine.checkpoint.publish import publish, staging_dir
from tests.checkpoint.runs import SAME, SMALL, assert_curves
from tests.cli import run_script


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
    ok(pretrain(tmp_path / "old", ckpt, "--train.steps", "6", "--checkpoint.every", "3", "--checkpoint.keep", "0"))
    before = listing(ckpt)
    assert before == {"step_000003": "", "step_000006": "", "latest": "step_000006\n"}
    out = pretrain(
        tmp_path / "new", ckpt, "--train.steps", "3", "--checkpoint.resume", "none", "--checkpoint.keep", "1"
    )
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "step_000003, step_000006" in lines[0] and "another checkpoint.dir" in lines[0], lines[0]
    assert "checkpoint.resume=auto" in lines[0], lines[0]
    assert listing(ckpt) == before, "the refused run changed checkpoint.dir"


def test_corrupt_newest_is_set_aside_and_keep_1_keeps_the_good_lineage(tmp_path):
    ckpt = tmp_path / "ckpt"
    ok(pretrain(tmp_path / "full", ckpt, "--train.steps", "6", "--checkpoint.every", "3", "--checkpoint.keep", "0"))
    full = losses(tmp_path / "full")  # the uninterrupted run: steps 1..6
    shard = ckpt / "step_000006" / "rank_00000.safetensors"
    with open(shard, "r+b") as f:  # a truncated newest checkpoint: resume: auto falls back to step 3
        f.truncate(shard.stat().st_size // 2)
    keep1 = ["--checkpoint.every", "1", "--checkpoint.keep", "1", "--checkpoint.resume", "auto"]
    first = pretrain(tmp_path / "a", ckpt, "--train.steps", "4", *keep1)  # as if killed after step 4's save
    ok(first)
    assert f"resumed from {ckpt / 'step_000003'}" in first.stdout, first.stdout[-3000:]
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
    # The corrupt step was moved aside whole, with one line; the prunes were named.
    aside = list((ckpt / "set_aside").iterdir())
    assert [p.name.split("-")[0] for p in aside] == ["step_000006"] and (aside[0] / shard.name).is_file()
    assert first.stdout.count("checkpoint: set aside") == 1, first.stdout[-3000:]
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
