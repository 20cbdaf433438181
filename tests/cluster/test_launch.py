"""launch/pretrain.py under the two real launchers, torchrun and deepspeed (one host, two processes)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from tests.cli import ROOT
from tests.cluster.jobs import read_losses
from tests.dist import free_port

TRAIN = ["launch/pretrain.py", "--config", "configs/tiny.yaml", "--train.steps", "3", "--log.progress", "false"]


def run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    out_dir = tmp_path_factory.mktemp("single")
    run([sys.executable, *TRAIN, "--train.out_dir", str(out_dir)])
    return read_losses(out_dir)


@pytest.mark.slow  # CI: tp 2 x pp 2 across two hosts under the deepspeed launcher (tests/cluster/test_hosts.py)
def test_torchrun_tp2_pp2(tmp_path, reference):
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            "--master-port",
            str(free_port()),
            *TRAIN,
            "--parallel.tp",
            "2",
            "--parallel.pp",
            "2",
            "--train.out_dir",
            str(tmp_path),
        ]
    )
    assert read_losses(tmp_path) == pytest.approx(reference, rel=1e-5)


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not installed")
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param([], marks=pytest.mark.slow),
        pytest.param(["--parallel.dp_mode", "zero", "--parallel.zero_stage", "2"], marks=pytest.mark.slow),
    ],  # CI: the deepspeed launcher (pdsh over ssh) across two hosts, and ZeRO-2 under torchrun there (test_hosts)
    ids=["ddp", "zero2"],
)
def test_deepspeed_launcher_dp2(tmp_path, reference, mode):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    run(
        [
            "deepspeed",
            "--hostfile",
            str(hostfile),
            "--no_ssh_check",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            *TRAIN,
            *mode,
            "--parallel.dp",
            "2",
            "--train.out_dir",
            str(tmp_path),
        ]
    )
    assert read_losses(tmp_path) == pytest.approx(reference, rel=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.slow  # CI: ZeRO-3 in the parity matrix, ZeRO-2 under torchrun across hosts
def test_torchrun_zero3_dp2(tmp_path, reference):
    # ZeRO under torchrun: DeepSpeed wraps the process group the engine already made.
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            *TRAIN,
            "--parallel.dp_mode",
            "zero",
            "--parallel.zero_stage",
            "3",
            "--train.out_dir",
            str(tmp_path),
        ]
    )
    assert read_losses(tmp_path) == pytest.approx(reference, rel=1e-5)
