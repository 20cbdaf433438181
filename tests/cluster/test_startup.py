"""The start-up join (engine/cluster/startup.py) without hosts: its ranks on threads of this process, each calling
``join`` on its own client of a real TCPStore (rank 0 serving it, as env:// does, or a server of the test's acting
for torchrun's agent), so a mutant of the join fails here in seconds. tests/cluster/test_faults.py runs the same
lines through launch/pretrain.py (a host missing at launch, a rank failing while connecting), tests/cluster/
test_scale.py counts the join's requests at 64 and 1,024 ranks."""

from __future__ import annotations

import functools
import re
import threading
import time

import pytest
import torch.distributed as dist

from engine.cluster import startup
from engine.cluster.heartbeat import host_name, namespace
from engine.cluster.startup import GRACE_S, READY, StartupError, arrive, connect_failed, join, settle
from launch.bench.scale_store import Counting, clients, start_server
from tests.dist import free_port, run_threads


@pytest.fixture
def env(monkeypatch):
    """MASTER_ADDR/PORT of a new job on loopback (env://, no agent, two ranks per node); returns the port."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    return port


def _join(ranks: list[int], world: int, timeout_s: float, late: dict[int, float] | None = None) -> dict[int, str]:
    """Each of ``ranks`` joining on a thread of its own: rank -> 'ok' (its store serves) or the error's line. The
    stores are kept until every rank is done, as a job's processes keep theirs (rank 0's serves the others)."""
    out, stores = {}, []

    def rank(r: int) -> None:
        time.sleep((late or {}).get(r, 0))
        try:
            store = join(r, world, timeout_s)
        except StartupError as e:
            out[r] = str(e)
            return
        stores.append(store)
        store.set(f"seen/{r}", "yes")
        out[r] = "ok" if store.get(f"seen/{r}") == b"yes" else "store broken"

    run_threads([functools.partial(rank, r) for r in ranks])
    return out


def test_every_rank_joins_through_rank_0s_store_or_the_agents(env, monkeypatch):
    # rank 2 half a second late, within a start-up timeout shorter than GRACE_S: the ranks before it wait for it
    assert _join([0, 1, 2], 3, 2, late={2: 0.5}) == {0: "ok", 1: "ok", 2: "ok"}
    # torchrun's agent serves the store: rank 0 is a client like the others (as the server too, it would fail
    # to bind the agent's port)
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert _join([0, 1], 2, 20) == {0: "ok", 1: "ok"}
    assert dist.PrefixStore(namespace(), agent).get("startup") == READY.encode()


def test_missing_ranks_are_named_with_their_node_and_the_joined_ones_with_their_host(env):
    """Ranks 0 and 1 of 4 (node 0) alone: both end at the first one's deadline (1 s; the other's falls GRACE_S
    later) with one line naming node 1's ranks, and rank 0 (serving the store) leaves after rank 1 has read it."""
    start = time.monotonic()
    lines = _join([0, 1], 4, 1)
    assert time.monotonic() - start < 1 + GRACE_S  # the first rank's deadline, not the others'
    expected = (
        "ranks 2-3 (node 1 at 2 ranks per node) of 4 did not join within 1 s (parallel.startup_timeout_s): their "
        f"host is down, unreachable or did not start them; joined: ranks 0, 1 on host {host_name()}"
    )
    assert lines == {0: expected, 1: expected}


def test_rank_0_serving_the_store_leaves_after_every_joined_rank_has_read_the_line(env):
    """Rank 0 gives up first (rank 1 joined after it; rank 2 never comes); rank 1 reads the line half a second
    late: rank 0, whose exit closes the store, has waited for it (a rank meeting a closed store instead would
    print "went away" rather than who is missing)."""
    events = []

    def rank_0() -> None:
        with pytest.raises(StartupError, match=r"^rank 2 \(node 1 at 2 ranks per node\) of 3 did not join"):
            join(0, 3, 1)
        events.append(("rank 0 left", time.monotonic()))

    def late_rank_1() -> None:
        _until_joined(watcher, 1)
        assert arrive(watcher, 1, 3, "host1") == (2, None)
        while not watcher.check(["startup"]):
            time.sleep(0.05)
        time.sleep(0.5)
        watcher.add("left", 1)
        events.append(("rank 1 left", time.monotonic()))

    server = threading.Thread(target=rank_0)
    server.start()
    watcher = clients(env, 1)[0]  # after rank 0 started serving: a client waits for its server
    run_threads([late_rank_1])
    server.join()
    assert [name for name, _ in events] == ["rank 1 left", "rank 0 left"]
    assert events[1][1] - events[0][1] < 2  # at its next look (0.1 s), not at the end of its 5 s


