"""Session set-up shared by every test."""
import os
import subprocess

# The suite means gloo on the CPU (the project's rule: everything runs there). On a machine with a GPU, CUDA is
# hidden from the test session and every process it starts, before torch can initialise it: otherwise the launcher
# tests' ranks would all pick cuda:0 with nccl (NCCL refuses two ranks on one GPU: "Duplicate GPU detected"), and a
# pytest process that initialised CUDA before forking would break its forked ranks. ENGINE_TEST_CUDA=1 keeps the
# GPUs visible (forked gloo ranks still run on the CPU: engine/cluster/spawn.py).
if os.environ.get("ENGINE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# ZeRO-Offload's DeepSpeedCPUAdam is a C++ op DeepSpeed JIT-builds on first use (455 s on 2 cores): the suite uses
# it where it is already built and otherwise DeepSpeed's documented fallback, torch AdamW stepping on the host
# (engine/parallel/dp/zero.py offload_optimizer), so a fresh CI machine never compiles inside a test.
os.environ.setdefault("ENGINE_CPU_ADAM_BUILD", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# The pytest process forks gloo ranks (tests/dist.py). GNU OpenMP, which CPU torch uses for intra-op parallelism,
# is not fork-safe: once the parent has run a multi-threaded op, a child that runs one hangs. So the parent stays
# single-threaded, and each forked rank picks its own thread count.
torch.set_num_threads(1)

# Forked ranks inherit the parent's imports: pay for transformers and torch's lazy modules once, not per rank.
from tests.dist import warm_imports  # noqa: E402

warm_imports()


@pytest.fixture(autouse=True)
def _no_process_group_left_in_the_parent():
    """A test that initialises torch.distributed in the pytest process (instead of a forked rank) breaks every
    later test: forked ranks inherit the initialised default group and fail with 'initialize the default process
    group twice'. Fail the culprit by name instead, and clean up so the rest of the suite still runs."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a torch.distributed process group in the pytest process; run the Trainer in "
                    "a forked rank (tests/dist.run_ranks)")


@pytest.fixture
def live_pid():
    """A live process on this host that is neither this one nor its parent (the directory locks of
    engine/checkpoint/lock.py count both as the same job's own): a rival job's pid for lock tests."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()
