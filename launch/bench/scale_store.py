"""Benchmark: what the heartbeat and the start-up cost the job's store at 8 ... 16,384 ranks (issue 43).

    python launch/bench/scale_store.py [--ranks 8 64 512 4096 16384] [--workers 2] [--rounds 5]

A real torch TCPStore (libuv, as torchrun's) serves in a process of its own; ``--workers`` client processes act
for the simulated ranks, each rank running the engine's own code (engine/cluster/startup.py ``arrive`` and
``settle``; engine/cluster/heartbeat.py ``Heartbeat.enter``, ``exchange`` and ``judge``) on a store client
wrapped in a counter of requests, keys and bytes. Printed per N: requests and keys per rank and for the job,
bytes, and the store server's CPU seconds (its process's user + system time from /proc/<pid>/stat: this machine
is shared, so wall time would mean nothing), per heartbeat round and for the whole start-up.

How to read it: the requests and keys per rank must not grow with N (the issue's aim: O(1) per rank); the store's
CPU per round divided by the round's length (``heartbeat_timeout_s / 10``, 3 s by default) is the share of the
store's one thread the heartbeat takes (aim: under 5 % at 16,384 ranks); start-up's CPU is the store's whole
cost of every rank joining (aim: under 60 s at 16,384). A simulated rank shares its worker's few connections with
others (real ranks hold one each, so the server's per-connection cost is not counted), and a rank's listener (one
wait held for the whole job, on a connection of its own) is not run: a check, a wait and a get, once. At start-up
the last rank arrives a second after the others, so the first waiting rank of each connection is blocked that long
(the rest, queued behind it on the connection, are answered at once: the store serves a wait with one request and
one reply however long it is held). ``measure(n)`` is what launch/bench/scale.py calls.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from engine.cluster.heartbeat import Heartbeat, namespace  # noqa: E402
from engine.cluster.startup import arrive, settle  # noqa: E402

LOCAL = 8  # ranks per simulated host
TIMEOUT_S = 30.0  # the heartbeat's default: a round is a beat of every rank, 3 s apart in a real job
CONNECTIONS = 16  # store connections per worker process


class Counting:
    """A store client that counts what it is asked: requests, keys and bytes (keys with their prefix, values sent
    and values received)."""

    def __init__(self, store, prefix: str = ""):
        self.store, self.prefix = store, prefix
        self.requests = self.keys = self.bytes = 0

    def _count(self, keys: list[str], *values) -> None:
        self.requests += 1
        self.keys += len(keys)
        self.bytes += sum(len(self.prefix) + len(k) for k in keys) + sum(len(v) for v in values)

    def set(self, key, value):
        self._count([key], value)
        return self.store.set(key, value)

    def multi_set(self, keys, values):
        self._count(keys, *values)
        return self.store.multi_set(keys, values)

    def compare_set(self, key, expected, desired):
        out = self.store.compare_set(key, expected, desired)
        self._count([key], expected, desired, out)
        return out

    def check(self, keys):
        self._count(keys)
        return self.store.check(keys)

    def get(self, key):
        out = self.store.get(key)
        self._count([key], out)
        return out

    def multi_get(self, keys):
        out = self.store.multi_get(keys)
        self._count(keys, *out)
        return out

    def add(self, key, amount):
        self._count([key])
        return self.store.add(key, amount)

    def wait(self, keys, timeout=None):
        self._count(keys)
        return self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serve(conn) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    conn.send(store.port)
    conn.recv()  # until the measurement is over


def start_server():
    """The store in a process of its own (forked: no second torch import to pay): (process, port, stop)."""
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(theirs,), daemon=True)
    proc.start()
    return proc, mine.recv(), lambda: (mine.send(None), proc.join(timeout=60))


def clients(port: int, count: int) -> list[Counting]:
    """``count`` counting clients of the store at ``port``, each on its own connection, keys under namespace()."""
    out = []
    for _ in range(count):
        raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
        out.append(Counting(dist.PrefixStore(namespace(), raw), namespace()))
    return out


def totals(stores: list[Counting]) -> list[int]:
    return [sum(s.requests for s in stores), sum(s.keys for s in stores), sum(s.bytes for s in stores)]


# ---- the ranks a worker acts for: phases separated by barriers, at which the parent reads the server's CPU -----
def _startup(port: int, world: int, ranks: range, barrier, out, last) -> None:
    """Every rank but the job's last arrives; each connection's ranks then wait in turn (the first of them blocked
    until the last rank, held back ``hold_s`` by the parent, completes the count), as long-waiting ranks do."""
    stores = clients(port, min(CONNECTIONS, len(ranks)))
    barrier.wait()  # connected
    waiting: list[list[int]] = [[] for _ in stores]
    for i, rank in enumerate(ranks):
        if rank != world - 1 and arrive(stores[i % len(stores)], rank, world, _host(rank))[1] is None:
            waiting[i % len(stores)].append(rank)
    barrier.wait()  # every rank but the last has arrived

    def settle_all(store, ranks: list[int]) -> None:
        for _ in ranks:
            assert settle(store, time.monotonic() + 600, world, 600.0) == "ok"

    threads = [threading.Thread(target=settle_all, args=(s, w)) for s, w in zip(stores, waiting)]
    for t in threads:
        t.start()
    if world - 1 in ranks:
        last.wait(timeout=600)
        own = clients(port, 1)[0]  # the others' clients are held by their blocked waits
        arrive(own, world - 1, world, _host(world - 1))
        stores.append(own)
    for t in threads:
        t.join()
    barrier.wait()
    out.put(("startup", totals(stores)))


def _host(rank: int) -> str:
    return f"host{rank // LOCAL} (10.0.{rank // LOCAL // 256}.{rank // LOCAL % 256})"


def _heartbeat(port: int, world: int, ranks: range, barrier, out, rounds: int) -> None:
    stores = clients(port, min(CONNECTIONS, len(ranks)))
    beats = [Heartbeat(r, world, TIMEOUT_S, exit_fn=lambda code: None, local=LOCAL) for r in ranks]
    barrier.wait()  # connected
    for i, beat in enumerate(beats):
        beat.enter(stores[i % len(stores)])
    barrier.wait()  # entered
    for phase in range(1 + rounds):  # the first round also reads the host names, once; the others: steady state
        for i, beat in enumerate(beats):
            store = stores[i % len(stores)]
            beat.judge(store, beat.exchange(store)[0], time.monotonic())
            assert beat.verdict is None, beat.verdict
        if phase == 0:
            out.put(("first", totals(stores)))
        barrier.wait()
    out.put(("steady", totals(stores)))


def _run(target, n: int, workers: int, barriers: int, *args, hold_s: float = 0.0) -> tuple[list[float], dict]:
    """``target`` in ``workers`` processes acting for n ranks: the server's CPU seconds at each of the ``barriers``
    (after the second, ``hold_s`` seconds before the event ``last`` is set), and the workers' summed counts
    (requests, keys, bytes) per report."""
    server, port, stop = start_server()
    ctx = multiprocessing.get_context("fork")
    workers = max(1, min(workers, n))
    barrier, out, last = ctx.Barrier(workers + 1), ctx.Queue(), ctx.Event()
    bounds = [n * w // workers for w in range(workers + 1)]
    extra = (last,) if target is _startup else ()
    procs = [
        ctx.Process(target=target, args=(port, n, range(bounds[w], bounds[w + 1]), barrier, out, *extra, *args))
        for w in range(workers)
    ]
    try:
        for p in procs:
            p.start()
        cpu = []
        for b in range(barriers):
            barrier.wait(timeout=900)
            cpu.append(cpu_seconds(server.pid))
            if b == 1 and target is _startup:
                time.sleep(hold_s)
                last.set()
        counts: dict[str, list[int]] = {}
        for _ in range(workers * (1 if target is _startup else 2)):
            tag, got = out.get(timeout=120)
            counts[tag] = [a + b for a, b in zip(counts.get(tag, [0, 0, 0]), got)]
        return cpu, counts
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
        stop()


def measure_startup(n: int, workers: int = 2, hold_s: float = 1.0) -> dict:
    """Every one of n ranks joining the store (engine/cluster/startup.py), the last ``hold_s`` seconds after the
    others: requests, keys and bytes per rank and for the job, and the store's CPU seconds for all of it."""
    cpu, counts = _run(_startup, n, workers, 3, hold_s=hold_s)
    requests, keys, size = counts["startup"]
    return {
        "ranks": n,
        "requests_per_rank": requests / n,
        "keys_per_rank": keys / n,
        "requests": requests,
        "keys": keys,
        "bytes": size,
        "store_cpu_s": cpu[2] - cpu[0],
    }


