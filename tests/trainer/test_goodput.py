"""The goodput ledger (engine/trust/goodput.py): a run that fails mid-way and is resumed through launch/pretrain.py
keeps one out_dir/goodput.json over both starts, counts the restart and the steps re-done (those the first start
trained past the checkpoint the second resumed from), and prints its line at start and at the end. The fault: the
first start's process SIGKILLs itself from the trainer's observer hook in step 5, after the step-3 checkpoint."""

from __future__ import annotations

import json
import os
import signal

import pytest

from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.cli import run_script
from tests.dist import run_ranks
from tests.shrunk import FIVE_STEPS


def killed_run(argv: list[str], at: int) -> None:
    """Rank function: train until step ``at``'s update, where the process is killed (SIGKILL: nothing runs after)."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))

    def fault(event: str) -> None:
        if event == "update" and trainer.step + 1 == at:
            os.kill(os.getpid(), signal.SIGKILL)

    trainer.observers.append(fault)
    trainer.fit()


def test_ledger_counts_a_restart_and_the_steps_redone(tmp_path):
    argv = [*FIVE_STEPS, "--train.steps", "6", "--checkpoint.every", "3", "--log.every", "1"]
    argv += ["--train.out_dir", str(tmp_path / "out"), "--checkpoint.dir", str(tmp_path / "ckpt")]
    with pytest.raises(Exception):  # the rank died of SIGKILL
        run_ranks(killed_run, 1, argv, 5)
    first = json.loads((tmp_path / "out" / "goodput.json").read_text())["starts"]
    assert [(s["first_step"], s["last_step"], s["ended"]) for s in first] == [(0, 4, None)]
    r = run_script("launch/pretrain.py", *argv)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("goodput ")]
    assert len(lines) == 2, r.stdout
    # at start: the first start's time, which the restart and the resume point already qualify
    assert " over 1 start: lost " in lines[0] and lines[0].endswith(" so far"), lines[0]
    for line in lines:  # step 4 was trained, then the run resumed from step 3
        assert " to 1 restart, " in line and " re-doing 1 step, " in line, line
    assert " over 2 starts: lost " in lines[1], lines[1]
    starts = json.loads((tmp_path / "out" / "goodput.json").read_text())["starts"]
    assert [(s["first_step"], s["last_step"], s["ended"]) for s in starts] == [(0, 4, None), (3, 6, "done")]
    assert starts[1]["saves_s"] > 0 and starts[1]["startup_s"] > 0 and starts[0]["steps_s"] > 0


def test_log_goodput_false_keeps_no_ledger(tmp_path):
    """log.goodput false: the run trains and logs, with no goodput.json and no goodput line."""
    r = run_script(
        "launch/pretrain.py",
        *FIVE_STEPS,
        "--train.steps",
        "2",
        "--log.goodput",
        "false",
        "--train.out_dir",
        str(tmp_path / "out"),
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "metrics.jsonl").is_file() and not (tmp_path / "out" / "goodput.json").exists()
    assert "goodput " not in r.stdout, r.stdout
