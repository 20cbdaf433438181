"""Run a function on N local gloo ranks by forking the current, already-imported process (tests, benchmarks).

Forking skips re-importing torch in every rank (an 8-rank test starts in about a second instead of ~10 s with
torchrun). Each rank gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* in its environment, exactly as torchrun sets them, and
an initialised gloo process group, so the code runs the same path as under a launcher, on the CPU (ENGINE_CPU_ONLY=1:
engine/parallel/layout/context.py), whatever GPUs the machine has. The caller must not have
run multi-threaded torch ops before forking (GNU OpenMP is not fork-safe; see tests/conftest.py).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel.layout.context import CPU_ONLY_ENV
from engine.parallel.layout.threads import OVERRIDE_ENV, set_threads


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, fn, args: tuple, result_dir: str, timeout_s: float, threads: int | None
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    # Gloo ranks run on the CPU even where GPUs are visible: pick_device_and_backend would give each forked rank
    # cuda:LOCAL_RANK % GPUs with nccl (on one GPU all of them cuda:0), and a forked child cannot use CUDA at all
    # once its parent has initialised it. The child never asks torch.cuda, and hides the GPUs from what it starts.
    os.environ.update({CPU_ONLY_ENV: "1", "CUDA_VISIBLE_DEVICES": ""})
    # The ranks share the machine's cores; oversubscribing them makes gloo tests crawl. The count is
    # ParallelContext.from_config's (engine/parallel/layout/threads.py), and an explicit ``threads`` goes through
    # OMP_NUM_THREADS so that from_config, which the rank function usually calls, keeps it.
    if threads:
        os.environ[OVERRIDE_ENV] = str(threads)
    set_threads(world_size)
    # A rank stuck outside a collective (which the process-group timeout would catch) prints its stack and exits,
    # so a hang fails the test instead of stalling the suite.
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
        torch.save(result, Path(result_dir) / f"{rank}.pt")
        _finish_together()
    except BaseException:
        # Recorded before the finally closes this rank's connections, so before any peer fails because of it:
        # run_ranks names the rank that failed first, not a peer's "Connection closed by peer" that followed.
        (Path(result_dir) / f"{rank}.err").write_text(f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _finish_together() -> None:
    """Wait for the peers before tearing down: a rank that closed its gloo pairs while a peer was still inside its
    last collective (which this rank had already completed) rarely gave the peer "Connection reset by peer". The
    barrier has the process group's timeout; a rank that raised skips it (the finally alone), so it exits at once,
    start_processes' join terminates the peers waiting here and the caller gets that rank's traceback. A barrier
    that itself fails after this rank's result is saved does not fail the rank: ``fn`` may have left a pair broken
    on purpose (tests/parallel/pp/test_pipeline_nccl_rules.py refuses a mismatched send, which closes that pair in
    gloo), and a
    peer that really failed reports its own exception."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except RuntimeError:  # gloo: "Connection closed by peer" from a pair fn broke; the result is already saved
        pass


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0, threads: int | None = None) -> list:
    """Run ``fn(*args)`` on ``world_size`` forked gloo ranks; returns each rank's return value, by rank.
    ``fn`` must be a module-level function; an exception in any rank fails the caller with that rank's traceback.
    ``threads``: torch threads per rank (default: the cores shared evenly)."""
    with tempfile.TemporaryDirectory() as result_dir:
        try:
            mp.start_processes(
                _worker,
                args=(world_size, free_port(), fn, args, result_dir, timeout_s, threads),
                nprocs=world_size,
                join=True,
                start_method="fork",
            )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            first = _first_failure(Path(result_dir))
            if first is None:  # killed without raising (a signal, the faulthandler timeout): torch's own message
                raise
            raise RuntimeError(f"rank {first[0]} failed first:\n{first[1]}") from e
        return [torch.load(Path(result_dir) / f"{r}.pt", weights_only=False) for r in range(world_size)]


def _first_failure(result_dir: Path) -> tuple[int, str] | None:
    """(rank, traceback) of the earliest exception any rank recorded, or None. torch's join reports whichever
    failed rank it looks at first, which may be a peer that only lost its connection to the one that raised."""
    failures = []
    for path in result_dir.glob("*.err"):
        when, _, trace = path.read_text().partition("\n")
        try:
            failures.append((float(when), int(path.stem), trace))
        except ValueError:  # cut short: join terminated that rank while it wrote
            continue
    return min(failures)[1:] if failures else None
