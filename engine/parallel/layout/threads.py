"""How many torch (intra-op) threads each process of this node uses: the cores it may run on, shared evenly among
the node's ranks, unless OMP_NUM_THREADS says otherwise.

torch alone takes every core in every process, so N ranks on a node oversubscribe it N times; and on a machine
shared with other jobs even one process spends its time in OpenMP's spin-waits (measured on 2 busy cores, load
11-23: 10 steps of configs/tiny.yaml took 1:34 with 2 threads and 0:20 with OMP_NUM_THREADS=1). Called where the
device and backend are picked (engine/parallel/layout/context.py) and by the forked test ranks
(engine/parallel/layout/spawn.py).
"""

from __future__ import annotations

import os

import torch

from engine.config import ConfigError

OVERRIDE_ENV = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as taskset or a container's cpuset limit it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def thread_count(local_world: int, cores: int, env: dict) -> tuple[int, str]:
    """(threads per process, why): OMP_NUM_THREADS when set, else max(1, cores // local ranks)."""
    raw = env.get(OVERRIDE_ENV, "")
    if raw.strip():
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(
                f"environment variable {OVERRIDE_ENV}={raw!r} is not a positive integer; unset it to "
                f"share the cores among the ranks"
            )
        return n, f"{OVERRIDE_ENV}={n}"
    ranks = max(1, local_world)
    return (
        max(1, cores // ranks),
        f"{cores} core{'s' * (cores != 1)} / {ranks} local rank{'s' * (ranks != 1)}; {OVERRIDE_ENV} overrides",
    )


def set_threads(local_world: int, env: dict | None = None) -> str:
    """Set this process's torch threads (thread_count) and return the line that says so."""
    n, why = thread_count(local_world, usable_cores(), os.environ if env is None else env)
    torch.set_num_threads(n)
    return f"torch threads: {n} per process ({why})"


def local_world_size(env: dict | None = None) -> int:
    """This node's rank count as the launchers set it: LOCAL_WORLD_SIZE (torchrun), LOCAL_SIZE (deepspeed)."""
    env = os.environ if env is None else env
    raw = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or "1"
    try:
        return max(1, int(raw))
    except ValueError:
        raise ConfigError(f"environment variable LOCAL_WORLD_SIZE={raw!r} is not an integer") from None
