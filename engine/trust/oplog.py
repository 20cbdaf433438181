"""The operation log: each rank's ring buffer of the engine's own communication operations (issue 44, hang
localisation). The places that already wrap communication call ``begin`` before an operation and ``end`` after it
(engine/parallel/autograd/comm.py, the pipeline executor's batches, the dp modes' and the trainer's reductions);
the trainer sets ``LOG.step`` and the executor ``LOG.where`` (the schedule action being run). Nothing of torch is
patched. engine/trust/hang.py reads the tail when the job stops making progress.

A record is one list, written in place into a slot of a fixed ring: [seq, kind, group, what, peer, bytes, step,
action, micro-batch, chunk, start, end] (the group is the process group object itself, named only when a tail is
posted). ``begin`` + ``end`` cost two ``time.monotonic`` calls and a list, under a microsecond
(launch/bench/oplog.py). Standard library only (floor 0 in docs/architecture.md): the parallel floor imports it.

Test-only fault injection, read here and nowhere else: ``ENGINE_TEST_HANG=POINT:RANK:STEP`` makes global rank RANK,
at step STEP, ``sleep_forward`` (sleep inside a stage's forward), ``skip_collective`` (skip the step's agreement
all-reduce over the world, engine/trainer.py ``agree``) or ``wrong_peer`` (post a pipeline receive from a rank that
never sends it); ``fault(POINT)`` says when (``arm`` reads the variable).
"""

from __future__ import annotations

import os
import time

SIZE = 64  # records kept per rank: the in-flight batch of a schedule and the step's reductions fit many times
FAULT_ENV = "ENGINE_TEST_HANG"
POINTS = ("sleep_forward", "skip_collective", "wrong_peer")


class OpLog:
    """One rank's ring of records; ``done`` counts the operations that ended (progress, for the watchdog)."""

    def __init__(self, size: int = SIZE):
        self.ring: list[list | None] = [None] * size
        self.size, self.n, self.done = size, 0, 0
        self.step = 0  # the step being run (the trainer's completed steps + 1)
        self.where: tuple[str, int, int] = ("", -1, 0)  # (schedule action, micro-batch, chunk) being run

    def begin(self, kind: str, group, what: str, nbytes: int = 0, peer: int = -1) -> int:
        i = self.n
        action, mb, chunk = self.where
        now = time.monotonic()
        self.ring[i % self.size] = [i, kind, group, what, peer, nbytes, self.step, action, mb, chunk, now, 0.0]
        self.n = i + 1
        return i

    def end(self, i: int) -> None:
        record = self.ring[i % self.size]
        if record is not None and record[0] == i:
            record[11] = time.monotonic()
        self.done += 1

    def tail(self, count: int = SIZE) -> list[list]:
        """The last ``count`` records, oldest first (copies: the main thread may be writing)."""
        first = max(0, self.n - min(count, self.size))
        return [list(r) for i in range(first, self.n) if (r := self.ring[i % self.size]) is not None and r[0] == i]


LOG = OpLog()
begin, end = LOG.begin, LOG.end


class logged:
    """``with logged(kind, group, what, nbytes, peer): dist.all_reduce(...)``: ``begin`` before the block, ``end``
    after it; an operation that raised never ended (its record stays open, as a hang's would)."""

    __slots__ = ("args", "i")

    def __init__(self, kind: str, group, what: str, nbytes: int = 0, peer: int = -1):
        self.args = (kind, group, what, nbytes, peer)

    def __enter__(self) -> None:
        self.i = LOG.begin(*self.args)

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            LOG.end(self.i)


def parse_fault(text: str, rank: int) -> tuple[str, int] | None:
    """(point, step) when ``text`` (POINT:RANK:STEP) names this rank; None otherwise or when it is empty."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in POINTS or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return (parts[0], int(parts[2])) if int(parts[1]) == rank else None


FAULT: tuple[str, int] | None = None
_fired: set[str] = set()


def arm(rank: int) -> None:
    """Read ENGINE_TEST_HANG for global rank ``rank`` (engine/trust/hang.py, as the trainer starts): a forked rank
    reads its own environment, not its parent's at import."""
    global FAULT
    FAULT = parse_fault(os.environ.get(FAULT_ENV, ""), rank)
    _fired.clear()


def fault(point: str) -> bool:
    """True once, on the rank and at the step ENGINE_TEST_HANG names, at ``point`` (never in a normal run)."""
    if FAULT is None or FAULT[0] != point or LOG.step < FAULT[1] or point in _fired:
        return False
    _fired.add(point)
    return True