def measure_heartbeat(n: int, workers: int = 2, rounds: int | None = None) -> dict:
    """n ranks' heartbeats (engine/cluster/heartbeat.py): per steady round (a beat of every rank) requests, keys and
    bytes per rank and for the job and the store's CPU seconds; the same for the start (a connection's first
    requests and the first beat, which reads the host names once)."""
    rounds = rounds or 3 * max(1, min(16, 6_000 // n))  # whole cycles of POLL beats
    cpu, counts = _run(_heartbeat, n, workers, 3 + rounds, rounds)
    first, steady = counts["first"], [b - a for a, b in zip(counts["first"], counts["steady"])]
    return {
        "ranks": n,
        "rounds": rounds,
        "requests_per_rank_per_round": steady[0] / n / rounds,
        "keys_per_rank_per_round": steady[1] / n / rounds,
        "requests_per_round": steady[0] / rounds,
        "keys_per_round": steady[1] / rounds,
        "bytes_per_round": steady[2] / rounds,
        "store_cpu_s_per_round": (cpu[-1] - cpu[2]) / rounds,
        "start_requests_per_rank": first[0] / n,
        "start_keys_per_rank": first[1] / n,
        "start_store_cpu_s": cpu[2] - cpu[0],
    }


def measure(n: int, workers: int = 2) -> dict:
    """Both, for launch/bench/scale.py: {"heartbeat": ..., "startup": ...}."""
    return {"heartbeat": measure_heartbeat(n, workers), "startup": measure_startup(n, workers)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096, 16384])
    parser.add_argument("--workers", type=int, default=2, help="client processes acting for the ranks")
    parser.add_argument("--rounds", type=int, default=0, help="heartbeat rounds measured (0: 3 to 50 by N)")
    args = parser.parse_args(argv)
    if min(args.ranks) < 2 or args.workers < 1 or args.rounds < 0:
        print(
            f"error: --ranks {args.ranks} --workers {args.workers} --rounds {args.rounds}: ranks >= 2, workers >= 1 "
            f"and rounds >= 0",
            file=sys.stderr,
        )
        return 2
    print(
        f"{'ranks':>7} | {'hb req/rank':>11} {'keys/rank':>9} {'KB/round':>9} {'store s/round':>13} "
        f"{'% of 3 s':>8} | {'start req/rank':>14} {'keys/rank':>9} {'job req':>8} {'store s':>8}"
    )
    for n in args.ranks:
        hb, st = measure_heartbeat(n, args.workers, args.rounds or None), measure_startup(n, args.workers)
        share = 100 * hb["store_cpu_s_per_round"] / (TIMEOUT_S / 10)
        print(
            f"{n:>7} | {hb['requests_per_rank_per_round']:>11.2f} {hb['keys_per_rank_per_round']:>9.2f} "
            f"{hb['bytes_per_round'] / 1e3:>9.1f} {hb['store_cpu_s_per_round']:>13.4f} {share:>7.2f}% | "
            f"{st['requests_per_rank']:>14.2f} {st['keys_per_rank']:>9.2f} {st['requests']:>8} "
            f"{st['store_cpu_s']:>8.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
