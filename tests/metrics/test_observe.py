"""What a run leaves to look at (issue 17): TensorBoard events equal to metrics.jsonl, metrics without the
rolled-back steps of a crash, and launch/plot.py's picture of several runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine.config import load
from engine.metrics.logger import MetricsLogger
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.cli import ROOT, one_error_line, run_script
from tests.dist import run_ranks
from tests.shrunk import FIVE_STEPS


def _records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _train(argv: list[str]) -> None:
    cfg = load(argv)
    Trainer(cfg, ParallelContext.from_config(cfg)).fit()


def _fit(argv: list[str]) -> None:
    """Train in one forked rank (tests/dist.py): a process group or multi-threaded torch ops left in the pytest
    process would break every later test's forked ranks."""
    run_ranks(_train, 1, argv)


def test_tensorboard_events_equal_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _fit([*FIVE_STEPS, "--train.out_dir", str(tmp_path), "--log.tensorboard", "true", "--train.eval_every", "2"])
    records = _records(tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss/train",
        "loss/eval",
        "lr",
        "grad_norm",
        "throughput/tokens_per_s",
        "memory/peak_GiB",
        "time/forward_s",
        "time/optimizer_s",
    } <= tags, tags
    for tag, key in (("loss/train", "loss"), ("loss/eval", "eval_loss"), ("lr", "lr")):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        want = [(r["step"], r[key]) for r in records if key in r]
        assert [s for s, _ in got] == [s for s, _ in want]
        # Event files store float32: equal up to float32 rounding (relative 2**-24).
        assert all(abs(g - w) <= 2**-23 * abs(w) for (_, g), (_, w) in zip(got, want)), (got, want)


def test_resume_does_not_log_rolled_back_steps_twice(tmp_path):
    """Steps 1-3 logged, checkpoints at 2 and 3; the crash loses step 3's checkpoint; the resumed run logs 3
    again: metrics.jsonl must hold each step once, the rolled-back record is kept aside."""
    ckpt = tmp_path / "ckpt"
    argv = [*FIVE_STEPS, "--train.out_dir", str(tmp_path), "--checkpoint.dir", str(ckpt), "--checkpoint.every", "2"]
    _fit([*argv, "--train.steps", "3"])
    (ckpt / "latest").write_text("step_000002\n")
    import shutil

    shutil.rmtree(ckpt / "step_000003")
    _fit([*argv, "--train.steps", "4"])
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3, 4]
    aside = (tmp_path / "metrics.rolled_back.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in aside] == [3]


def test_rewind_keeps_a_torn_last_line_aside(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"ste')
    MetricsLogger(str(tmp_path), enabled=True, progress=False, total_steps=9).rewind(2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert len((tmp_path / "metrics.rolled_back.jsonl").read_text().splitlines()) == 2


def test_plot_draws_every_run(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "launch"))
    import plot

    runs = {}
    for name, scale in (("tiny", 1.0), ("tp2", 1.1)):
        run = tmp_path / name
        run.mkdir()
        lines = [
            {
                "step": s,
                "loss": scale * (8 - s / 10),
                "lr": 1e-3 * s,
                "grad_norm": 1.0 / s,
                "tokens_per_s": 1000.0 * scale,
                "peak_mem_bytes": 2**24,
                **({"eval_loss": 8.0} if s % 5 == 0 else {}),
            }
            for s in range(1, 11)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        runs[name] = plot.read_run(run)
    fig = plot.plot(runs, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    legends = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes if ax.get_legend()]
    assert legends[0] == ["tiny (train)", "tiny (eval)", "tp2 (train)", "tp2 (eval)"]
    assert all(labels == ["tiny", "tp2"] for labels in legends[1:]) and len(legends) == 5
    out = run_script("launch/plot.py", tmp_path / "tiny", tmp_path / "tp2", "-o", tmp_path / "cli.png", timeout=120)
    assert out.returncode == 0 and (tmp_path / "cli.png").is_file(), out.stderr
    missing = run_script("launch/plot.py", tmp_path / "nope", timeout=120)
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr


def test_plot_says_which_lines_it_skipped(tmp_path, capsys):
    """Issue 23 item 6: plot.py dropped corrupt lines without a word."""
    sys.path.insert(0, str(ROOT / "launch"))
    import plot

    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "lo\xff\n{"step": 3}\n{"ste')
    assert [r["step"] for r in plot.read_run(tmp_path)] == [1, 3]
    assert (
        f"warning: {tmp_path / 'metrics.jsonl'}: skipped 2 lines that are not a step record (line 2, 4)"
        in capsys.readouterr().err
    )


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    """Before: a ModuleNotFoundError traceback from inside plot(), after the runs were read."""
    sys.path.insert(0, str(ROOT / "launch"))
    import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets where it is not installed
    assert plot.main([str(tmp_path / "no-such-run"), "-o", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert err == 'error: launch/plot.py needs matplotlib: pip install -e ".[plot]" (or the dev extra)\n', err


def test_plot_tensorboard_writes_a_finished_runs_records_once(tmp_path, capsys):
    """plot.py --tensorboard: the records of a run trained without log.tensorboard as TensorBoard scalars, the
    tags log.tensorboard uses; a second call (or a run that logged its own) is refused in one line."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sys.path.insert(0, str(ROOT / "launch"))
    import plot

    records = [{"step": s, "loss": 8.0 - s / 10, "lr": 1e-3 * s} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot.main([str(tmp_path), "--tensorboard"]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'tensorboard'}\n"
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("loss/train")] == [
        (r["step"], round(r["loss"], 5)) for r in records
    ]
    assert plot.main([str(tmp_path), "--tensorboard"]) == 2
    assert "already holds event files; view them with tensorboard --logdir" in capsys.readouterr().err


def _change(index: int, **values):
    return lambda records: records[index].update(values)


# issue 42: launch/plot.py's tracebacks (OverflowError, TypeError, AttributeError; --tensorboard left half-written
# event files). case -> (change to 5 good records, extra arguments, the line's words)
PLOT_INPUTS = {
    "step Infinity": (_change(1, step=float("inf")), [], "line 2: step is Infinity, not an integer >= 0"),
    "null final loss": (_change(4, loss=None), [], "line 5: loss is null, not a number"),
    "time a list": (_change(2, time=[1, 2]), [], "line 3: time is [1, 2], not an object of seconds per phase"),
    "time a list, --tensorboard": (_change(2, time=[1, 2]), ["--tensorboard"], "line 3: time is [1, 2], not an"),
    "-o out.xyz": (
        lambda records: None,
        ["-o", "{tmp}/out.xyz"],
        "-o {tmp}/out.xyz: matplotlib cannot write .xyz files; end the name in one of .avif, .eps,",
    ),
}


@pytest.mark.parametrize("case", list(PLOT_INPUTS))
def test_plot_refuses_bad_input_in_one_line_writing_nothing(tmp_path, case):
    pytest.importorskip("matplotlib")
    change, args, words = PLOT_INPUTS[case]
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 8.0 - s / 10, "lr": 1e-3, "time": {"data": 0.01}} for s in range(1, 6)]
    change(records)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = [a.format(tmp=tmp_path) for a in args] or ["-o", str(tmp_path / "curves.png")]
    one_error_line(run_script("launch/plot.py", run, *args, timeout=120), words.format(tmp=tmp_path))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["metrics.jsonl", "run"]  # no picture, no tensorboard/
