"""Multi-node across real hosts: network namespaces with their own names, addresses and sshd (tests/hosts.py),
a shared file system, and both launchers (the deepspeed launcher through pdsh and ssh; one torchrun agent per
host meeting at the first host's address). tests/test_multinode.py keeps the one-host (loopback) cases."""
from __future__ import annotations

import os

import pytest

from tests import hosts


@pytest.fixture
def make_hosts(tmp_path):
    yield from hosts.make_hosts_fixture(tmp_path)


def test_hosts_have_their_own_names_addresses_and_sshd(make_hosts):
    """The fixture itself: each host has its name, its 198.18 address, no default route, reaches the others over
    ssh by name; a namespace left by a dead run is removed by the next set-up, and teardown leaves nothing."""
    stale = f"{hosts.PREFIX}999999999z-h1"  # no such pid: a crashed run's
    hosts._run("ip", "netns", "add", stale)
    cluster = make_hosts(3)
    assert stale not in hosts._run("ip", "netns", "list").stdout
    for i, host in enumerate(cluster.hosts, 1):
        seen = cluster.ssh(cluster.hosts[0], host, "hostname; hostname -I; ip route")
        assert seen.returncode == 0, seen.stderr
        name, addr, routes = seen.stdout.split("\n", 2)
        assert (name, addr.strip()) == (f"h{i}", f"198.18.0.{i}")
        assert "default" not in routes and routes.startswith("198.18.0.0/24"), routes
    cluster.down()
    listed = hosts._run("ip", "netns", "list").stdout + hosts._run("ip", "link").stdout
    assert cluster.id not in listed and not cluster.folder.exists()
    assert all(not os.path.exists(f"/proc/{h.pid}") or
               open(f"/proc/{h.pid}/stat").read().split()[2] == "Z" for h in cluster.hosts)
