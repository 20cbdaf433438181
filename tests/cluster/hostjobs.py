"""Jobs on the test hosts (tests/hosts.py): the shrunk model's arguments, one torchrun agent per host or the
deepspeed launcher on the first, and the one-process records they are held against (fp32 parity bounds)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import hosts
from tests.cli import ROOT
from tests.cluster.jobs import SHRUNK, agent, records
from tests.parity.runner import FP32

STEPS = 4
MODEL = SHRUNK[:-4]  # the shrunk model, without test_multinode's tp and step count
LIMIT_S = 420  # one job on 2 loaded cores: imports dominate


def train_args(out_dir: Path, *extra: str, config: str = "configs/tiny.yaml") -> list[str]:
    return [
        "launch/pretrain.py",
        "--config",
        config,
        *MODEL,
        "--train.steps",
        str(STEPS),
        "--train.out_dir",
        str(out_dir),
        "--parallel.timeout_s",
        "120",
        *extra,
    ]


def start_one_process(out: Path, *extra: str, config: str = "configs/tiny.yaml") -> subprocess.Popen:
    """One process of ``config`` (shrunk as train_args shrinks it, then ``extra``) training into ``out``; its
    records come from ``finish_one_process``. Started while a test waits on a fault, it costs no extra time."""
    return subprocess.Popen(
        [sys.executable, *train_args(out, *extra, config=config)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def finish_one_process(proc: subprocess.Popen, out: Path) -> list[dict]:
    _, err = proc.communicate(timeout=LIMIT_S)
    assert proc.returncode == 0, err[-3000:]
    return records(out)


def one_process(out: Path, *extra: str, config: str = "configs/tiny.yaml") -> list[dict]:
    """The records of one process of ``config`` (shrunk as train_args shrinks it, then ``extra``) trained into
    ``out``."""
    return finish_one_process(start_one_process(out, *extra, config=config), out)


def assert_follows(out_dir: Path, reference: list[dict]) -> None:
    got = records(out_dir)
    assert [r["step"] for r in got] == [r["step"] for r in reference]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in reference], rel=FP32.loss)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in reference], rel=FP32.grad_norm)


def start_agents(
    cluster: hosts.Cluster,
    nproc: int,
    args: list[str],
    log_dir: Path,
    env: dict | None = None,
    differ: dict[str, tuple[Path, list[str]]] | None = None,
) -> list[subprocess.Popen]:
    """One torchrun agent started on each host (``nproc`` ranks each), meeting at the first host's address; each
    writes log_dir/agent_<host>.log. ``differ`` {host: (checkout, args)}: a host launched from another checkout or
    with other arguments."""
    endpoint = f"{cluster.hosts[0].addr}:29400"  # each cluster has its own addresses: no port can clash
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for host in cluster.hosts:
        cwd, own = (differ or {}).get(host.name, (ROOT, args))
        cmd = agent(len(cluster.hosts), nproc, endpoint, own, rdzv_id="hosts")
        with (log_dir / f"agent_{host.name}.log").open("w") as log:
            procs.append(
                host.popen(
                    cmd,
                    cwd=cwd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                )
            )
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()  # nsenter's child is torchrun: the cluster's teardown kills what is left, by pid
            p.wait()


def torchrun_on_hosts(
    cluster: hosts.Cluster,
    nproc: int,
    args: list[str],
    log_dir: Path,
    env: dict | None = None,
    differ: dict[str, tuple[Path, list[str]]] | None = None,
) -> tuple[list[int], str]:
    """start_agents, then wait for them: (exit codes, output)."""
    procs = start_agents(cluster, nproc, args, log_dir, env, differ)
    deadline = time.monotonic() + LIMIT_S
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        stop(procs)
    return codes, "\n".join((log_dir / f"agent_{h.name}.log").read_text() for h in cluster.hosts)


def deepspeed_on_hosts(
    cluster: hosts.Cluster, slots: int, args: list[str], tmp_path: Path, env_lines: list[str]
) -> subprocess.CompletedProcess:
    """The deepspeed launcher run on the first host with a hostfile naming every host: pdsh over ssh starts each
    host's share; ``env_lines`` go into the .deepspeed_env file (DS_ENV_FILE names it), the only way to give the
    ranks an environment variable (the launcher forwards its own environment's PYTHON*, NCCL* and a few more)."""
    env_file = tmp_path / "deepspeed_env"
    env_file.write_text("".join(f"{line}\n" for line in ["OMP_NUM_THREADS=1", *env_lines]))
    cmd = [
        "deepspeed",
        "--hostfile",
        str(cluster.hostfile(tmp_path / "hostfile", slots)),
        "--master_port",
        "29500",
        *args,
    ]
    return cluster.hosts[0].run(cmd, cwd=ROOT, timeout=LIMIT_S, env={**os.environ, "DS_ENV_FILE": str(env_file)})
