"""Multi-node for real on one machine, and faults: two torchrun agents with their own node ranks on loopback, a
rank killed mid-run, restarts and SIGTERM with checkpoints, collective timeouts, and the deepspeed launcher over
real ssh (pdsh) to localhost. Preflight (launch/preflight.py) has its own file, tests/cluster/test_preflight.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.config import ConfigError, load
from engine.parallel.layout.context import ParallelContext
from tests.cli import ROOT
from tests.cluster.jobs import (  # noqa: F401  (fixtures)
    STEPS,
    deepspeed_over_ssh,
    final_losses,
    logged_steps,
    needs_pdsh,
    read_losses,
    restart_args,
    train_args,
)
from tests.dist import run_ranks
from tests.sshd import local_sshd  # noqa: F401  (fixture)


@pytest.mark.slow  # CI: the launchers across network-namespace hosts (tests/cluster/test_hosts.py)
def test_two_nodes_follow_one_node(tmp_path, job, reference):
    """Done 1: 2 nodes x 2 processes (two agents, their own node ranks, c10d rendezvous on loopback)."""
    out = tmp_path / "run"
    codes = job.wait(job.nodes(2, 2, train_args(out)))
    assert codes == [0, 0], job.output()[-3000:]
    assert "layout tp=2 pp=1 dp=2 on 4 x" in job.output()
    assert read_losses(out) == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow  # CI: tests/cluster/test_faults.py kills a rank and names it in one line
def test_killed_rank_ends_the_job_naming_it(tmp_path, job):
    """Done 3 (first half): SIGKILL one rank of a 2-node job mid-run; both agents exit non-zero within 5x the job's
    collective timeout (not gloo's 30-minute default), and the
    output names the dead rank."""
    out = tmp_path / "run"
    agents = job.nodes(2, 2, train_args(out, "--train.steps", "100000", "--parallel.timeout_s", "30"))
    job.wait_for(lambda: logged_steps(out) >= 2, "two logged steps")
    victim = job.worker(3)
    start = time.monotonic()
    victim.kill()
    # Bounded by the job's parallel.timeout_s (30 s), not gloo's 30-minute default; 5x that for a loaded machine
    # (job.wait fails the test past it).
    codes = job.wait(agents, timeout=5 * 30)
    elapsed = time.monotonic() - start
    assert all(c != 0 for c in codes), (elapsed, codes)
    # torchrun's failure summary: rank 3 is listed with SIGKILL (as the root cause, or beside its tp peer's gloo
    # error when that one was seen in the same poll)
    text = job.output()
    assert re.search(r"rank\s+: 3 \(local_rank: 1\)\s+exitcode\s+: -9 .*\(SIGKILL\)", text), text[-3000:]
    print(f"killed rank 3 at step {logged_steps(out)}; job ended in {elapsed:.1f} s, exit codes {codes}")


@pytest.mark.slow  # CI: the elastic restart across hosts (tests/cluster/test_elastic.py) restarts and resumes
def test_max_restarts_resume_from_the_last_checkpoint(tmp_path, job, reference):
    """Done 3 (second half): with --max-restarts 1 both agents restart their workers after a rank dies; the workers
    resume (checkpoint.resume auto) from the last checkpoint, and the losses are those of an uninterrupted run."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = restart_args(out, ckpt)
    agents = job.nodes(2, 2, args, restarts=1)
    job.wait_for(lambda: (ckpt / "latest").exists(), "checkpoint")
    job.worker(3).kill()
    assert job.wait(agents) == [0, 0], job.output()[-3000:]
    assert "resumed from " + str(ckpt / "step_") in job.output(), job.output()[-3000:]
    assert final_losses(out) == pytest.approx(reference, rel=1e-5)


def test_sigterm_saves_exits_zero_and_resumes_exactly(tmp_path, job, reference):
    """Done 4: SIGTERM to every worker of a running job (a scheduler's preemption notice) saves a checkpoint and
    the job exits 0; a new launch with checkpoint.resume auto continues with the uninterrupted losses."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = train_args(
        out,
        "--checkpoint.dir",
        str(ckpt),
        "--checkpoint.every",
        "1000",
        "--checkpoint.resume",
        "auto",
        "--parallel.timeout_s",
        "30",
    )
    (agent,) = job.nodes(1, 2, args)
    job.wait_for(lambda: logged_steps(out) >= 1, "a logged step")
    for rank in range(2):
        job.worker(rank).send_signal(signal.SIGTERM)
    assert job.wait([agent]) == [0], job.output()[-3000:]
    stopped = logged_steps(out)
    assert stopped < STEPS, "the run finished before the signal; nothing was tested"
    # checkpoint.every is larger than the run: the one checkpoint is the one the signal asked for
    assert sorted(p.name for p in ckpt.glob("step_*")) == [f"step_{stopped:06d}"], job.output()[-3000:]
    assert f"stopping after step {stopped}" in job.output()
    (agent,) = job.nodes(1, 2, args)
    assert job.wait([agent]) == [0], job.output()[-3000:]
    assert "resumed from " + str(ckpt / "step_") in job.output(), job.output()[-3000:]
    assert final_losses(out) == pytest.approx(reference, rel=1e-5)


def test_timeout_must_be_positive():
    with pytest.raises(ConfigError, match=r"^parallel.timeout_s=0.0 must be > 0$"):
        load(["--parallel.timeout_s", "0"])


def _stuck_peer(argv: list[str], flag: str):
    """Rank 2, rank 0's dp peer at tp 2 x dp 2, stops answering until rank 0's all-reduce has returned (``flag``
    appears; at most 5 minutes); rank 0's dp all-reduce must fail after parallel.timeout_s. Waiting for the flag
    instead of a fixed sleep keeps rank 2 alive however slowly a loaded machine runs rank 0."""
    ctx = ParallelContext.from_config(load(argv))
    assert ctx.get_data_parallel_group_ranks() == ([0, 2] if ctx.rank in (0, 2) else [1, 3])
    if ctx.rank == 2:
        deadline = time.monotonic() + 300
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(4), group=ctx.dp_group)
        error = ""
    except RuntimeError as e:
        error = str(e)
    elapsed = time.perf_counter() - start
    if ctx.rank == 0:
        Path(flag).touch()
    return elapsed, error


def test_collective_timeout_applies_to_every_group(tmp_path):
    """parallel.timeout_s bounds a collective on a mesh sub-group (torch gives new groups a 30-minute gloo default
    of their own unless told otherwise): with 2 s, a peer that stops answering fails the dp all-reduce after about
    2 s. The bound is a ratio to the configured timeout, loose enough for a loaded machine and still 30 times
    below the 30-minute default it guards against."""
    timeout = 2.0
    elapsed, error = run_ranks(
        _stuck_peer,
        4,
        ["--parallel.timeout_s", str(timeout), "--parallel.tp", "2", "--model.num_layers", "2"],
        str(tmp_path / "done"),
        timeout_s=600,
    )[0]
    assert "Timed out" in error or "timeout" in error.lower(), error
    assert 0.75 <= elapsed / timeout <= 30, elapsed


@needs_pdsh
@pytest.mark.slow  # CI: pdsh over ssh across two hosts (tests/cluster/test_hosts.py)
def test_deepspeed_launcher_over_ssh_with_pdsh(tmp_path, local_sshd, reference):
    """Training started by the deepspeed launcher through pdsh and ssh; losses as the one-node reference."""
    out = tmp_path / "run"
    run = subprocess.run(
        [*deepspeed_over_ssh(tmp_path, local_sshd, 2), *train_args(out)],
        cwd=ROOT,
        env=local_sshd.pdsh_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "localhost: layout tp=2 pp=1 dp=1" in run.stdout  # printed by rank 0 under pdsh (its host prefix)
    assert read_losses(out) == pytest.approx(reference, rel=1e-5)


@needs_pdsh
@pytest.mark.slow  # CI: test_hosts' deepspeed run needs GLOO_SOCKET_IFNAME from .deepspeed_env on h2 to start at all
def test_deepspeed_env_file_reaches_the_ranks_over_ssh(tmp_path, local_sshd):
    """A variable in the .deepspeed_env file (DS_ENV_FILE names it) is set in every rank started over ssh, where
    the login shell would not have it: the ranks here run `env` itself (--no_python)."""
    env_file = tmp_path / "deepspeed_env"
    env_file.write_text("ENGINE_TEST_MARK=from-deepspeed-env\n")
    env = {**local_sshd.pdsh_env(), "DS_ENV_FILE": str(env_file)}  # absolute: the launcher's os.path.join keeps it
    run = subprocess.run(
        [*deepspeed_over_ssh(tmp_path, local_sshd, 2), "--no_python", "--no_local_rank", "env"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("localhost: ENGINE_TEST_MARK=from-deepspeed-env") == 2, run.stdout[-3000:]
