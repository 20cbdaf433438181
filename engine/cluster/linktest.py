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


LINK_ROUNDS = 4  # rounds of disjoint host-to-host pairs: each host is measured against this many others


def tournament_round(n: int, r: int) -> list[tuple[int, int]]:
    """Round ``r`` of the round-robin tournament (the circle method) on n players: n // 2 disjoint pairs (one
    player rests when n is odd); rounds 0 .. n-2 (n even) or 0 .. n-1 (n odd) hold every pair exactly once."""
    m = n if n % 2 == 0 else n + 1  # an odd n plays against a ghost, m - 1, whose partner rests
    pairs = [(r % (m - 1), m - 1)] + [((r + i) % (m - 1), (r - i) % (m - 1)) for i in range(1, m // 2)]
    return [tuple(sorted(p)) for p in pairs if max(p) < n]


def link_rounds(labels: list[str], max_all: int = 16, host_rounds: int = LINK_ROUNDS) -> list[list[tuple[int, int]]]:
    """Rank pairs to measure, in rounds whose pairs share no rank, so a round's pairs run at once. Up to
    ``max_all`` ranks: every pair (n - 1 rounds, the tournament). Beyond that O(hosts + ranks) pairs in
    (slots - 1) + ``host_rounds`` rounds: round j < slots pairs each host's first rank with its j-th local rank
    on every host at once (the intra-node links); then ``host_rounds`` rounds of the tournament on the hosts'
    first ranks, every host against a different host in each (the inter-node links; hosts // 2 pairs a round)."""
    n = len(labels)
    if n <= max_all:
        return [tournament_round(n, r) for r in range(n - 1 if n % 2 == 0 else n)] if n > 1 else []
    members: dict[str, list[int]] = {}
    for rank, label in enumerate(labels):
        members.setdefault(label, []).append(rank)
    local = [ranks for ranks in members.values() if len(ranks) > 1]
    rounds = [
        [(ranks[0], ranks[j]) for ranks in local if j < len(ranks)] for j in range(1, max(map(len, local), default=1))
    ]
    leaders, h = [ranks[0] for ranks in members.values()], len(members)
    for r in range(min(host_rounds, h - 1 if h % 2 == 0 else h)):
        rounds.append(sorted(tuple(sorted((leaders[a], leaders[b]))) for a, b in tournament_round(h, r)))
    return [pairs for pairs in rounds if pairs]


def link_pairs(labels: list[str], max_all: int = 16, host_rounds: int = LINK_ROUNDS) -> list[tuple[int, int]]:
    """Every pair of :func:`link_rounds`, sorted."""
    return sorted(p for pairs in link_rounds(labels, max_all, host_rounds) for p in pairs)


def plan_lines(hosts: int, slots: int, round_s: float, host_rounds: int = LINK_ROUNDS) -> tuple[list[str], float]:
    """The link test's plan for ``hosts`` hosts of ``slots`` ranks -> (lines: rounds, pairs, times; the estimated
    seconds) if one round (its pairs at once, then a barrier) takes ``round_s`` seconds, and, for comparison, the
    serial plan used before (every pair of hosts, then each host's local pairs, one pair at a time)."""
    rounds = link_rounds([f"h{r // slots}" for r in range(hosts * slots)], host_rounds=host_rounds)
    sizes = [len(pairs) for pairs in rounds]
    n = hosts * slots
    serial = n * (n - 1) // 2 if n <= 16 else hosts * (hosts - 1) // 2 + hosts * (slots - 1)
    lines = [
        f"link test: {sum(sizes)} pairs in {len(rounds)} rounds of disjoint pairs (pairs per round: "
        f"{min(sizes, default=0)} to {max(sizes, default=0)}), {hosts} hosts x {slots} ranks",
        f"link test estimate: {len(rounds)} rounds x {round_s:.3f} s = {len(rounds) * round_s:.1f} s "
        f"(serial pairs, as before: {serial} x {round_s:.3f} s = {serial * round_s:.1f} s)",
    ]
    return lines, len(rounds) * round_s


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
    Pairs are measured a round at a time (link_rounds; then a barrier): no rank is in two pairs of a round, so
    each number is one link of its ranks, sharing the fabric only with the round's other pairs, as in training."""
    me, n = dist.get_rank(), dist.get_world_size()
    labels: list = [None] * n
    dist.all_gather_object(labels, label)
    buf = torch.ones(max(1, size_bytes // 4), dtype=torch.float32, device=device)
    mine = []
    for pairs in link_rounds(labels):
        dist.barrier()
        for a, b in pairs:
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
