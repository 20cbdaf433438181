"""Issue 34 part C: disks and signals, as users meet them through launch/pretrain.py. A full disk (bytes or
inodes), a read-only remount mid-run and a metrics.jsonl that is a directory are one line naming the path and the
free space, the run exits 3 after saving what it can (engine/storage.py), `latest` keeps naming the last good
checkpoint, and the same command then resumes from it. SIGHUP saves and stops like SIGTERM; a second SIGINT during
a save is one line (exit 130); train.out_dir '' is refused. Full disks are small tmpfs mounts inside tmp_path
(root needed: skipped with the reason elsewhere, a failure under CI=true)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import ROOT, run_script
from tests.shrunk import FIVE_STEPS

ARGS = [*FIVE_STEPS, "--log.progress", "true"]  # a "step" line per step: the tests act on it


def _pretrain(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """launch/pretrain.py from ``cwd``, in a fork of the test process (tests/cli.py)."""
    return run_script(str(ROOT / "launch/pretrain.py"), *args, cwd=cwd, timeout=300)


def _start(*args: str, prefix: list[str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        prefix or [sys.executable, "launch/pretrain.py", *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _one_error_line(stderr: str, stdout: str, *needles: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), (stderr[-3000:], needles)
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    return lines[0]


def _latest(ckpt: Path) -> str:
    return (ckpt / "latest").read_text().strip()


def _resumes(args: list[str], ckpt: Path, step: str) -> None:
    """The same command again: resumes from ``step`` (the last good checkpoint) and finishes."""
    again = _pretrain(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt / step}" in again.stdout, again.stdout[-2000:]
    assert not list(ckpt.glob("step_*.tmp-*"))


@pytest.mark.parametrize("tensorboard", [False, True])
def test_metrics_disk_full_saves_then_exits_3(tmp_path, tmpfs, tensorboard):
    """Was: OSError ENOSPC traceback from engine/metrics/logger.py (or TensorBoard's writer thread and flush),
    exit 1, nothing saved since the last save."""
    out, ckpt = tmpfs(tmp_path / "out", size="64k"), tmp_path / "ckpt"
    args = [
        *ARGS,
        "--train.steps",
        "400",
        "--train.out_dir",
        str(out),
        "--checkpoint.dir",
        str(ckpt),
        "--log.tensorboard",
        str(tensorboard).lower(),
    ]
    proc = _start(*args)
    for line in proc.stdout:
        if line.startswith("step "):  # training: fill the rest of the disk (metrics.jsonl's next page fails)
            with open(out / "filler", "wb", buffering=0) as f:
                try:
                    while f.write(b"\0" * 4096):
                        pass
                except OSError:
                    pass
            break
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 3, stderr[-3000:]
    line = _one_error_line(
        stderr, stdout, "No space left on device (ENOSPC); 0 B of 64.0 KiB", "free on the file system of", "saved in"
    )
    records = f"cannot write '{out / 'metrics.jsonl'}'" in line  # else TensorBoard's events: first come, first fail
    assert records or (tensorboard and f"cannot write '{out / 'tensorboard'}" in line), line
    step = _latest(ckpt)
    assert f"checkpoint {step} saved in {ckpt}" in line
    assert "stop signal" not in stdout, stdout[-3000:]  # a failed write, not a signal: its line alone says why
    logged = [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert int(step[5:]) == logged[-1] + records  # the step whose record failed is in the checkpoint
    (out / "filler").unlink()
    _resumes([*args, "--train.steps", str(int(step[5:]) + 1)], ckpt, step)


def test_checkpoint_disk_full_keeps_latest(tmp_path, tmpfs):
    """Was: exit 2 (a bad-input status) and the failed save's partial staging directory left behind."""
    ckpt = tmpfs(tmp_path / "ckpt", size="10m")  # one shard of FIVE_STEPS's model (~7 MiB) fits, not two
    args = [
        *ARGS,
        "--train.steps",
        "6",
        "--checkpoint.every",
        "2",
        "--train.out_dir",
        str(tmp_path / "out"),
        "--checkpoint.dir",
        str(ckpt),
    ]
    run = _pretrain(*args)
    assert run.returncode == 3, run.stderr[-3000:]
    line = _one_error_line(
        run.stderr,
        run.stdout,
        "could not save step 4: cannot write",
        "No space left on device (ENOSPC)",
        "of 10.0 MiB",
        "the latest checkpoint stays step_000002",
    )
    assert line.startswith("error: checkpoint: rank 0 could not save step 4: cannot write"), line  # nothing else
    assert _latest(ckpt) == "step_000002" and not list(ckpt.glob("step_*.tmp-*"))  # staging removed
    assert not (ckpt / "LOCK").exists(), "the failed save kept the lock"  # given back: the run is over
    subprocess.run(["mount", "-o", "remount,size=64m", str(ckpt)], check=True)  # make room
    _resumes(args, ckpt, "step_000002")


def test_checkpoint_inodes_exhausted_at_the_staging_mkdir(tmp_path, tmpfs):
    """Was: OSError traceback from engine/checkpoint/publish.py staging_dir. 8 inodes: the root, LOCK and one
    checkpoint (directory, shard, the rank's part, locator, index, latest); the next save's staging mkdir finds
    none."""
    ckpt = tmpfs(tmp_path / "ckpt", size="64m", nr_inodes="8")
    args = [
        *ARGS,
        "--train.steps",
        "6",
        "--checkpoint.every",
        "2",
        "--train.out_dir",
        str(tmp_path / "out"),
        "--checkpoint.dir",
        str(ckpt),
    ]
    run = _pretrain(*args)
    assert run.returncode == 3, run.stderr[-3000:]
    _one_error_line(
        run.stderr,
        run.stdout,
        f"cannot write '{ckpt}/step_000004.tmp-",
        "(ENOSPC)",
        "0 of 8 inodes free",
        "the latest checkpoint stays step_000002",
    )
    subprocess.run(["mount", "-o", "remount,nr_inodes=64", str(ckpt)], check=True)
    _resumes(args, ckpt, "step_000002")


def test_checkpoint_inodes_exhausted_at_the_commit(tmp_path, tmpfs):
    """Every rank's shard and part written, then rank 0's commit (the locator, the index, `latest`) finds no inode:
    one line naming the commit and the step, exit 3, `latest` stays step 2, the staging folder is gone and the same
    command resumes. 11 inodes: the 8 of the inode test above, then step 4's staging folder, shard and part.
    (A mutant no longer catching the commit's error: its traceback, exit 1.)"""
    ckpt = tmpfs(tmp_path / "ckpt", size="64m", nr_inodes="11")
    every_2 = ["--train.steps", "6", "--checkpoint.every", "2"]
    args = [*ARGS, *every_2, "--train.out_dir", str(tmp_path / "out"), "--checkpoint.dir", str(ckpt)]
    run = _pretrain(*args)
    assert run.returncode == 3, run.stderr[-3000:]
    line = _one_error_line(run.stderr, run.stdout, "(ENOSPC)", "the latest checkpoint stays step_000002")
    assert line.startswith(f"error: checkpoint: rank 0 could not commit step 4: cannot write '{ckpt}"), line
    assert _latest(ckpt) == "step_000002" and not list(ckpt.glob("step_*.tmp-*")), sorted(ckpt.iterdir())
    subprocess.run(["mount", "-o", "remount,nr_inodes=64", str(ckpt)], check=True)
    _resumes(args, ckpt, "step_000002")


def test_checkpoint_dir_remounted_read_only_mid_run(tmp_path, tmpfs):
    """Was: OSError (EROFS) traceback from publish.py staging_dir, exit 1."""
    ckpt = tmpfs(tmp_path / "ckpt", size="64m")
    args = [
        *ARGS,
        "--train.steps",
        "400",
        "--checkpoint.every",
        "2",
        "--train.out_dir",
        str(tmp_path / "out"),
        "--checkpoint.dir",
        str(ckpt),
    ]
    proc = _start(*args)
    deadline = time.monotonic() + 240
    while not (ckpt / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    while subprocess.run(["mount", "-o", "remount,ro", str(ckpt)], capture_output=True).returncode != 0:
        assert proc.poll() is None and time.monotonic() < deadline  # EBUSY while a shard is open for writing
        time.sleep(0.01)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 3, stderr[-3000:]
    _one_error_line(
        stderr,
        stdout,
        "Read-only file system (EROFS)",
        "mounted read-only",
        f"the latest checkpoint stays {_latest(ckpt)}",
    )
    good = _latest(ckpt)
    subprocess.run(["mount", "-o", "remount,rw", str(ckpt)], check=True)
    _resumes([*args, "--train.steps", str(int(good[5:]) + 1)], ckpt, good)  # the last of repeated keys wins


def test_metrics_jsonl_that_is_a_directory_is_refused_at_start(tmp_path):
    """Was: IsADirectoryError traceback after the first step (the probe checked out_dir and tensorboard/ only)."""
    (tmp_path / "metrics.jsonl").mkdir()
    run = _pretrain(*ARGS, "--train.out_dir", str(tmp_path))
    assert run.returncode == 2
    _one_error_line(run.stderr, run.stdout, f"'{tmp_path / 'metrics.jsonl'}' is not a file")
    assert "step " not in run.stdout  # refused before training


@pytest.mark.parametrize("terminal", ["kept", "gone"])
def test_sighup_saves_and_stops_like_sigterm(tmp_path, terminal):
    """Was: exit 129 (killed by SIGHUP), nothing saved, no line. A dropped ssh session also takes the terminal:
    with stdout closed, the progress and stop lines must not fail the save or the exit (EPIPE here, EIO on a tty)."""
    ckpt = tmp_path / "ckpt"
    args = [*ARGS, "--train.steps", "100000", "--train.out_dir", str(tmp_path), "--checkpoint.dir", str(ckpt)]
    proc = _start(*args)
    for line in proc.stdout:
        if line.startswith("step "):  # the handler is installed by then
            break
    if terminal == "gone":
        proc.stdout.close()
    proc.send_signal(signal.SIGHUP)
    stderr = proc.stderr.read()
    proc.wait(timeout=300)
    stdout = "" if terminal == "gone" else proc.stdout.read()
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert terminal == "gone" or "stop signal (SIGHUP): stopping after step" in stdout
    assert not (tmp_path / "LOCK").exists()  # released: the run ended cleanly
    _resumes([*args, "--train.steps", str(int(_latest(ckpt)[5:]) + 1)], ckpt, _latest(ckpt))


# Two SIGINTs while the step-4 save writes its shard: deterministic, inside the real launcher.
DOUBLE_SIGINT = """
import os, runpy, signal, sys, time
import engine.checkpoint.checkpointer as c
write, calls = c.write_shard, []
def slow_write(path, tensors):
    calls.append(path)
    if len(calls) == 2:
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
    return write(path, tensors)
c.write_shard = slow_write
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_second_sigint_during_a_save_is_one_line(tmp_path):
    """Was: a KeyboardInterrupt traceback from inside the save."""
    ckpt = tmp_path / "ckpt"
    args = [
        *ARGS,
        "--train.steps",
        "6",
        "--checkpoint.every",
        "2",
        "--train.out_dir",
        str(tmp_path),
        "--checkpoint.dir",
        str(ckpt),
    ]
    proc = _start(prefix=[sys.executable, "-c", DOUBLE_SIGINT, "launch/pretrain.py", *args])
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    _one_error_line(
        stderr,
        stdout,
        "interrupted: a second SIGINT during the save of step 4: that save was dropped, "
        "the latest checkpoint stays step_000002",
    )
    assert _latest(ckpt) == "step_000002" and not list(ckpt.glob("step_*.tmp-*"))
    _resumes(args, ckpt, "step_000002")


# An async save's writer stuck in its shard (a hung disk; under several ranks a peer that died before the gather),
# then a crash in the training loop: deterministic, inside the real launcher.
CRASH_DURING_A_STUCK_ASYNC_SAVE = """
import runpy, sys, threading, time
import engine.checkpoint.checkpointer as c
import engine.trainer as t
write, stuck = c.write_shard, threading.Event()
def stuck_write(path, tensors):
    stuck.set()
    time.sleep(120)
    return write(path, tensors)
c.write_shard = stuck_write
step = t.Trainer.train_step
def crash_once_stuck(self, batch):
    if self.step >= 1 and stuck.wait(60):
        raise RuntimeError("a bug in the training loop")
    return step(self, batch)
t.Trainer.train_step = crash_once_stuck
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_crash_does_not_wait_for_a_stuck_async_writer(tmp_path):
    """A run that crashes while its async save's writer is stuck exits at once with its traceback (exit 1), as a
    crash without a save in flight does: the writer thread is a daemon, so the interpreter does not wait for it
    (here 120 s; behind a dead peer, up to parallel.timeout_s) before the job can be restarted."""
    ckpt = tmp_path / "ckpt"
    args = [*ARGS, "--train.steps", "6", "--checkpoint.async_save", "true", "--checkpoint.every", "1"]
    args += ["--train.out_dir", str(tmp_path), "--checkpoint.dir", str(ckpt)]
    proc = _start(prefix=[sys.executable, "-c", CRASH_DURING_A_STUCK_ASYNC_SAVE, "launch/pretrain.py", *args])
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the crashed run waited for its stuck checkpoint writer") from None
    assert proc.returncode == 1 and "RuntimeError: a bug in the training loop" in stderr, stderr[-3000:]
    assert not (ckpt / "latest").exists(), "the stuck save committed: the injection is not vacuous"


def test_empty_out_dir_is_refused(tmp_path):
    """Was: metrics.jsonl and LOCK written into the current directory."""
    args = [str(ROOT / a) if a.endswith(".yaml") else a for a in ARGS]  # from another directory
    run = _pretrain(*args, "--train.out_dir", "", cwd=tmp_path)
    assert run.returncode == 2
    _one_error_line(run.stderr, run.stdout, "train.out_dir='' is not valid: give the directory")
    assert not list(tmp_path.iterdir())


def test_a_commit_cut_short_puts_the_step_back(tmp_path, monkeypatch):
    """publish: `latest` failing to be written (a full disk, a second SIGINT) after the rename to step_N renames
    it back, so no complete step lies above `latest` (which the next start-up would refuse, lineage.py)."""
    from engine.checkpoint import publish as pub

    root = tmp_path / "ckpt"
    pub.staging_dir(root, 2, "a")
    pub.publish(root, 2, "a", {"step": 2})
    pub.staging_dir(root, 4, "b")
    real = pub.fsync_write

    def full(path, text):
        if path.name.startswith("latest"):
            raise OSError(28, "No space left on device", str(path))
        real(path, text)

    monkeypatch.setattr(pub, "fsync_write", full)
    with pytest.raises(OSError):
        pub.publish(root, 4, "b", {"step": 4})
    assert _latest(root) == "step_000002" and [p.name for p in pub.list_checkpoints(root)] == ["step_000002"]
    assert (root / "step_000004.tmp-b" / "index.json").exists() and not list(root.glob("latest.tmp-*"))
    pub.discard(root, 4, "b")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
