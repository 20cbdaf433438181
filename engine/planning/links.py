"""The link model every planner part shares: the seconds of a ring collective (Patarasuk and Yuan 2009, "Bandwidth
optimal all-reduce algorithms": each rank moves (n-1)/n of the bytes per pass, 2 passes for an all-reduce, one step's
latency per hop) and which link a group of consecutive ranks crosses (inside a node or between nodes). ``hw`` is
engine/planning/search.py's Hardware."""

from __future__ import annotations


def ring_time(nbytes: float, n: int, passes: float, bw_gbps: float, latency_us: float) -> float:
    """Seconds for a ring collective moving ``passes`` * (n-1)/n of ``nbytes`` per rank (2 for all-reduce)."""
    if n <= 1:
        return 0.0
    return passes * (n - 1) / n * nbytes / (bw_gbps * 1e9) + passes * (n - 1) * latency_us * 1e-6


def link_bandwidth(hw, span: int) -> float:
    """The link a group of consecutive-rank ``span`` uses."""
    return hw.intra_node_gbps if span <= hw.gpus_per_node else hw.inter_node_gbps