def test_every_rank_ends_at_the_first_ranks_deadline(env):
    """Rank 1 joins 2 s after rank 0, rank 2 never: both end at rank 0's deadline (3 s after it joined), rank 1
    after 1 s of waiting, not at its own deadline (3 s after it joined)."""
    waited = {}

    def rank(r: int) -> None:
        if r:
            _until_joined(watcher, 1)
            time.sleep(2)
        start = time.monotonic()
        with pytest.raises(StartupError, match="did not join within 3 s"):
            join(r, 3, 3)
        waited[r] = time.monotonic() - start

    first = threading.Thread(target=rank, args=(0,))
    first.start()
    watcher = clients(env, 1)[0]
    run_threads([functools.partial(rank, 1)])
    first.join()
    assert waited[1] < 2.5, waited


def test_missing_ranks_over_several_nodes_and_without_the_launchers_node_size(env, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert _join([0, 3], 5, 1)[0].startswith("ranks 1-2, 4 (nodes 1-2, 4 at 1 ranks per node) of 5 did not join")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert _join([1, 0], 3, 1)[0].startswith("rank 2 of 3 did not join within 1 s")


def test_ranges_of_ranks_and_their_nodes(monkeypatch):
    assert startup._ranges([]) == ""
    assert startup._ranges([7]) == "7"
    assert startup._ranges([0, 1, 2, 5, 7, 8, 10]) == "0-2, 5, 7-8, 10"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")  # set but empty: no node size known
    assert startup._nodes([2, 3]) == ""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert startup._nodes([2, 3]) == " (node 0 at 4 ranks per node)"
    assert startup._nodes([4, 8, 9]) == " (nodes 1-2 at 4 ranks per node)"


def test_no_store_to_join_is_one_line_within_the_timeout(env, monkeypatch):
    """Nobody serves the port (rank 0's host never started): each rank's line names the store and the limit."""
    pattern = (
        r"rank (\d) on host .+ could not reach the job's store at 127\.0\.0\.1:{port} within 1 s "
        r"\(parallel\.startup_timeout_s\): the first host \(rank 0's\) is down, unreachable or not started "
        r"\(.*\b{port}\b.*\)"  # torch's reason, which names the port
    )
    line = _join([1], 2, 1)[1]
    assert re.fullmatch(pattern.format(port=env), line), line
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # rank 0 too, where the agent is to serve
    line = _join([0], 2, 1)[0]
    assert re.fullmatch(pattern.format(port=env), line), line


def test_a_store_that_goes_away_during_start_up_is_one_line(env, monkeypatch):
    """The store's host dies while rank 1 waits for rank 2 (30 s left): rank 1 says so at once, not as a
    missing rank at its deadline and not as torch's traceback."""
    server, port, _ = start_server()
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    lines = {}

    def rank_1() -> None:
        lines.update(_join([1], 3, 30))

    watcher = clients(port, 1)[0]
    run_threads([rank_1, lambda: (_until_joined(watcher, 1), server.kill())])
    assert re.fullmatch(
        rf"rank 1 on host .+: the job's store at 127\.0\.0\.1:{port} went away during start-up \(.+ .+\)", lines[1]
    ), lines


def _until_joined(store, count: int) -> None:
    while int(store.add("joined", 0)) < count:
        time.sleep(0.05)


def test_start_up_costs_a_rank_four_requests(env):
    """Through ``arrive`` and ``settle`` on counting clients of one store served by another process: set host, add
    to the count, one wait, one read (the rank completing the count: a compare-set instead of the two)."""
    server, port, stop = start_server()
    try:
        stores = clients(port, 4)
        verdicts = {}

        def rank(r: int, world: int, store: Counting, deadline_s: float) -> None:
            joined, verdict = arrive(store, r, world, f"host{r}")
            if verdict is None:
                verdict = settle(store, time.monotonic() + deadline_s + (0 if joined == 1 else 5), world, 1)
            verdicts[r] = verdict

        run_threads([functools.partial(rank, r, 4, stores[r], 20) for r in range(4)])
        assert verdicts == {r: READY for r in range(4)}
        assert sum(s.requests for s in stores) == 4 * 4 - 1, [s.requests for s in stores]
    finally:
        stop()


def test_connect_failed_names_the_rank_waited_for():
    error = RuntimeError("wait timeout after 20000ms, keys: /default_pg/0/0//cpu//0/12\nmore of torch's lines")
    line = str(connect_failed(error, 3, 20))
    assert re.fullmatch(
        r"rank 3 on host .+: the process group did not connect within 20 s \(parallel\.startup_timeout_s\): "
        r"rank 12 never posted its address \(it failed while connecting, or its host is unreachable\) "
        r"\(wait timeout after 20000ms, keys: /default_pg/0/0//cpu//0/12\)",
        line,
    ), line
    assert "): a rank never posted its address" in str(connect_failed(RuntimeError("connection reset"), 0, 20))
    assert str(connect_failed(TimeoutError(), 0, 20)).endswith("(TimeoutError)")
