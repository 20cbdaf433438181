"""The host serving the job's store, across real hosts (network namespaces, tests/hosts.py; torchrun, 3 hosts, one
rank each, the heartbeat at 10 s as in tests/cluster/test_faults.py): frozen, it must not leave the other hosts'
torchrun agents waiting on it (engine/cluster/agentwatch.py); alive, it must not take the store away before a
healthy host has read the verdict (engine/cluster/verdict.py). Issue 42 items 1 and 3."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests import hosts
from tests.cluster.hostjobs import start_agents, stop, train_args
from tests.cluster.jobs import logged_steps

BOUND_S = 60  # the heartbeat's 10 s, its store timeouts, the agent's grace (3.3 s), and this loaded machine
ENGINE = ("launch/pretrain.py", "torch.distributed.run", "agentwatch.py")


def _pids(host: hosts.Host, *names: str) -> list[int]:
    """The processes on ``host`` (its network namespace) whose command line holds one of ``names`` (all: none)."""
    out = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True).stdout.split()
    found = []
    for pid in map(int, out):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if not names or any(n in cmd for n in names):
            found.append(pid)
    return found


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _first_error(log: Path) -> str:
    return next((x for x in log.read_text().splitlines() if x.startswith("error: ")), "")


def _start(cluster: hosts.Cluster, tmp_path: Path) -> list[subprocess.Popen]:
    out = tmp_path / "run"
    args = train_args(out, "--train.steps", "100000", "--train.global_batch_size", "12")  # dp 3
    args += ["--parallel.heartbeat_timeout_s", "10"]
    procs = start_agents(cluster, 1, args, tmp_path / "logs")
    deadline = time.monotonic() + 600
    while logged_steps(out) < 2:  # every rank has beaten and trains
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.2)
    return procs


def test_frozen_store_host_ends_every_agent(make_hosts, tmp_path):
    """Everything on h1 (the rendezvous host: its agent serves the store the workers share) stopped: h2's and h3's
    ranks name the store on h1 in the same line (but for the step, which can be one apart), and their torchrun
    agents, blocked in a read of that store, end too, non-zero, with nothing the engine started left on h2 or h3
    (before: the agents waited for as long as h1 stayed frozen)."""
    cluster = make_hosts(3)
    procs = _start(cluster, tmp_path)
    h1 = cluster.hosts[0]
    frozen = _pids(h1)
    try:
        start = time.monotonic()
        _signal(frozen, signal.SIGSTOP)
        codes = [p.wait(timeout=max(1.0, BOUND_S - (time.monotonic() - start))) for p in procs[1:]]
        elapsed = time.monotonic() - start
        time.sleep(1)  # the watchdogs exit right after ending their agent
        left = {h.name: _pids(h, *ENGINE) for h in cluster.hosts[1:]}
    finally:
        _signal(frozen, signal.SIGKILL)
        stop(procs)
    assert all(c != 0 for c in codes), codes
    lines = {h.name: _first_error(tmp_path / "logs" / f"agent_{h.name}.log") for h in cluster.hosts[1:]}
    steps = [int(m.group(1)) for m in (re.search(r" at step (\d+);", x) for x in lines.values()) if m]
    assert len(steps) == 2 and max(steps) - min(steps) <= 1, lines  # one step apart at most: _store_line
    assert len({re.sub(r" at step \d+;", "", x) for x in lines.values()}) == 1, lines
    assert re.match(
        r"error: the job's store at h1:\d+ \(host h1 \(198\.18\.0\.1\)\) has stopped answering", lines["h2"]
    ), lines
    assert left == {"h2": [], "h3": []}, left
    print(f"h1 frozen: the agents on h2, h3 ended in {elapsed:.1f} s with {codes}: {lines['h2']}")


def test_every_host_names_the_failed_host_not_the_store(make_hosts, tmp_path):
    """h2 frozen; h3's rank stalls (stopped) from 5 s later until h1, which serves the store, has named h2 and its
    agent has exited (or 3.5 s have passed): h3 must still print h1's line, naming h2, not blame the store on h1
    because h1 took the store away before h3's next beat. (The heartbeat's watchers: with one rank per host, h1
    reads h2's counter, h2 h3's and h3 h1's, so h1 is the one to name h2, and nobody but the frozen h2 watches h3.)"""
    cluster = make_hosts(3)
    procs = _start(cluster, tmp_path)
    h1, h2, h3 = cluster.hosts
    frozen, logs = _pids(h2), tmp_path / "logs"
    try:
        start = time.monotonic()
        _signal(frozen, signal.SIGSTOP)
        time.sleep(5)
        stalled = _pids(h3, "launch/pretrain.py")
        _signal(stalled, signal.SIGSTOP)
        while not _first_error(logs / "agent_h1.log"):
            assert time.monotonic() - start < BOUND_S, "h1 named nobody"
            time.sleep(0.1)
        named = time.monotonic()
        while procs[0].poll() is None and time.monotonic() - named < 3.5:
            time.sleep(0.1)
        _signal(stalled, signal.SIGCONT)
        codes = [p.wait(timeout=max(1.0, BOUND_S - (time.monotonic() - start))) for p in (procs[0], procs[2])]
        elapsed = time.monotonic() - start
    finally:
        _signal(frozen, signal.SIGKILL)
        stop(procs)
    lines = [_first_error(logs / f"agent_{h.name}.log") for h in (h1, h3)]
    assert re.match(r"error: rank \d on host h2 \(198\.18\.0\.2\) silent for", lines[0]), lines
    assert lines[1] == lines[0], lines
    assert all(c != 0 for c in codes), codes
    print(f"h2 frozen, h3 stalled: h1 and h3 ended in {elapsed:.1f} s, both with: {lines[0]}")
