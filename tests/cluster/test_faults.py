"""Every fault ends the job within a minute, in one line naming the host and rank (issue 35): a frozen host
(SIGSTOP: the heartbeat, engine/cluster/heartbeat.py), a dead rank (kill -9: the collective error explained by the
heartbeat, not a traceback per rank), a host missing at launch (engine/cluster/startup.py). Two torchrun agents
on loopback as in tests/cluster/test_multinode.py; the bounds are wall-clock times with room for a loaded machine."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import engine.checkpoint.lock as lock_module
from engine.checkpoint.format import CheckpointError
from engine.checkpoint.lock import LOCK, STALE_S, CheckpointLock
from engine.cluster.keepalive import KEEPALIVE, VARIABLE, advice
from tests.cli import ROOT
from tests.cluster.jobs import Job, deepspeed_over_ssh, final_losses, needs_pdsh, train_args
from tests.dist import free_port
from tests.sshd import local_sshd  # noqa: F401  (fixture)

# The bound: detected and ended within 60 s of the fault, plus the launcher's own exit; 30 s more for this
# loaded machine (each of the two cores is shared by several test runs).
BOUND_S = 90


def _resumes_exactly(job: Job, args: list[str], out: Path, reference: list[float]) -> None:
    """A new launch from the checkpoint the fault left: it resumes and ends with the uninterrupted losses."""
    job.kill_all()
    agents = job.nodes(2, 2, args)
    assert job.wait(agents, timeout=300) == [0, 0], job.output()[-3000:]
    assert "resumed from " in job.output(), job.output()[-3000:]
    assert final_losses(out) == pytest.approx(reference, rel=1e-5)


def _fault_args(tmp_path: Path) -> tuple[Path, list[str]]:
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    # the collective timeout stays at its 600 s default: only the heartbeat can end the job within the bound
    return out, train_args(out, "--checkpoint.dir", str(ckpt), "--checkpoint.every", "3", "--checkpoint.resume", "auto")


def _one_error_line(text: str, pattern: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and re.search(pattern, lines[0]), text[-4000:]
    return lines[0]


def test_frozen_host_ends_the_job_in_one_line(tmp_path, job, reference):
    """SIGSTOP node 1's workers (a frozen host: its sockets stay open, so no collective fails): node 0's ranks exit
    1 within the bound (not parallel.timeout_s, 600 s) with one line naming ranks 2, 3, their host and the step.
    The heartbeat at 10 s, not its default 30 s (as tests/cluster/test_partition.py's cut host): the same silence,
    20 s less of CI."""
    out, args = _fault_args(tmp_path)
    agents = job.nodes(2, 2, [*args, "--train.steps", "100000", "--parallel.heartbeat_timeout_s", "10"])
    job.wait_for(lambda: (tmp_path / "ckpt" / "latest").exists(), "a checkpoint")
    frozen = [job.worker(2), job.worker(3)]
    start = time.monotonic()
    for worker in frozen:
        worker.send_signal(signal.SIGSTOP)
    try:
        code = job.wait(agents[:1], timeout=BOUND_S)[0]
        elapsed = time.monotonic() - start
    finally:  # stopped workers ignore SIGTERM, and torchrun starts them in sessions of their own (kill_all
        for worker in frozen:  # misses them): without SIGKILL they stayed stopped after the suite, holding memory
            worker.kill()
    assert code != 0
    # The two SIGSTOPs can land up to one beat (timeout / 10) apart, so at the bound the silent set may still be
    # rank 2 or 3 alone: either names node 1's host.
    line = _one_error_line(
        job.output(),
        r"^error: (ranks 2, 3|rank [23]) on host \S+ \(127\.0\.0\.1\) silent for "
        r"\d+ s .* at step \d+",
    )
    print(f"frozen node 1: node 0 ended in {elapsed:.1f} s: {line}")
    assert 'launch/pretrain.py", line' not in job.output()  # no rank's traceback (torchrun's own is allowed)
    _resumes_exactly(job, args, out, reference)


def test_dead_rank_ends_the_job_in_one_line(tmp_path, job, reference):
    """kill -9 one rank: the survivors' collectives fail at once (closed sockets), and instead of a traceback each
    they print the heartbeat's one line naming rank 3 and its host (3 beats after the failure: a 10 s heartbeat
    here, as in the frozen host's test); the checkpoint resumes exactly."""
    out, args = _fault_args(tmp_path)
    agents = job.nodes(2, 2, [*args, "--train.steps", "100000", "--parallel.heartbeat_timeout_s", "10"])
    job.wait_for(lambda: (tmp_path / "ckpt" / "latest").exists(), "a checkpoint")
    start = time.monotonic()
    job.worker(3).kill()
    codes = job.wait(agents, timeout=BOUND_S)
    elapsed = time.monotonic() - start
    assert all(c != 0 for c in codes)
    text = job.output()
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    assert lines and all(
        re.search(r"^error: ranks? (2, )?3 on host \S+ \(127\.0\.0\.1\) (silent|failed)", x) for x in lines
    ), text[-4000:]
    assert len(lines) <= 2, lines  # once per host
    assert 'launch/pretrain.py", line' not in text, text[-4000:]  # no rank's traceback (torchrun's own is allowed)
    print(f"killed rank 3: the job ended in {elapsed:.1f} s: {lines[0]}")
    _resumes_exactly(job, args, out, reference)


def _ranks(
    ranks: list[int], world: int, port: int, extra: list[str], out: Path, wrappers: dict[int, str] | None = None
) -> subprocess.Popen:
    """Ranks of one host started as the deepspeed launcher starts them (RANK, WORLD_SIZE, MASTER_* set), under
    one shell of their own (their parent: engine/cluster/report.py prints once per parent); it prints each exit
    status as "exit RANK CODE". ``wrappers``: rank -> a script that runs launch/pretrain.py for that rank."""
    script = []
    for rank in ranks:
        env = (
            f"RANK={rank} LOCAL_RANK={rank % 2} WORLD_SIZE={world} LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "
            f"MASTER_PORT={port}"
        )
        cmd = [
            sys.executable,
            *([wrappers[rank]] if rank in (wrappers or {}) else []),
            *train_args(out / str(rank), *extra),
        ]
        script.append(f"{env} {shlex.join(cmd)} & p{rank}=$!")
    script += [f"wait $p{rank}; echo exit {rank} $?" for rank in ranks]
    return subprocess.Popen(
        ["bash", "-c", "\n".join(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.parametrize(
    "started, pattern",
    [
        (
            [0, 1],
            r"^error: ranks 2-3 \(node 1 at 2 ranks per node\) of 4 did not join within 20 s .* joined: ranks 0, 1 "
            r"on host \S+ \(127\.0\.0\.1\)$",
        ),
        pytest.param(
            [2, 3],
            r"^error: rank [23] on host \S+ \(127\.0\.0\.1\) could not reach the job's store at 127\.0\.0\.1:\d+ "
            r"within 20 s",
            marks=pytest.mark.slow,
        ),
    ],
)  # CI: the other case; same mechanism
def test_missing_host_at_launch_is_named(tmp_path, started, pattern):
    """Node 1 never starts (ranks 0, 1 wait for 2, 3), or node 0 never does (no store to join): every started rank
    exits 1 within parallel.startup_timeout_s (20 s here) plus the time to start python, naming who is missing,
    not after parallel.timeout_s (600 s) with torch's "2/4 clients joined" traceback."""
    start = time.monotonic()
    host = _ranks(started, 4, free_port(), ["--parallel.startup_timeout_s", "20"], tmp_path)
    text = host.communicate(timeout=20 + BOUND_S)[0]
    elapsed = time.monotonic() - start
    assert re.findall(r"^exit (\d) (\d+)$", text, re.M) == [(str(r), "1") for r in started], text
    _one_error_line(text, pattern)
    assert "Traceback" not in text, text
    assert elapsed < 20 + BOUND_S, elapsed
    print(f"ranks {started} alone: ended in {elapsed:.1f} s")


# A rank that joins the store, then fails inside init_process_group (as one whose host's gloo cannot start)
FAILING_RANK = """import os, runpy, sys
import torch.distributed as dist
dist.init_process_group = lambda *args, **kwargs: os._exit(7)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_rank_failing_while_connecting_is_bounded_by_the_startup_timeout(tmp_path):
    """Both ranks join the store; rank 1 then dies inside init_process_group. Rank 0, waiting in gloo's connect for
    rank 1's address, exits 1 within parallel.startup_timeout_s (20 s; the heartbeat off, so only that bound acts)
    with one line naming rank 1, not after parallel.timeout_s (600 s) with a DistStoreError traceback."""
    wrapper = tmp_path / "failing_rank.py"
    wrapper.write_text(FAILING_RANK)
    start = time.monotonic()
    extra = ["--parallel.heartbeat_timeout_s", "0", "--parallel.startup_timeout_s", "20"]
    host = _ranks([0, 1], 2, free_port(), extra, tmp_path, wrappers={1: str(wrapper)})
    text = host.communicate(timeout=20 + BOUND_S)[0]
    elapsed = time.monotonic() - start
    assert re.findall(r"^exit (\d) (\d+)$", text, re.M) == [("0", "1"), ("1", "7")], text[-3000:]
    _one_error_line(
        text,
        r"^error: rank 0 on host \S+ \(127\.0\.0\.1\): the process group did not connect "
        r"within 20 s \(parallel\.startup_timeout_s\): rank 1 never posted its address",
    )
    assert "Traceback" not in text, text[-3000:]
    assert elapsed < 20 + BOUND_S, elapsed
    print(f"rank 1 failed while connecting: rank 0 ended in {elapsed:.1f} s")


def _foreign_lock(directory: Path, age_s: float) -> Path:
    """A LOCK written by a job on another host, last refreshed ``age_s`` seconds ago."""
    path = directory / LOCK
    path.write_text(json.dumps({"host": "elsewhere", "pid": 4242, "started": time.time() - age_s, "run": "old"}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_lock_of_a_dead_job_on_another_host_is_taken_over(tmp_path, capsys):
    """A requeued job whose rank 0 lands on another host: the dead job's lock, not refreshed for more than
    STALE_S, is taken over with one line; a lock refreshed within STALE_S (a live holder) still refuses."""
    _foreign_lock(tmp_path, STALE_S + 30)
    lock = CheckpointLock(tmp_path, "new")
    message = lock.acquire()
    assert re.fullmatch(
        r"checkpoint.dir: taking over the lock of pid 4242 on host elsewhere \(run old, since .*\), "
        r"not refreshed for \d+ s \(> 60 s\)",
        message,
    ), message
    assert json.loads((tmp_path / LOCK).read_text())["run"] == "new"
    lock.release()
    _foreign_lock(tmp_path, STALE_S - 30)
    with pytest.raises(CheckpointError, match="is in use by pid 4242 on host elsewhere"):
        CheckpointLock(tmp_path, "new").acquire()


def test_the_lock_is_refreshed_several_times_per_staleness_window():
    """A holder that refreshes as rarely as STALE_S loses its lock to a second job on another host between two
    refreshes (both then write one checkpoint folder): the real interval must leave room for missed refreshes
    (a slow file system, a busy host). The test below shortens the interval to watch the thread; this one holds
    the real settings to the contract (issue 45: REFRESH_S = STALE_S failed no test)."""
    assert 0 < lock_module.REFRESH_S and 3 * lock_module.REFRESH_S <= lock_module.STALE_S


def test_lock_holder_keeps_refreshing_it(tmp_path, monkeypatch):
    """The holder's thread touches the lock, so a live job on another host is never taken for dead."""
    monkeypatch.setattr(lock_module, "REFRESH_S", 0.1)
    lock = CheckpointLock(tmp_path, "mine")
    lock.acquire()
    old = time.time() - 3 * STALE_S
    os.utime(tmp_path / LOCK, (old, old))
    deadline = time.monotonic() + 30
    while (tmp_path / LOCK).stat().st_mtime < time.time() - STALE_S and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / LOCK).stat().st_mtime > time.time() - STALE_S, "the holder did not refresh its lock"
    lock.release()


def _sleeps(sshd: psutil.Process) -> list[psutil.Process]:
    """The remote command's ``sleep`` processes under ``sshd``; a session's short-lived child may be gone between
    listing and naming it (psutil.NoSuchProcess: seen once in a full-suite run)."""
    found = []
    for p in sshd.children(recursive=True):
        try:
            if p.name() == "sleep":
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


@needs_pdsh
@pytest.mark.parametrize("keepalive", [True, pytest.param(False, marks=pytest.mark.slow)])  # False: today's hang
def test_ssh_keepalive_ends_the_deepspeed_launcher(tmp_path, local_sshd, keepalive):
    """The host behind pdsh's ssh stops answering (its sshd sessions SIGSTOPped: a cut host, as far as the
    connection can tell): with the keep-alives preflight advises (here 2 s x 2) ssh gives up and the deepspeed
    launcher exits non-zero within the bound; without them it is still waiting at the bound."""
    env = local_sshd.pdsh_env()
    if keepalive:
        env[VARIABLE] += " " + KEEPALIVE.replace("=10", "=2").replace("=3", "=2")
    launcher = subprocess.Popen(
        [*deepspeed_over_ssh(tmp_path, local_sshd, 1), "--no_python", "--no_local_rank", "sleep", "600"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    sshd = psutil.Process(int((local_sshd.key.parent / "sshd.pid").read_text()))
    sessions = []
    try:
        deadline = time.monotonic() + 120
        while not _sleeps(sshd):
            assert time.monotonic() < deadline and launcher.poll() is None, "the remote command never started"
            time.sleep(0.2)
        sessions = sshd.children()
        for session in sessions:
            session.suspend()
        start = time.monotonic()
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        elapsed = time.monotonic() - start
    finally:
        for session in sessions:
            session.resume()
        for p in _sleeps(sshd):
            p.kill()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    if keepalive:
        assert launcher.returncode not in (0, None) and elapsed < 30, (elapsed, launcher.returncode)
        print(f"cut host: the launcher ended in {elapsed:.1f} s with the keep-alives")
    else:
        assert elapsed >= 30  # the test can tell: without keep-alives the launcher waited


def test_preflight_advises_the_keepalives():
    assert KEEPALIVE in advice({}) and "export PDSH_SSH_ARGS_APPEND=" in advice({})
    assert "has ssh keep-alives" in advice({VARIABLE: f"-i key {KEEPALIVE}"})
