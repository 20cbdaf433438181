"""Multi-node for real on one machine, and faults: two torchrun agents with their own node ranks on loopback, a
rank killed mid-run, restarts and SIGTERM with checkpoints, collective timeouts, and the deepspeed launcher over
real ssh (pdsh) to localhost. Preflight (launch/preflight.py) has its own file, tests/test_preflight.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from engine.config import ConfigError, load
from engine.parallel.layout.context import ParallelContext
from tests.cluster.test_launch import ROOT, read_losses
from tests.dist import free_port, run_ranks
from tests.sshd import local_sshd  # noqa: F401  (fixture)

STEPS = 12
# A shrunk tiny model (each process start costs ~10 s of imports here; the steps are cheap); tp 2 keeps the tensor
# parallel peers on one node and puts dp across the nodes, as a real multi-node layout does.
SHRUNK = [
    "--model.num_layers",
    "2",
    "--model.hidden_size",
    "64",
    "--model.intermediate_size",
    "128",
    "--model.num_heads",
    "4",
    "--model.num_kv_heads",
    "2",
    "--train.seq_len",
    "32",
    "--log.progress",
    "false",
    "--parallel.tp",
    "2",
    "--train.steps",
    str(STEPS),
]


def train_args(out_dir: Path, *extra: str) -> list[str]:
    return ["launch/pretrain.py", "--config", "configs/tiny.yaml", *SHRUNK, "--train.out_dir", str(out_dir), *extra]


# The c10d rendezvous's store operations time out after read_timeout (60 s by default): an agent whose peer is
# still importing torch on a loaded 2-core machine (CI: several helpers' tests at once) gave up at 60 s. 300 s, and
# 10 s x 6 missed keep-alives (not 5 s x 3) before a starved agent counts as dead. The job's own bounds stay
# parallel.timeout_s (the faults tested here kill workers, not agents).
RDZV_CONF = "read_timeout=300,join_timeout=600,keep_alive_interval=10,keep_alive_max_attempt=6"


def torchrun(nnodes: int, nproc: int, node_rank: int, port: int, args: list[str], restarts: int = 0) -> list[str]:
    """One torchrun agent: a node of an ``nnodes``-node job that meets the others at 127.0.0.1:port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--node-rank",
        str(node_rank),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        RDZV_CONF,
        "--max-restarts",
        str(restarts),
        *args,
    ]


class Job:
    """Agents started as subprocesses, output in log files; anything left running is killed at teardown."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = log_dir, []

    def start(self, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        with (self.log_dir / f"agent{len(self.procs)}.log").open("w") as log:  # the child keeps its own handle
            self.procs.append(
                subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
            )
        return self.procs[-1]

    def nodes(self, nnodes: int, nproc: int, args: list[str], restarts: int = 0) -> list[subprocess.Popen]:
        port = free_port()
        # Restarts need a fresh store per round: torch >= 2.5 shares the rendezvous store with the workers and
        # a restarted round then reads the dead round's gloo/NCCL addresses (pytorch/pytorch#135712, #167288).
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if restarts else None
        return [self.start(torchrun(nnodes, nproc, r, port, args, restarts), env) for r in range(nnodes)]

    def wait(self, procs: list[subprocess.Popen], timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]

    def output(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.log_dir.glob("agent*.log")))

    def worker(self, rank: int) -> psutil.Process:
        """The worker process that torchrun started with RANK=rank (found through the agents' children)."""
        for agent in self.procs:
            for child in psutil.Process(agent.pid).children(recursive=True):
                try:
                    if child.environ().get("RANK") == str(rank):
                        return child
                except psutil.Error:
                    continue
        raise AssertionError(f"no worker with RANK={rank} under the agents")

    def wait_for(self, condition, what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"the job ended before {what}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the agent and its workers (start_new_session)
                except ProcessLookupError:
                    pass
                p.wait()


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.kill_all()


def restart_args(out: Path, ckpt: Path, *extra: str) -> list[str]:
    """train_args with a checkpoint every 3 steps that a restart resumes (auto), collectives bounded at 30 s."""
    return train_args(
        out,
        "--checkpoint.dir",
        str(ckpt),
        "--checkpoint.every",
        "3",
        "--checkpoint.resume",
        "auto",
        "--parallel.timeout_s",
        "30",
        *extra,
    )


def logged_steps(out_dir: Path) -> int:
    path = out_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def final_losses(out_dir: Path) -> list[float]:
    """The loss of each step 1..STEPS, the last record of a step winning: a resumed run appends the steps after
    its checkpoint again."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records}
    assert sorted(losses) == list(range(1, STEPS + 1)), sorted(losses)
    return [losses[s] for s in range(1, STEPS + 1)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The losses of one node x 4 processes (tp 2 x dp 2)."""
    out = tmp_path_factory.mktemp("one_node")
    j = Job(out)
    try:
        (code,) = j.wait(j.nodes(1, 4, train_args(out)))
        assert code == 0, j.output()[-3000:]
    finally:
        j.kill_all()
    losses = read_losses(out)
    assert len(losses) == STEPS
    return losses


@pytest.mark.slow  # CI: the launchers across network-namespace hosts (tests/test_hosts.py)
def test_two_nodes_follow_one_node(tmp_path, job, reference):
    """Done 1: 2 nodes x 2 processes (two agents, their own node ranks, c10d rendezvous on loopback)."""
    out = tmp_path / "run"
    codes = job.wait(job.nodes(2, 2, train_args(out)))
    assert codes == [0, 0], job.output()[-3000:]
    assert "layout tp=2 pp=1 dp=2 on 4 x" in job.output()
    assert read_losses(out) == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow  # CI: tests/test_faults.py kills a rank and names it in one line
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


@pytest.mark.slow  # CI: the elastic restart across hosts (tests/test_elastic.py) restarts and resumes
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


# Outside CI only: .ci/run installs pdsh, so under CI=true a missing one fails the test instead of skipping it.
needs_pdsh = pytest.mark.skipif(
    (shutil.which("deepspeed") is None or shutil.which("pdsh") is None) and os.environ.get("CI") != "true",
    reason="needs the deepspeed launcher and pdsh (apt-get install -y pdsh)",
)


def deepspeed_over_ssh(tmp_path: Path, sshd, slots: int) -> list[str]:
    """The deepspeed launcher's multi-node path (pdsh over ssh), forced onto this one host with --force_multi."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots={slots}\n")
    # --no_ssh_check: the launcher's own check runs a plain `ssh HOST hostname`, without our key; preflight checks.
    return [
        "deepspeed",
        "--hostfile",
        str(hostfile),
        "--force_multi",
        "--ssh_port",
        str(sshd.port),
        "--no_ssh_check",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]


@needs_pdsh
@pytest.mark.slow  # CI: pdsh over ssh across two hosts (tests/test_hosts.py)
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
