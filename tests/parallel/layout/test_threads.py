"""Torch threads per process (engine/parallel/layout/threads.py): the usable cores shared among the node's ranks unless
OMP_NUM_THREADS says otherwise, set where the device is picked (ParallelContext.from_config, which rank 0 logs) and
the same in forked test ranks (engine/parallel/layout/spawn.py)."""

import contextlib
import io
import os

import pytest
import torch

from engine.config import ConfigError, load
from engine.parallel.layout import threads
from tests.dist import run_ranks


@pytest.mark.parametrize(
    "local_world,cores,env,want",
    [
        (1, 2, {}, (2, "2 cores / 1 local rank; OMP_NUM_THREADS overrides")),
        (2, 2, {}, (1, "2 cores / 2 local ranks; OMP_NUM_THREADS overrides")),
        (4, 2, {}, (1, "2 cores / 4 local ranks; OMP_NUM_THREADS overrides")),  # never 0
        (2, 16, {}, (8, "16 cores / 2 local ranks; OMP_NUM_THREADS overrides")),
        (2, 16, {"OMP_NUM_THREADS": "3"}, (3, "OMP_NUM_THREADS=3")),
        (1, 2, {"OMP_NUM_THREADS": ""}, (2, "2 cores / 1 local rank; OMP_NUM_THREADS overrides")),  # empty: unset
    ],
)
def test_thread_count(local_world, cores, env, want):
    assert threads.thread_count(local_world, cores, env) == want


@pytest.mark.parametrize("raw", ["0", "-1", "two"])
def test_bad_omp_num_threads_is_one_line(raw):
    with pytest.raises(ConfigError, match=f"OMP_NUM_THREADS='{raw}' is not a positive integer"):
        threads.thread_count(1, 2, {"OMP_NUM_THREADS": raw})


def test_usable_cores_follow_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert threads.usable_cores() == 1


def _threads_in_rank(argv: list[str]) -> dict:
    """Rank function: torch's threads as spawned, then after from_config, and what from_config printed."""
    from engine.parallel.layout.context import ParallelContext

    spawned = torch.get_num_threads()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ParallelContext.from_config(load(argv))
    return {"spawned": spawned, "after": torch.get_num_threads(), "printed": printed.getvalue()}


def test_forked_rank_keeps_its_count_through_from_config(monkeypatch):
    """Without OMP_NUM_THREADS a single process takes all usable cores and says so; a rank forked with an explicit
    count keeps it through from_config (before, from_config reset it to cores // local ranks)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # forked ranks inherit the parent's environment
    argv = ["--config", "configs/tiny.yaml"]
    cores = threads.usable_cores()
    (got,) = run_ranks(_threads_in_rank, 1, argv)
    assert got["spawned"] == got["after"] == cores
    s = "s" * (cores != 1)
    assert (
        got["printed"] == f"torch threads: {cores} per process ({cores} core{s} / 1 local rank; "
        f"OMP_NUM_THREADS overrides)\n"
    )
    (got,) = run_ranks(_threads_in_rank, 1, argv, threads=1)
    assert got["spawned"] == got["after"] == 1, got
    assert got["printed"] == "torch threads: 1 per process (OMP_NUM_THREADS=1)\n"
