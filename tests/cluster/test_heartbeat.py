"""The heartbeat's watchdog (engine/cluster/heartbeat.py) on forked gloo ranks, its exit replaced by a record: a
frozen peer is named while this rank's main thread is blocked in a pipeline recv, and a frozen store host is
named as the store's. SIGSTOP freezes a rank's threads with it, as a hung host would; SIGCONT lets it finish.
The bounds here are generous upper bounds (a loaded machine only makes detection later, never wrong)."""

from __future__ import annotations

import os
import re
import signal
import time

import torch
import torch.distributed as dist

from engine.cluster.heartbeat import Heartbeat
from tests.dist import run_ranks

TIMEOUT = 3.0
BOUND_S = 30.0  # detection takes TIMEOUT + TIMEOUT / 10; the rest is room for a loaded machine


def _watch(frozen: int, recv: bool):
    """Rank ``frozen`` stops itself; the others wait for their watchdog's verdict (rank 1 blocked in a recv from
    the frozen rank when ``recv``), then the first of them lets it go on. Returns (verdict, seconds, exit codes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    codes: list[int] = []
    beat = Heartbeat(rank, world, TIMEOUT, exit_fn=codes.append).start()
    while beat._beats < 2:  # every rank has beaten and named its host (counted, not slept: a loaded fork's first
        time.sleep(0.05)  # connect can take longer than two beats, and its host was then "an unknown host")
    dist.barrier()
    start = time.monotonic()
    if rank == frozen:
        os.kill(os.getpid(), signal.SIGSTOP)
        if recv:
            dist.send(torch.ones(1), dst=1)
        beat.stop()
        return None
    if recv and rank == 1:
        dist.recv(torch.zeros(1), src=frozen)  # returns only once the frozen rank is let go
    while (beat.verdict is None or not codes) and time.monotonic() - start < BOUND_S + 30:  # the verdict is set,
        # then acknowledged by the live ranks (engine/cluster/verdict.py), then exit_fn is called
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    if rank == min(r for r in range(world) if r != frozen):
        os.kill(pids[frozen], signal.SIGCONT)
    beat.stop()
    return beat.verdict, elapsed, codes


def test_frozen_peer_is_named_while_a_rank_waits_in_a_pipeline_recv():
    results = run_ranks(_watch, 3, 2, True, timeout_s=300)
    for verdict, elapsed, codes in results[:2]:
        assert verdict and re.match(
            r"error: rank 2 on host \S+ \(127\.0\.0\.1\) silent for \d+ s .* at step 0", verdict
        ), verdict
        assert codes == [1] and elapsed < BOUND_S, (elapsed, codes)


def test_frozen_store_host_is_named_as_the_store():
    """Rank 0 serves the store here (torch's env:// rendezvous): frozen, it answers nobody, and the others name
    the store and its host instead of waiting for it."""
    results = run_ranks(_watch, 3, 0, False, timeout_s=300)
    for verdict, elapsed, codes in results[1:]:
        assert verdict and re.match(
            r"error: the job's store at 127\.0\.0\.1:\d+ \(host \S+ \(127\.0\.0\.1\)\) has "
            r"stopped answering \(dead, frozen or cut off\) at step \d+; ending the job",
            verdict,
        ), verdict
        assert codes == [1] and elapsed < BOUND_S, (elapsed, codes)


# The thresholds themselves (the timeout against a stall shorter than it, the start-up bound for a late first beat,
# the alarm's few beats) are counted in beats, not waited for, in tests/cluster/test_heartbeat_beats.py: they were
# timing tests here (3 s and 4 s heartbeats, a SIGSTOP of half a timeout) that a loaded machine could fail.
