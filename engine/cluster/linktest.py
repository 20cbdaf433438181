"""Measure the links of a job's world before training on it: p2p bandwidth per rank pair and all-reduce bus bandwidth.

Every rank calls :func:`measure` inside an initialised process group (any backend); rank 0 gets the results.
Bandwidths follow nccl-tests' definitions (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):
    p2p     bytes moved one way per second, from a ping-pong (a sends to b, b sends back) timed on a
    algbw   size / time of one all-reduce
    busbw   algbw * 2 (n - 1) / n, the rate each link of a ring all-reduce must sustain; comparable to p2p.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class LinkReport:
    labels: list[str]  # host label of each rank
    size_bytes: int
    backend: str
    p2p: list[tuple[int, int, float]] = field(default_factory=list)  # (rank a, rank b, GB/s)
    allreduce_algbw: float = 0.0  # GB/s
    allreduce_busbw: float = 0.0  # GB/s


def link_pairs(labels: list[str], max_all: int = 16) -> list[tuple[int, int]]:
    """Rank pairs to measure. Every pair up to ``max_all`` ranks; beyond that O(hosts^2 + ranks) pairs: the first
    rank of each host with the first rank of every other host (the inter-node links), and with each other rank
    of its own host (the intra-node links)."""
    n = len(labels)
    if n <= max_all:
        return [(a, b) for a in range(n) for b in range(a + 1, n)]
    first = {}
    for rank, label in enumerate(labels):
        first.setdefault(label, rank)
    leaders = sorted(first.values())
    pairs = [(a, b) for i, a in enumerate(leaders) for b in leaders[i + 1 :]]
    pairs += [(first[label], rank) for rank, label in enumerate(labels) if rank != first[label]]
    return sorted(pairs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ping_pong(buf: torch.Tensor, me: int, a: int, b: int, iters: int) -> float | None:
    """GB/s one way between ranks a and b, measured on a (None on every other rank). buf: (numel,)."""
    if me not in (a, b):
        return None
    peer = b if me == a else a
    for i in range(iters + 1):  # round 0 warms up (NCCL creates its p2p communicator on first use)
        if i == 1:
            _sync(buf.device)
            start = time.perf_counter()
        if me == a:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
    _sync(buf.device)
    elapsed = time.perf_counter() - start
    return 2 * iters * buf.numel() * buf.element_size() / elapsed / 1e9 if me == a else None


def measure(label: str, size_bytes: int, iters: int, device: torch.device) -> LinkReport | None:
    """Run the p2p and all-reduce tests on the default group; rank 0 returns the report, the others None.
    Pairs are measured one at a time (the others wait at a barrier) so each number is one link unshared."""
    me, n = dist.get_rank(), dist.get_world_size()
    labels: list = [None] * n
    dist.all_gather_object(labels, label)
    buf = torch.ones(max(1, size_bytes // 4), dtype=torch.float32, device=device)
    mine = []
    for a, b in link_pairs(labels):
        dist.barrier()
        gbps = _ping_pong(buf, me, a, b, iters)
        if gbps is not None:
            mine.append((a, b, gbps))
    dist.barrier()
    dist.all_reduce(buf)  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    _sync(device)
    algbw = buf.numel() * buf.element_size() * iters / (time.perf_counter() - start) / 1e9
    gathered: list = [None] * n
    dist.all_gather_object(gathered, mine)
    if me != 0:
        return None
    return LinkReport(
        labels,
        buf.numel() * buf.element_size(),
        dist.get_backend(),
        sorted(p for part in gathered for p in part),
        algbw,
        algbw * 2 * (n - 1) / n if n > 1 else 0.0,
    )


def format_report(r: LinkReport) -> str:
    """The table preflight prints: one line per measured pair, then the all-reduce."""
    lines = [f"links ({r.backend}, {r.size_bytes / 2**20:.1f} MiB messages, {len(r.labels)} ranks):"]
    for a, b, gbps in r.p2p:
        lines.append(f"  p2p rank {a} ({r.labels[a]}) <-> rank {b} ({r.labels[b]}): {gbps:8.2f} GB/s")
    lines.append(
        f"  all-reduce over {len(r.labels)} ranks: algbw {r.allreduce_algbw:8.2f} GB/s, "
        f"busbw {r.allreduce_busbw:8.2f} GB/s"
    )
    return "\n".join(lines)
