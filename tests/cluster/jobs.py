"""Multi-node jobs on one machine, shared by tests/cluster/'s files: torchrun agents started as subprocesses
(Job), the shrunk model they train (train_args) and its losses, the one-node reference run, and the deepspeed
launcher over ssh."""

from __future__ import annotations

import itertools
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

from tests import shrunk
from tests.cli import ROOT
from tests.dist import free_port

STEPS = 12

# c10d's C++ stack-trace lines (frames, "Exception raised from", socket warnings)
NOISE = re.compile(r"\s*(frame #\d+|<omitting python frames>|Exception raised from|\[W\d{4} .*(socket|TCPStore)\.cpp)")


def records(out_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, a record per logged step, in order (a resumed run appends its steps again)."""
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def read_losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in records(out_dir)]


def per_step(out_dir: Path) -> dict[int, dict]:
    """Each step's record, the last one winning: a resumed run appends the steps after its checkpoint again."""
    return {r["step"]: r for r in records(out_dir)}


# A shrunk tiny model (each process start costs ~10 s of imports here; the steps are cheap); tp 2 keeps the tensor
# parallel peers on one node and puts dp across the nodes, as a real multi-node layout does.
SHRUNK = [
    *shrunk.SHRUNK,
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


def agent(
    nnodes: int | str,
    nproc: int,
    endpoint: str,
    args: list[str],
    restarts: int = 0,
    node_rank: int | None = None,
    rdzv_id: str | None = None,
    conf: str = RDZV_CONF,
) -> list[str]:
    """One torchrun agent of an ``nnodes``-node job (or "min:max") meeting the others at ``endpoint`` (c10d)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        *(["--node-rank", str(node_rank)] if node_rank is not None else []),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        *(["--rdzv-id", rdzv_id] if rdzv_id is not None else []),
        "--rdzv-conf",
        conf,
        "--max-restarts",
        str(restarts),
        *args,
    ]


class Job:
    """Agents started as subprocesses, output in log files; anything left running is killed at teardown."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = log_dir, []
        self.starts = itertools.count()  # a log per start, never reused (a killed agent's log stays readable)

    def next_log(self) -> Path:
        """The log file of the next agent started (output() reads them in this order)."""
        return self.log_dir / f"agent{next(self.starts)}.log"

    def start(self, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        with self.next_log().open("w") as log:  # the child keeps its own handle
            self.procs.append(
                subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
            )
        return self.procs[-1]

    def nodes(self, nnodes: int, nproc: int, args: list[str], restarts: int = 0) -> list[subprocess.Popen]:
        port = free_port()
        # Restarts need a fresh store per round: torch >= 2.5 shares the rendezvous store with the workers and
        # a restarted round then reads the dead round's gloo/NCCL addresses (pytorch/pytorch#135712, #167288).
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if restarts else None
        endpoint = f"127.0.0.1:{port}"
        return [self.start(agent(nnodes, nproc, endpoint, args, restarts, node_rank=r), env) for r in range(nnodes)]

    def wait(self, procs: list[subprocess.Popen], timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]

    def output(self) -> str:
        """Every agent's log, in start order."""
        logs = sorted(
            (p for p in self.log_dir.glob("agent*.log") if p.stem[5:].isdigit()), key=lambda p: int(p.stem[5:])
        )
        return "\n".join(p.read_text() for p in logs)

    def readable(self, tail: int = 5000) -> str:
        """The end of output() without c10d's C++ stack traces (an agent that lost its store prints pages of them,
        which filled a failed assertion's whole message once)."""
        return "\n".join(line for line in self.output().splitlines() if not NOISE.match(line))[-tail:]

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
                codes = [p.poll() for p in self.procs]
                raise AssertionError(f"the job ended before {what} (exit codes {codes}):\n{self.readable()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s:\n{self.readable()}")
            time.sleep(0.05)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the agent and its workers (start_new_session)
                except ProcessLookupError:
                    pass
                p.wait()


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


def final_losses(out_dir: Path, steps: int = STEPS) -> list[float]:
    """The loss of each step 1..steps, the last record of a step winning: a resumed run appends the steps after
    its checkpoint again."""
    losses = {step: r["loss"] for step, r in per_step(out_dir).items()}
    assert sorted(losses) == list(range(1, steps + 1)), sorted(losses)
    return [losses[s] for s in range(1, steps + 1)]


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
