"""Start-up: the address each host's ranks would give the others, checked before any gloo connection is made.

Without GLOO_SOCKET_IFNAME, torch's gloo resolves the rank's own host name and binds the first address that
resolves (``ProcessGroupGloo::createDefaultDevice``, falling back to 127.0.0.1 when none does); every peer is then
told to connect there. On Debian and Ubuntu the installer writes ``127.0.1.1 <hostname>`` into /etc/hosts, so on a
multi-host job every cross-host connection goes to the peer's 127.0.1.1, i.e. to the connecting host itself:
"Connection refused" from deep inside init_process_group. The check runs whatever the backend; under nccl, whose
checkpoint metadata no longer goes over gloo (issue 43: engine/cluster/exchange.py), it is stricter than needed.

Done over the rendezvous store, before init_process_group: every rank posts (host, address), rank 0 decides once
for the world and posts the verdict, so every host refuses with the same line and none is left waiting in a gloo
connect. A world on one host never refuses (loopback reaches every rank there).
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import socket
import struct

from engine.cluster.heartbeat import launch_round
from engine.errors import ConfigError

IFNAME_ENV = "GLOO_SOCKET_IFNAME"
_KEY = "engine/netcheck"
_SIOCGIFADDR = 0x8915


def advertised_address(hostname: str | None = None) -> str:
    """The address gloo would advertise: the first address ``hostname`` (this host's name) resolves to that can
    be bound here, else gloo's loopback fallback."""
    try:
        infos = socket.getaddrinfo(hostname or socket.gethostname(), None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError:
        return "127.0.0.1"
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((addr[0], 0))
            return addr[0]
        except OSError:
            continue
    return "127.0.0.1"


def network_interfaces() -> list[tuple[str, str]]:
    """(name, IPv4 address) of this host's interfaces that have a non-loopback address."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address
                continue
            addr = socket.inet_ntoa(raw[20:24])
            if not ipaddress.ip_address(addr).is_loopback:
                found.append((name, addr))
    return found


def my_record() -> dict:
    """What this rank posts: its host name, and the address it would advertise (None when GLOO_SOCKET_IFNAME
    picks the interface instead), with the interface to suggest."""
    host = socket.gethostname()
    if os.environ.get(IFNAME_ENV):
        return {"host": host, "addr": None}
    interfaces = network_interfaces()
    return {"host": host, "addr": advertised_address(host), "iface": interfaces[0][0] if interfaces else "IFACE"}


def loopback_line(r: dict) -> str | None:
    """The refusal line for one host's record when it is part of a multi-host world, or None."""
    if r["addr"] is None or not ipaddress.ip_address(r["addr"].split("%")[0]).is_loopback:
        return None
    iface = r.get("iface", "IFACE")
    return (
        f"host {r['host']}: its host name resolves to {r['addr']}, a loopback address, so the other hosts "
        f"would connect to themselves (gloo: Connection refused); set {IFNAME_ENV}={iface} (and "
        f"NCCL_SOCKET_IFNAME={iface} under nccl) for every rank - under the deepspeed launcher as lines "
        f"in .deepspeed_env - or map {r['host']} to its network address in /etc/hosts"
    )


def verdict(records: list[dict]) -> str | None:
    """The refusal line for a world whose ranks posted ``records`` (rank order), or None."""
    if len({r["host"] for r in records}) < 2:
        return None
    return next((line for line in map(loopback_line, records) if line), None)


def check_addresses(store, rank: int, world: int) -> None:
    """Every rank, before init_process_group: post this rank's record on the rendezvous ``store``; rank 0 posts
    the verdict; ConfigError with the refusal line on every rank of every host."""
    key = f"{_KEY}/{launch_round()}"  # a restarted round may share the store
    store.set(f"{key}/{rank}", json.dumps(my_record()))
    if rank == 0:
        keys = [f"{key}/{r}" for r in range(world)]
        store.wait(keys)
        store.set(f"{key}/verdict", json.dumps(verdict([json.loads(store.get(k)) for k in keys])))
    line = json.loads(store.get(f"{key}/verdict"))  # get waits for the key (the store's timeout)
    if line:
        raise ConfigError(line)


def init_checked(backend: str, rank: int, world: int, timeout, **kwargs) -> None:
    """init_process_group through the rendezvous it would make itself (env://: torchrun's or the deepspeed
    launcher's MASTER_ADDR store), with ``check_addresses`` run on that store before gloo connects."""
    import torch.distributed as dist  # deferred: hostreport.py imports this file on hosts checked by preflight

    store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    check_addresses(store, rank, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
