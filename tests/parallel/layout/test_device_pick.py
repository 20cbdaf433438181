"""Device and backend on a machine with GPUs, simulated on the CPU (issue 24 item 7): forked gloo ranks never get
CUDA (engine/parallel/layout/spawn.py sets ENGINE_CPU_ONLY=1), and more local ranks than GPUs under nccl is one clear
ConfigError instead of NCCL's "Duplicate GPU detected" from inside its set-up."""

import os

import pytest
import torch

from engine.errors import ConfigError
from engine.parallel.layout.context import CPU_ONLY_ENV, pick_device_and_backend
from tests.dist import run_ranks


@pytest.fixture
def one_gpu(monkeypatch):
    """torch.cuda as on a machine with one GPU visible (no CUDA call is made: only the answers are replaced)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv(CPU_ONLY_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def test_one_rank_on_one_gpu_gets_it(one_gpu):
    assert pick_device_and_backend("auto", 0) == (torch.device("cuda", 0), "nccl")
    assert pick_device_and_backend("gloo", 0) == (torch.device("cpu"), "gloo")


def test_more_local_ranks_than_gpus_is_one_line(one_gpu, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"LOCAL_WORLD_SIZE=2 ranks on this node but 1 GPU\(s\) visible"):
        pick_device_and_backend("auto", 1)
    assert pick_device_and_backend("gloo", 1) == (torch.device("cpu"), "gloo")


def test_cpu_only_never_asks_cuda(one_gpu, monkeypatch):
    monkeypatch.setenv(CPU_ONLY_ENV, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("torch.cuda was asked"))
    assert pick_device_and_backend("auto", 0) == (torch.device("cpu"), "gloo")
    with pytest.raises(ConfigError, match=f"backend=nccl needs CUDA, but {CPU_ONLY_ENV}=1"):
        pick_device_and_backend("nccl", 0)


def _rank_device() -> tuple[str, str, str]:
    device, backend = pick_device_and_backend("auto", int(os.environ["LOCAL_RANK"]))
    return str(device), backend, os.environ.get("CUDA_VISIBLE_DEVICES")


def test_forked_gloo_ranks_run_on_the_cpu_with_a_gpu_visible(one_gpu):
    """The forked ranks inherit the patched torch.cuda (one GPU available): without spawn's ENGINE_CPU_ONLY both
    would pick cuda:0 with nccl."""
    assert run_ranks(_rank_device, 2) == [("cpu", "gloo", "")] * 2


def test_the_test_session_hides_cuda():
    """tests/conftest.py: CUDA hidden from the session (and what it starts) unless ENGINE_TEST_CUDA=1."""
    if os.environ.get("ENGINE_TEST_CUDA") == "1":
        pytest.skip("ENGINE_TEST_CUDA=1 keeps the GPUs visible")
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert not torch.cuda.is_available()
