"""Start-up: every rank joins the job's c10d store within ``parallel.startup_timeout_s``, or every rank that did
exits naming the ranks (and nodes) that did not.

torch's own ``env://`` rendezvous has rank 0's store wait for all clients for the whole process-group timeout
(``parallel.timeout_s``, long so that big collectives fit), then fails with "2/4 clients joined" and a traceback
from every rank, not saying which ones are missing. Here the store is made without that wait (the same server
torch would make: rank 0's, multi-tenant, or the torchrun agent's when the workers share it), each rank writes
its host name under ``host/<rank>`` (the heartbeat, engine/cluster/heartbeat.py, names silent peers from these)
and counts itself in; the ranks wait for the count to reach the world size with their own deadline. The process
group is then built on this store with the start-up timeout (gloo's full-mesh connect and NCCL's bootstrap are
bounded by it) and given ``parallel.timeout_s`` for its collectives afterwards (engine/parallel/layout/context.py).

The wait costs the store O(1) requests per rank, whatever the world size and however long it lasts (issue 43:
polling, ten requests a second per waiting rank, saturated the store's one thread at ~5,900 ranks): a waiting
rank blocks on the one key ``startup``, which the rank completing the count sets to ``ok``. The first rank to join
waits until its own deadline, then counts the ranks present (O(N) checks, once, on the failure path only) and
posts the line naming the missing ones there instead, which wakes every other rank with it; the others' own
deadlines are ``GRACE_S`` later, so that only a job whose first rank died too is named by whoever times out next.
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta

import torch.distributed as dist

from engine.cluster.heartbeat import describe_ranks, host_name, launch_round, namespace, store_address

READY = "ok"  # the value of ``startup`` once every rank has joined
GRACE_S = 5.0  # how much later than the first rank's deadline the others' falls


class StartupError(Exception):
    """A rank missing at start-up, or the store out of reach; ``str(e)`` is the one line to print."""


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _nodes(missing: list[int]) -> str:
    """The node ranks the missing ranks belong to, where every node runs LOCAL_WORLD_SIZE ranks (torchrun, the
    deepspeed launcher: ranks are numbered host by host)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local < 1:
        return ""
    nodes = sorted({r // local for r in missing})
    return f" (node{'s' if len(nodes) > 1 else ''} {_ranges(nodes)} at {local} ranks per node)"


def join(rank: int, world: int, timeout_s: float):
    """This rank's client (rank 0's server unless a torchrun agent serves it) of the store at MASTER_ADDR:
    MASTER_PORT, once all ``world`` ranks have joined; StartupError within ``timeout_s`` otherwise."""
    addr, port = store_address()  # ConfigError on a MASTER_PORT that is no port (abc, 70000)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    deadline, me = time.monotonic() + timeout_s, host_name()
    try:
        store = dist.TCPStore(
            addr,
            port,
            world_size=None,
            is_master=rank == 0 and not agent,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except Exception as e:  # noqa: BLE001  DistNetworkError, RuntimeError: a refused or timed-out connect
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StartupError(
            f"rank {rank} on host {me} could not reach the job's store at {addr}:{port} within "
            f"{timeout_s:.0f} s (parallel.startup_timeout_s): the first host (rank 0's) is down, "
            f"unreachable or not started ({first})"
        ) from None
    ours = dist.PrefixStore(namespace(), store)
    try:
        joined, verdict = arrive(ours, rank, world, me)
        if verdict is None:
            verdict = settle(ours, deadline + (0 if joined == 1 else GRACE_S), world, timeout_s)
        if verdict != READY:
            _leave(ours, rank == 0 and not agent, world)
            raise StartupError(verdict)
    except (RuntimeError, dist.DistError) as e:  # the store's host gave up (or died) before this rank read why
        raise StartupError(
            f"rank {rank} on host {me}: the job's store at {addr}:{port} went away during start-up "
            f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
        ) from None
    return store


def arrive(ours, rank: int, world: int, host: str) -> tuple[int, str | None]:
    """Count this rank in (its host name first): (its place in the count, ``ok`` if it completed the count or the
    line a rank that gave up posted before; None: wait with ``settle``). Two requests."""
    ours.set(f"host/{rank}", host)
    joined = ours.add("joined", 1)
    return joined, ours.compare_set("startup", "", READY).decode() if joined >= world else None


def settle(ours, deadline: float, world: int, timeout_s: float) -> str:
    """Block on ``startup`` until ``deadline``: its value (``ok``, or the line of a rank that gave up); at the
    deadline, the line naming the missing ranks, posted unless another line or ``ok`` came first."""
    try:
        ours.wait(["startup"], timedelta(seconds=max(0.001, deadline - time.monotonic())))
    except dist.DistStoreError:
        if time.monotonic() < deadline - 1:  # not the wait's timeout: the store went away
            raise
        return ours.compare_set("startup", "", _missing_line(ours, world, timeout_s)).decode()
    return ours.get("startup").decode()


def _leave(ours, serving: bool, world: int) -> None:
    """Count this rank out; the rank serving the store waits (5 s at most) until every joined rank has read the
    line, so none of them meets a closed store instead."""
    left = ours.add("left", 1)
    deadline = time.monotonic() + 5
    joined = ours.add("joined", 0)
    while serving and left < min(joined, world) and time.monotonic() < deadline:
        time.sleep(0.1)
        joined, left = ours.add("joined", 0), ours.add("left", 0)


def _missing_line(ours, world: int, timeout_s: float) -> str:
    present = [r for r in range(world) if ours.check([f"host/{r}"])]
    missing = sorted(set(range(world)) - set(present))
    hosts = dict(zip(present, (v.decode() for v in ours.multi_get([f"host/{r}" for r in present]))))
    return (
        f"rank{'s' if len(missing) > 1 else ''} {_ranges(missing)}{_nodes(missing)} of {world} did not join "
        f"within {timeout_s:.0f} s (parallel.startup_timeout_s): their host is down, unreachable or did not start "
        f"them; joined: "
        f"{describe_ranks(present, hosts)}"
    )


def connect_failed(error: Exception, rank: int, timeout_s: float) -> StartupError:
    """The one line for a process group that did not connect within ``timeout_s`` after every rank joined the store:
    a rank died or hung inside ``init_process_group`` (its host's gloo/NCCL could not start, or its network is cut),
    so the others wait for its address. torch says "wait timeout after 20000ms, keys: /default_pg/0/0//cpu//0/1",
    whose last number is the rank waited for."""
    text = str(error).strip()
    waited = re.search(r"keys: \S*/(\d+)(?!\S)", text)  # greedy: the key's last number
    who = f"rank {waited.group(1)}" if waited else "a rank"
    first = text.splitlines()[0] if text else type(error).__name__
    return StartupError(
        f"rank {rank} on host {host_name()}: the process group did not connect within "
        f"{timeout_s:.0f} s (parallel.startup_timeout_s): {who} never posted its address (it failed "
        f"while connecting, or its host is unreachable) ({first})"
    )


def default_store(store):
    """The process group's view of the store, as torch's env:// path prefixes it, and per torchrun restart round
    (a restarted round sharing the agent's store must not read the dead round's addresses: launch_round)."""
    return dist.PrefixStore(f"default_pg/{launch_round()}", store)
