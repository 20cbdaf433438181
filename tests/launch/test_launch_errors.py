"""launch/pretrain.py's refusals as users meet them (issue 17, cases 2, 4, 5 and 7): under torchrun the one
error line reaches stderr every time, once; DeepSpeed missing; checkpoint.dir locked by a live job or not a
directory; SIGTERM with nothing to save."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.cli import ROOT, run_script
from tests.dist import free_port
from tests.shrunk import FIVE_STEPS


def _one_error_line(out: subprocess.CompletedProcess, needle: str, launcher: bool = False) -> None:
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and needle in lines[0], out.stderr[-3000:]
    if not launcher:  # torchrun's agent prints its own ChildFailedError traceback after ours
        assert "Traceback" not in out.stderr + out.stdout


def _pretrain(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """launch/pretrain.py in a fork of the test process (tests/cli.py), or in a new interpreter where ``env`` must
    act at its start (PYTHONPATH)."""
    if env is None:
        return run_script("launch/pretrain.py", *args, timeout=300)
    return subprocess.run(
        [sys.executable, "launch/pretrain.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
@pytest.mark.parametrize("tries", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_config_error_under_torchrun_is_printed_once_every_time(tries):
    """Before: only rank 0 printed, and torchrun killed it first when rank 1 exited first (2 tries in 3)."""
    for _ in range(tries):
        out = subprocess.run(
            [
                "torchrun",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                "launch/pretrain.py",
                "--config",
                "configs/tiny.yaml",
                "--parallel.foo",
                "1",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode != 0
        _one_error_line(out, "unknown config key 'parallel.foo'", launcher=True)


def test_zero_without_deepspeed_is_one_line(tmp_path):
    fake = tmp_path / "deepspeed"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'deepspeed'\")\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = _pretrain(
        *FIVE_STEPS,
        "--parallel.dp_mode",
        "zero",
        "--parallel.zero_stage",
        "1",
        "--train.out_dir",
        str(tmp_path / "run"),
        env=env,
    )
    assert out.returncode == 2
    _one_error_line(out, 'pip install -e ".[deepspeed]"')


def test_locked_or_unwritable_checkpoint_dir_is_one_line(tmp_path, live_pid):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    holder = {"host": socket.gethostname(), "pid": live_pid, "started": 0, "run": "first"}
    (ckpt / "LOCK").write_text(json.dumps(holder))
    out = _pretrain(*FIVE_STEPS, "--train.out_dir", str(tmp_path), "--checkpoint.dir", str(ckpt))
    assert out.returncode == 2
    _one_error_line(out, f"is in use by pid {live_pid} on host {socket.gethostname()} (run first")
    (tmp_path / "file").write_text("x")
    out = _pretrain(*FIVE_STEPS, "--train.out_dir", str(tmp_path), "--checkpoint.dir", str(tmp_path / "file"))
    assert out.returncode == 2
    _one_error_line(out, "is not a directory")


def test_sigterm_with_nothing_to_save_says_so_and_fails(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "launch/pretrain.py",
            *FIVE_STEPS,
            "--train.steps",
            "100000",
            "--log.progress",
            "true",
            "--train.out_dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in proc.stdout:  # wait for the first step: the signal handler is installed by then
        seen.append(line)
        if line.startswith("step "):
            proc.send_signal(signal.SIGTERM)
            break
    rest, err = proc.communicate(timeout=120)
    text = "".join(seen) + rest
    assert proc.returncode == 1, (text, err)
    assert "checkpoint.dir is empty: no checkpoint will be saved" in text
    assert "stop signal (SIGTERM): stopping after step " in text
    assert "; nothing saved (checkpoint.dir is empty), exit status 1" in text
    # the same run left to finish has lost nothing: exit 0, no stop line
    done = _pretrain(*FIVE_STEPS, "--train.steps", "1", "--train.out_dir", str(tmp_path / "done"))
    assert done.returncode == 0 and "stop signal" not in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_second_run_on_one_out_dir_is_one_line(tmp_path, live_pid):
    """Issue 23 item 4: a second run on a train.out_dir in use exited 0, interleaving both runs' metrics.jsonl."""
    holder = {"host": socket.gethostname(), "pid": live_pid, "started": 1.7e9, "run": "first"}
    (tmp_path / "LOCK").write_text(json.dumps(holder))
    (tmp_path / "metrics.jsonl").write_text('{"step": 28}\n')
    out = _pretrain(*FIVE_STEPS, "--train.out_dir", str(tmp_path))
    assert out.returncode == 2
    _one_error_line(out, f"train.out_dir '{tmp_path}' is in use by pid {live_pid} on host {socket.gethostname()}")
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 28}\n'  # the first run's records untouched


