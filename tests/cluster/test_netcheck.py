"""The loopback-name refusal's verdict over every rank's record (engine/cluster/netcheck.py), whichever host holds
the bad name: the namespace-host test (test_hosts.py) puts it on the second host only, and a verdict that skipped
rank 0's own host passed it (issue 45). Records as ``my_record`` posts them."""

from __future__ import annotations

from engine.cluster.netcheck import verdict

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
