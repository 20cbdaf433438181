"""The loopback-name refusal's verdict over every rank's record (engine/cluster/netcheck.py), whichever host holds
the bad name: the namespace-host test (test_hosts.py) puts it on the second host only, and a verdict that skipped
rank 0's own host passed it (issue 45). Records as ``my_record`` posts them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch.distributed as dist

from engine.cluster import netcheck
from engine.cluster.netcheck import advertised_address, check_addresses, verdict
from tests.cli import ROOT

FINE = {"addr": "198.18.0.2", "iface": "eth0"}
LOOPBACK = {"addr": "127.0.1.1", "iface": "eth0"}


def records(*hosts: tuple[str, dict], per_host: int = 2) -> list[dict]:
    return [{"host": name, **record} for name, record in hosts for _ in range(per_host)]


def test_the_bad_name_on_rank_0s_host_is_refused():
    line = verdict(records(("h1", LOOPBACK), ("h2", FINE), per_host=1))  # one rank per host: rank 0 is h1's only
    assert line and line.startswith("host h1: its host name resolves to 127.0.1.1, a loopback address"), line


def test_the_bad_name_on_another_host_is_refused_and_the_first_one_named():
    line = verdict(records(("h1", FINE), ("h2", FINE), ("h3", LOOPBACK), ("h4", LOOPBACK)))
    assert line and line.startswith("host h3: its host name resolves to 127.0.1.1") and "eth0" in line, line


def test_one_host_and_interfaces_named_by_the_user_are_never_refused():
    assert verdict(records(("h1", LOOPBACK), per_host=8)) is None  # loopback reaches every rank on one host
    named = {"addr": None}  # GLOO_SOCKET_IFNAME set: gloo binds that interface, not the name's address
    assert verdict(records(("h1", named), ("h2", named))) is None
    assert verdict(records(("h1", FINE), ("h2", FINE))) is None


def test_the_address_is_the_first_of_the_names_that_binds_here(monkeypatch):
    """advertised_address as gloo picks it: the name's first address that binds on this host (127.0.0.2 binds on
    any Linux host: the whole of 127/8 is loopback), past one that does not (an address of another host), and
    gloo's 127.0.0.1 fallback for a name that does not resolve."""
    with socket.socket() as held:  # port 1 taken: the check binds a free port (0), as gloo does, not a fixed one
        held.bind(("127.0.0.2", 1))  # (a user who is not root may bind no port below 1024 at all)
        assert advertised_address("127.0.0.2") == "127.0.0.2"  # the name given, not this host's own name
    real = socket.getaddrinfo

    def resolves(name, *args):
        if name == "two-addresses":  # another host's address first, then one of this host's
            return [entry for a in ("198.18.0.250", "127.0.0.3") for entry in real(a, *args)]
        if name == "no-such-name":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(name, *args)

    monkeypatch.setattr(socket, "getaddrinfo", resolves)
    assert advertised_address("two-addresses") == "127.0.0.3"
    assert advertised_address("no-such-name") == "127.0.0.1"


def test_a_scoped_ipv6_address_is_read_without_its_interface():
    """An address advertised with its zone ('fe80::1%eth0', a link-local IPv6 address) is judged by the address
    ('fe80::1': not loopback), not by the zone, which is no address (a ValueError traceback at start-up)."""
    assert verdict(records(("h1", {"addr": "fe80::1%eth0", "iface": "eth0"}), ("h2", FINE))) is None
    line = verdict(records(("h1", FINE), ("h2", {"addr": "::1%lo", "iface": "eth0"})))
    assert line and line.startswith("host h2: its host name resolves to ::1%lo"), line


def test_one_rank_alone_gets_the_verdict_from_rank_0_at_once():
    """check_addresses on a real store: rank 0 decides, also when it is the only rank (a world of one would wait
    out the store's timeout for a verdict nobody posts), and two ranks on this one host are never refused."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=3))
    start = time.monotonic()
    check_addresses(server, 0, 1)
    assert time.monotonic() - start < 2.0
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=3))
    stores = {0: server, 1: client}
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda r: check_addresses(stores[r], r, 2), [1, 0])) == [None, None]


IN_A_FRESH_NETNS = """
set -e
# a veth pair: d2 (its peer, made first: index 2) and a name of 15 characters, the longest Linux allows (a USB
# adapter's enx<MAC>), at index 3
ip link add enx00e04c680123 type veth peer name d2
ip addr add 198.18.0.77/32 dev enx00e04c680123
ip addr add 198.18.0.78/32 dev d2
exec "$0" -c 'from engine.cluster import netcheck as n; print(n.network_interfaces(), n.my_record()["iface"])'
"""


def test_the_interfaces_are_read_past_one_without_an_address_and_by_their_whole_name():
    """network_interfaces in a network namespace of its own (unshare -n): its loopback, first, has no IPv4 address
    yet and is passed over, not the end of the list; an interface whose name has 15 characters (the longest Linux
    allows: a USB adapter's enx<MAC>) is asked for by its whole name; the first interface is the one suggested.
    Addresses of 198.18.0.0/24 on links of their own namespace: nothing is sent."""
    env = {k: v for k, v in os.environ.items() if k != netcheck.IFNAME_ENV}
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", IN_A_FRESH_NETNS, sys.executable],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    expected = "[('d2', '198.18.0.78'), ('enx00e04c680123', '198.18.0.77')] d2"
    assert done.stdout.strip() == expected, done.stdout
