"""The once-per-host error line (engine/cluster/report.py) without a launcher: the test process is the ranks'
parent (as torchrun's agent or the deepspeed launcher is), each rank a python process calling ``report_once``.
tests/launch/test_launch_errors.py runs it under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from engine.cluster import report
from tests.cli import ROOT

RANK = "import sys; from engine.cluster.report import report_once; report_once(sys.argv[1], float(sys.argv[2]))"


def _ranks(count: int, world: int, round_: str, prelude: str = "", wait_s: float = report.WAIT_S) -> list[str]:
    """``count`` ranks of a ``world``-rank launch (restart round ``round_``) reporting the same line, a loser
    waiting ``wait_s`` at most for the winner's: the stderr lines they printed, all together."""
    env = {"WORLD_SIZE": str(world), "TORCHELASTIC_RESTART_COUNT": round_, "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", prelude + RANK, "error: bad value", str(wait_s)],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    lines = []
    for proc in procs:
        lines += proc.communicate(timeout=60)[1].splitlines()
        assert proc.returncode == 0
    return lines


def _marker(round_: str) -> Path:
    """The marker of this process's ranks: named by their parent (this process), its start time and the round."""
    started = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
    return Path(tempfile.gettempdir()) / f"engine-error-{os.getpid()}-{started}-{round_}"


def test_the_line_is_printed_once_for_the_ranks_of_one_launch_and_again_in_another_round():
    round_ = uuid.uuid4().hex
    try:
        assert _ranks(4, 4, round_) == ["error: bad value"]
        assert _marker(round_).read_text() == "done"
        assert _ranks(2, 2, round_ + "b") == ["error: bad value"]  # two ranks are a launch too
    finally:
        _marker(round_).unlink(missing_ok=True)
        _marker(round_ + "b").unlink(missing_ok=True)
    assert _ranks(1, 1, round_) == ["error: bad value"] and not _marker(round_).exists()  # alone: no marker


def test_a_claim_whose_winner_died_before_printing_is_printed_after_the_wait():
    round_ = uuid.uuid4().hex
    _marker(round_).write_text("")  # claimed, never done
    try:
        assert _ranks(2, 2, round_, wait_s=0.3) == ["error: bad value"] * 2  # the same wait, shorter
    finally:
        _marker(round_).unlink(missing_ok=True)


def test_without_a_usable_temp_folder_every_rank_prints():
    lines = _ranks(2, 2, uuid.uuid4().hex, prelude="import tempfile; tempfile.tempdir = '/nonexistent/tmp'; ")
    assert lines == ["error: bad value"] * 2


def test_a_claim_that_cannot_be_read_is_printed_after_the_wait():
    round_ = uuid.uuid4().hex
    _marker(round_).mkdir()  # claimed (O_EXCL fails), and every read of it fails
    try:
        assert _ranks(2, 2, round_, wait_s=0.3) == ["error: bad value"] * 2
    finally:
        _marker(round_).rmdir()


def test_a_launcher_gone_from_proc_still_gets_the_line_once(monkeypatch, capsys):
    """The launcher died before the rank read its start time: the marker is named with 0 for it."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    round_ = uuid.uuid4().hex
    monkeypatch.setattr(os, "getppid", lambda: gone.pid)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", round_)
    marker = Path(tempfile.gettempdir()) / f"engine-error-{gone.pid}-0-{round_}"
    try:
        report.report_once("error: bad value")
        assert capsys.readouterr().err == "error: bad value\n" and marker.read_text() == "done"
    finally:
        marker.unlink(missing_ok=True)


# A launcher whose process name holds ')' (which /proc/PID/stat does not quote) starts two ranks that report the line
LAUNCHER = """import os, pathlib, subprocess, sys, tempfile
started = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
launch = f"{os.getpid()}-{started}-{os.environ['TORCHELASTIC_RESTART_COUNT']}"
marker = pathlib.Path(tempfile.gettempdir(), f"engine-error-{launch}")
ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1], "error: bad value", "5"]) for _ in range(2)]
print(sum(rank.wait() for rank in ranks), marker.read_text() if marker.exists() else "no-marker", flush=True)
marker.unlink(missing_ok=True)
"""


def test_the_marker_is_named_by_the_launchers_start_time_whatever_its_name(tmp_path):
    python = tmp_path / "py) x"
    python.symlink_to(sys.executable)
    round_ = uuid.uuid4().hex
    env = {"WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": round_, "PATH": "/usr/bin:/bin"}
    launcher = subprocess.Popen(
        [str(python), "-c", LAUNCHER, RANK],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = launcher.communicate(timeout=60)
    finally:  # where a rank that misread the start time would put it
        (Path(tempfile.gettempdir()) / f"engine-error-{launcher.pid}-0-{round_}").unlink(missing_ok=True)
    assert out.split() == ["0", "done"] and err.splitlines() == ["error: bad value"], out + err