@pytest.mark.parametrize("what", ["out_dir", "tensorboard"])
def test_out_dir_or_tensorboard_that_is_a_file_is_one_line(tmp_path, what):
    """Issue 23 item 3: FileExistsError tracebacks (out_dir's mkdir; SummaryWriter's)."""
    target = tmp_path / "run" if what == "out_dir" else tmp_path / "tensorboard"
    target.write_text("x")
    out = _pretrain(
        *FIVE_STEPS,
        "--train.out_dir",
        str(target if what == "out_dir" else tmp_path),
        "--log.tensorboard",
        str(what == "tensorboard").lower(),
    )
    assert out.returncode == 2
    _one_error_line(out, f"'{target}' is not a directory")


def test_resume_past_the_end_and_changed_batch_say_so(tmp_path):
    """Issue 23 item 6: a resume at train.steps said nothing; a changed global_batch_size or seq_len on resume
    passed without a word about the data position."""
    args = [
        *FIVE_STEPS,
        "--train.steps",
        "2",
        "--train.out_dir",
        str(tmp_path),
        "--checkpoint.dir",
        str(tmp_path / "c"),
    ]
    assert _pretrain(*args).returncode == 0
    again = _pretrain(*args)
    assert again.returncode == 0 and "nothing to do: the run is at step 2 and train.steps=2" in again.stdout
    assert "notice:" not in again.stdout  # nothing changed
    changed = _pretrain(*args, "--train.steps", "3", "--train.global_batch_size", "8", "--train.seq_len", "16")
    assert changed.returncode == 0, changed.stderr[-2000:]
    assert "notice: train.global_batch_size is 8, the checkpoint's run had 16" in changed.stdout
    assert "notice: train.seq_len is 16, the checkpoint's run had 32" in changed.stdout


def test_two_real_runs_on_one_out_dir(tmp_path):
    """Issue 23 item 4 as users met it: while one run trains, a second on its out_dir exits 2 naming the first
    (its pid); the first's metrics.jsonl holds only its own steps, in order."""
    first = subprocess.Popen(
        [
            sys.executable,
            "launch/pretrain.py",
            *FIVE_STEPS,
            "--train.steps",
            "100000",
            "--log.progress",
            "true",
            "--train.out_dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in first.stdout:  # the first has its lock once it trains
            if line.startswith("step "):
                break
        second = _pretrain(*FIVE_STEPS, "--train.out_dir", str(tmp_path))
        assert second.returncode == 2
        _one_error_line(second, f"train.out_dir '{tmp_path}' is in use by pid {first.pid} on host")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and not (tmp_path / "metrics.rolled_back.jsonl").exists()
    assert not (tmp_path / "LOCK").exists()  # released when the first run ended


# Issue 42: tracebacks where one line was due. A rank of a 2-rank job (its peer never comes: each case ends first).
RANK_0_OF_2 = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
# case -> (config file text or None for configs/tiny.yaml's, mode 000, MASTER_PORT, words of the one line)
INPUTS = {
    "config file unreadable": (None, True, None, "config file '{config}' cannot be read (Permission denied)"),
    "config with a 5000-digit integer": (
        "train:\n  steps: " + "9" * 5000 + "\n",
        False,
        None,
        "config file '{config}' holds an integer of 5000 digits at line 2",
    ),
    "MASTER_PORT abc": (None, False, "abc", "MASTER_PORT='abc' is not a TCP port; give a number in 1-65535"),
    "MASTER_PORT 70000": (None, False, "70000", "MASTER_PORT='70000' is not a TCP port; give a number in 1-65535"),
}


@pytest.mark.parametrize("case", list(INPUTS))
def test_unreadable_config_and_bad_master_port_are_one_line(tmp_path, case):
    """Before: PermissionError and ValueError tracebacks (the config's read, YAML's int() past Python's digit limit,
    int(MASTER_PORT)), and port 70000 blamed on the store's host (exit 1)."""
    text, unreadable, port, words = INPUTS[case]
    config = tmp_path / "c.yaml"
    config.write_text(text or (ROOT / "configs" / "tiny.yaml").read_text())
    if unreadable:
        config.chmod(0)  # and the fork drops root's override of file modes (tests/cli.py as_user)
    # Every fork has this process as its launcher parent: a restart round of its own gives each case its own
    # once-per-host error marker (engine/cluster/report.py), removed below
    rank = {**RANK_0_OF_2, "TORCHELASTIC_RESTART_COUNT": str(1000 + list(INPUTS).index(case)), "MASTER_PORT": port}
    env = None if port is None else {**os.environ, **rank}
    out = run_script(
        "launch/pretrain.py",
        *FIVE_STEPS,
        "--config",
        config,
        "--train.out_dir",
        tmp_path / "run",
        "--parallel.startup_timeout_s",
        "5",
        env=env,
        as_user=unreadable,
        timeout=300,
    )
    for marker in Path(tempfile.gettempdir()).glob(
        f"engine-error-{os.getpid()}-*-{rank['TORCHELASTIC_RESTART_COUNT']}"
    ):
        marker.unlink()
    assert out.returncode == 2, out.stderr[-3000:]
    _one_error_line(out, words.format(config=config))
    assert not (tmp_path / "run").exists()  # refused before anything was written
