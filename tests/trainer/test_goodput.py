"""The goodput ledger (engine/trust/goodput.py): a run that fails mid-way and is resumed through launch/pretrain.py
keeps one out_dir/goodput.json over both starts, counts the restart and the steps re-done (those the first start
trained past the checkpoint the second resumed from), and prints its line at start and at the end. The fault: the
first start's process SIGKILLs itself from the trainer's observer hook in step 5, after the step-3 checkpoint."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from engine.trust.goodput import NAME, Goodput, minutes, read, summary, totals
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


def entry(start: float, first: int, last: int, startup: float, steps: float, saves: float, updated: float, ended):
    times = {"startup_s": startup, "steps_s": steps, "saves_s": saves, "updated": updated}
    return {"start": start, "first_step": first, "last_step": last, **times, "ended": ended}


# a start that failed 30 s before the next one, which resumed from step 3 after it had trained to step 4, then finished
FAILED = entry(0.0, 0, 4, 10.0, 40.0, 5.0, 70.0, None)
RESUMED = entry(100.0, 3, 6, 8.0, 30.0, 4.0, 150.0, "done")


def test_the_ledger_adds_up_each_kind_of_time():
    """totals() of two starts, worked by hand: step 4 re-done (a quarter of the first start's 40 s of steps), the 30 s
    from its last record to the next start lost, the rest of each start's wall time (70 s, 50 s) not in start-up,
    steps or saves counted as evaluation and logging; 60 s trained of 150 s is 40 %."""
    assert totals([FAILED, RESUMED]) == {
        **{"productive": 60.0, "startup": 18.0, "saves": 9.0, "redone": 10.0, "lost": 30.0, "other": 23.0},
        **{"restarts": 1, "redone_steps": 1},
    }
    assert summary([FAILED, RESUMED]) == (
        "goodput 40.0% over 2 starts: lost 30.0 s to 1 restart, 10.0 s re-doing 1 step, 9.0 s saving, 18.0 s "
        "starting, 23.0 s in evaluation and logging (1.0 min training; goodput.json)"
    )
    # at the second start's first step: the first start alone, which the running one's resume point qualifies
    t = totals([FAILED], RESUMED)
    assert (t["productive"], t["redone"], t["redone_steps"], t["lost"], t["restarts"]) == (30.0, 10.0, 1, 30.0, 1)
    # a start that ended on a stop signal lost nothing and is no restart; one that resumed past its last step redid none
    stopped = {**FAILED, "ended": "stopped"}
    later = {**RESUMED, "first_step": 4, "start": 1000.0}
    t = totals([stopped, later])
    assert (t["lost"], t["restarts"], t["redone"], t["redone_steps"], t["productive"]) == (0.0, 0, 0.0, 0, 70.0)
    # a next start that began before this one's last record (another host's clock) lost nothing
    assert totals([{**FAILED, "updated": 100.5}, RESUMED])["lost"] == 0.0
    # the newest checkpoint set aside: a start that trained nothing (resumed from 3, died in step 4) followed by one
    # resuming from 2 re-did nothing of it; one resuming past a start's last step (a copied folder) neither
    died = entry(0.0, 3, 3, 1.0, 0.0, 0.0, 2.0, None)
    for first, nxt in ((died, RESUMED | {"first_step": 2}), (FAILED, RESUMED | {"first_step": 6})):
        t = totals([first, nxt])
        assert (t["redone_steps"], t["redone"]) == (0, 0.0), (first, nxt)
    assert [minutes(x) for x in (59.9, 60.0, 606.0)] == ["59.9 s", "1.0 min", "10.1 min"]
    # a start of under a second: its wall time as it was (0.3 s besides start-up); one of no time at all is 100 %
    assert totals([entry(0.0, 0, 0, 0.2, 0.0, 0.0, 0.5, "done")])["other"] == pytest.approx(0.3)
    assert summary([entry(5.0, 0, 0, 0.0, 0.0, 0.0, 5.0, "done")]).startswith("goodput 100.0% over 1 start: lost 0.0 s")


def test_the_ledger_file_is_kept_across_starts_and_dropped_once_on_a_failed_write(tmp_path, capsys):
    """Goodput in-process: a second start reads the first's entries and prints the ledger so far at its first step;
    a write that fails (out_dir gone) is said once and the ledger is no longer kept in that start."""
    out = tmp_path / "out"
    out.mkdir()
    first = Goodput(str(out), True, 0, 0.0)
    first.begin()
    first.step(1, 2.0, write=True)
    assert "goodput" not in capsys.readouterr().out  # nothing earlier to print
    second = Goodput(str(out), True, 1, 0.0)
    assert [e["first_step"] for e in second.entries] == [0, 1]
    assert (second.entries[0]["last_step"], second.entries[0]["steps_s"], second.entries[0]["saves_s"]) == (1, 2.0, 0.0)
    second.begin()
    so_far = capsys.readouterr().out
    assert so_far.startswith("goodput ") and " over 1 start: " in so_far and so_far.endswith(" so far\n"), so_far
    (out / "goodput.json").unlink()
    out.rmdir()
    second.saved(1.0)
    second.end("done")
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("goodput")]
    assert len(said) == 1 and "the ledger is no longer kept in this start" in said[0], said


def test_start_up_is_the_time_from_the_process_start_to_the_first_step(tmp_path):
    """begin() records start-up as now minus the process's start, written with the ledger: a process that began
    2 s ago has started for 2 s (not its start's epoch seconds plus now), and later steps do not change it."""
    started = time.time() - 2.0
    ledger = Goodput(str(tmp_path), True, 0, started)
    ledger.begin()
    ledger.step(1, 0.5, write=True)
    (me,) = read(tmp_path / NAME)
    assert 2.0 <= me["startup_s"] < 30.0, me


def test_overlapping_timers_count_no_negative_time_and_a_short_start_has_its_share():
    """A start whose start-up, steps and saves add up to more than its wall time (the step clock and the start-up's
    end overlap by a hair, or a save timed twice) spends 0 s in evaluation and logging, not a negative figure; a
    start of under a second has its real share (0.4 s trained of 0.8 s is 50 %), not 100 % as a start of no time."""
    over = entry(0.0, 0, 2, 0.5, 1.0, 0.0, 1.2, "done")  # 1.5 s of parts in 1.2 s
    assert totals([over])["other"] == 0.0
    assert " 0.0 s in evaluation and logging " in summary([over]), summary([over])
    short = entry(0.0, 0, 1, 0.4, 0.4, 0.0, 0.8, "done")
    assert summary([short]).startswith("goodput 50.0% over 1 start: "), summary([short])
