"""Small collectives over the job's store, gathered to rank 0 (issue 43): the checkpointer's metadata and verdicts,
the shared-directory check (engine/cluster/shared.py) and the stop signal's line.

Each rank posts one key per exchange and reads one answer; rank 0 waits for the others' keys in one request, reads
them in one and deletes them, so a rank makes O(1) store requests per exchange, rank 0 O(N) (one per key it
deletes) and the job O(N), with no connection besides the store's. DCP gathers its save plans to one coordinator
the same way. It replaces a world-sized gloo group: N(N-1)/2 connections whose addresses went through the store at
start-up (N^2 (8N+154) bytes: 552 GB at 4,096 ranks) and 33k sockets per host.

Every rank calls the exchanges of one ``StoreExchange`` in the same order (they are collectives); the exchange
number makes the keys, and an answer is deleted by rank 0 at its next gather, by when every rank has read it.
"""

from __future__ import annotations

import pickle
from datetime import timedelta


class ExchangeTimeout(RuntimeError):
    """A rank did not reach an exchange (or rank 0 did not answer) within the timeout; ``str(e)`` is one line."""


class StoreExchange:
    """Collectives of ``world`` ranks over ``store`` (set, get, wait, multi_get, delete_key, add), under keys
    ``prefix/...``; a rank or the answer missing for ``timeout_s`` raises ExchangeTimeout."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, prefix: str):
        self.store, self.rank, self.world, self.prefix = store, rank, world, prefix
        self.timeout_s, self.seq, self._answers = timeout_s, 0, []

    def gather(self, obj) -> list | None:
        """Rank 0: every rank's ``obj``, by rank; the other ranks: None."""
        self.seq += 1
        if self.rank != 0:
            self.store.set(f"{self.prefix}/{self.seq}/{self.rank}", pickle.dumps(obj))
            return None
        keys = [f"{self.prefix}/{self.seq}/{r}" for r in range(1, self.world)]
        if keys:
            self._wait(keys)
        values = [obj] + [pickle.loads(v) for v in (self.store.multi_get(keys) if keys else [])]
        for key in keys + self._answers:  # every rank posted here, so every earlier answer has been read
            self.store.delete_key(key)
        self._answers = []
        return values

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (the others pass anything)."""
        self.seq += 1
        key = f"{self.prefix}/{self.seq}/answer"
        if self.rank == 0:
            if self.world > 1:
                self.store.set(key, pickle.dumps(obj))
                self._answers.append(key)
            return obj
        self._wait([key])
        return pickle.loads(self.store.get(key))

    def reduce(self, obj, combine):
        """``combine(every rank's obj, by rank)``, computed on rank 0, on every rank."""
        values = self.gather(obj)
        return self.broadcast(combine(values) if self.rank == 0 else None)

    def first(self, obj):
        """The first not-None ``obj`` by rank (e.g. the first rank's error), on every rank; None if none."""
        return self.reduce(obj, lambda values: next((v for v in values if v is not None), None))

    def barrier(self) -> None:
        self.reduce(None, lambda values: None)

    def claim(self, name: str) -> bool:
        """True on the first rank to claim ``name`` in this exchange (one request; ``release`` deletes it)."""
        return self.store.add(f"{self.prefix}/claim/{name}", 1) == 1

    def release(self, name: str) -> None:
        self.store.delete_key(f"{self.prefix}/claim/{name}")

    def _wait(self, keys: list[str]) -> None:
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except RuntimeError:  # torch's DistStoreError: "wait timeout after ..."
            raise ExchangeTimeout(self._late(keys)) from None

    def _late(self, keys: list[str]) -> str:
        limit = f"within {self.timeout_s:.0f} s (parallel.timeout_s)"
        if self.rank != 0:
            return f"rank {self.rank}: rank 0 did not answer exchange {self.seq} of {self.prefix} {limit}"
        late = [r for r, key in enumerate(keys, 1) if not self.store.check([key])]
        shown = ", ".join(map(str, late[:8])) + (f" and {len(late) - 8} more" if len(late) > 8 else "")
        return f"rank 0: rank(s) {shown} did not reach exchange {self.seq} of {self.prefix} {limit}"


def run_steps(steps):
    """Run a protocol written as steps (a generator that yields "gather" or "broadcast" before each exchange) to
    its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def lockstep(protocols: list) -> list:
    """Simulate the world in one thread: ``protocols[r]`` is rank r's steps, every one over the same store.
    Before a gather the other ranks post and then rank 0 collects; before a broadcast rank 0 answers and then the
    others read, so no exchange waits. Every rank's return value, by rank (launch/bench/scale.py, the tests)."""
    results = [None] * len(protocols)

    def advance(r: int):
        try:
            return next(protocols[r])
        except StopIteration as done:
            results[r] = done.value
            return None

    kinds = [advance(r) for r in range(len(protocols))]
    while kinds[0] is not None:
        ranks = list(range(len(protocols)))
        for r in ranks[1:] + ranks[:1] if kinds[0] == "gather" else ranks:
            kinds[r] = advance(r)
    return results
