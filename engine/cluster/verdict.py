"""The heartbeat's verdict reaches every live rank before the store goes (engine/cluster/heartbeat.py).

The job's store lives in a process of one host: the torchrun agent of the rendezvous host (torch >= 2.5 shares its
rendezvous store with the workers) or rank 0 (the deepspeed launcher, env://). That host's ranks used to exit right
after posting the verdict; their agent (or rank 0 itself) then exited with the store, and a healthy host whose next
beat came after that found no store and no verdict: it waited a whole timeout more and blamed the store's host
instead of the host that had failed (61-65 s at the default 30 s, seen in issue 42). So every rank that ends on a
verdict counts itself into ``verdict/acks`` and waits (blocked on one key) until the ranks the verdict left alive
(``verdict/live``, posted with it) have all counted in, at most ``2 * interval + op_timeout``: a live rank reads the
verdict at once (its listener, blocked on ``ended``) or at its next beat. The ranks named in the verdict (silent,
failed, cut off) are not waited for; their host's other ranks are (a killed rank's host-mates live on and must print
the line too), which costs the whole wait only when a frozen host's ranks fell silent a beat apart and the verdict
named one of them. Only when the store itself stopped answering is there nothing to wait through; that line is then
the same on every host anyway.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

LIVE_KEY = "verdict/live"  # how many ranks the verdict's poster saw alive, itself included
ACKS_KEY = "verdict/acks"
ALL_KEY = "verdict/all"  # set by the rank whose acknowledgement completes the count


def acknowledge(open_store, op_timeout: float, interval: float) -> bool:
    """Count this rank in and wait (bounded) for every live rank to; True when all did. ``open_store()`` gives a
    new client of the job's store: this runs from the watchdog's thread, whose own client may be mid-call. Three
    or four requests per rank, whatever the job's size (issue 43): the rank whose count completes the verdict's
    ``live`` sets ``ALL_KEY``; the others block on that one key instead of polling the count."""
    wait_s = 2 * interval + op_timeout
    done = threading.Event()

    def run() -> None:
        try:
            store = open_store()
            acks = store.add(ACKS_KEY, 1)
            live = int(store.get(LIVE_KEY).decode() or 0)  # posted before the verdict: there already
            if acks >= live:
                store.set(ALL_KEY, "1")
            else:
                store.wait([ALL_KEY], timedelta(seconds=wait_s))
            done.set()
        except Exception:  # noqa: BLE001  the store went meanwhile, or not all came in time: nothing to wait for
            pass

    waiter = threading.Thread(target=run, name="engine-heartbeat-verdict", daemon=True)
    waiter.start()
    waiter.join(timeout=wait_s + op_timeout)  # a store call that hangs (a freeze now) is not waited out
    return done.is_set()


def store_host(hosts: dict[int, str]) -> str:
    """The host serving the job's store, from the ranks' host names ("h1 (198.18.0.1)"): the one whose address is
    MASTER_ADDR's (the store may live in an agent on a host other than rank 0's); rank 0's host otherwise."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        address = socket.gethostbyname(master)
    except OSError:
        address = master
    for name in hosts.values():
        if name.endswith(f"({address})"):
            return name
    return hosts.get(0, "that of rank 0")
