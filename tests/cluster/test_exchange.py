"""The store's collectives (engine/cluster/exchange.py) without hosts: every rank's steps in lockstep over one
in-process store, counted (launch/bench/scale.py ``simulate``: requests per rank, the store's live keys), and
ranks on threads of this process over a real TCPStore where a rank is late. tests/cluster/test_shared_scale.py and
tests/checkpoint/test_checkpoint_scale.py run the protocols built on it at 1,024 ranks."""

from __future__ import annotations

import functools
import re
from datetime import timedelta

import pytest
import torch.distributed as dist

from engine.cluster.exchange import ExchangeTimeout, StoreExchange, run_steps
from launch.bench.scale import simulate
from tests.dist import run_threads


def _collectives(exchange, rank):
    """Each collective once, with what every rank got (a rank's steps, as the checkpointer's and shared.py's)."""
    got = {}
    yield "gather"
    got["gather"] = exchange.gather(rank * 10)
    yield "broadcast"
    got["broadcast"] = exchange.broadcast("from 0" if rank == 0 else f"ignored {rank}")
    for name, obj in [("reduce", rank + 1), ("first", None if rank < 2 else f"error of {rank}"), ("none", None)]:
        yield "gather"
        values = exchange.gather(obj)
        yield "broadcast"
        combine = sum if name == "reduce" else lambda values: next((v for v in values if v is not None), None)
        got[name] = exchange.broadcast(combine(values) if rank == 0 else None)
    got["claim"] = [exchange.claim("a"), exchange.claim("a")]
    exchange.release("a")
    got["again"] = exchange.claim("a")
    return got


def test_each_collective_gives_every_rank_its_answer_in_o1_requests_and_keys():
    """At 4 and 64 ranks: rank 0 gathers by rank, every rank reads rank 0's answer; a rank other than 0 makes the
    same few requests whatever the world, and the store never holds more than an exchange's keys."""
    for world in (4, 64):
        tally, results = simulate(world, _collectives)
        assert results[0]["gather"] == [r * 10 for r in range(world)]
        for rank, got in enumerate(results):
            assert got["gather"] is None or rank == 0
            assert got["broadcast"] == "from 0"
            assert got["reduce"] == world * (world + 1) // 2 and got["first"] == "error of 2" and got["none"] is None
            assert got["claim"] == ([True, False] if rank == 0 else [False, False]) and got["again"]
        # per rank other than 0: a set per gather, a wait and a get per broadcast; 3 claims and a release
        assert tally.requests[1:] == [4 + 4 * 2 + 4] * (world - 1), tally.requests
        # rank 0: a wait, a multi_get and world - 1 deletes per gather, a set per broadcast, each answer deleted
        # at the next gather (the last one left); 3 claims and a release
        assert tally.requests[0] == 4 * (2 + world - 1) + 3 + 4 + 4
        assert tally.peak_keys <= world + 1
        assert tally.live == {"bench/8/answer", "bench/claim/a"}


def test_a_world_of_one_asks_the_store_nothing():
    tally, results = simulate(1, _collectives)
    assert results[0]["gather"] == [0] and results[0]["reduce"] == 1 and results[0]["first"] is None
    assert tally.requests == [4]  # the claims and release
    assert run_steps(iter([])) is None
    alone = run_steps(_collectives(StoreExchange(dist.HashStore(), 0, 1, 1.0, "p"), 0))  # steps run to their end
    assert alone["gather"] == [0] and alone["broadcast"] == "from 0" and alone["again"]


@pytest.fixture
def port():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server.port
    del server


def _ranks(port: int, world: int, ranks: list[int], call, timeout_s: float = 1.0) -> dict[int, str]:
    """``call(exchange)`` on each of ``ranks`` (a thread and a client each): rank -> its result or its error."""
    out = {}

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        try:
            out[r] = call(StoreExchange(store, r, world, timeout_s, "ckpt/save"))
        except ExchangeTimeout as e:
            out[r] = str(e)

    run_threads([functools.partial(rank, r) for r in ranks])
    return out


def test_ranks_over_a_real_store_agree():
    for world in (2, 3):  # two: rank 0 answers its one peer too
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # a new job's
        got = _ranks(server.port, world, list(range(world)), lambda ex: [ex.first(ex.rank or None), ex.reduce(1, sum)])
        assert got == {r: [1, world] for r in range(world)}


def test_a_rank_that_never_comes_is_named_by_rank_0_and_rank_0s_silence_by_the_others(port):
    got = _ranks(port, 4, [0, 1, 3], lambda ex: ex.reduce(ex.rank, sum))
    limit = "within 1 s (parallel.timeout_s)"
    assert got[0] == f"rank 0: rank(s) 2 did not reach exchange 1 of ckpt/save {limit}"
    assert (
        got[1] == got[3].replace("rank 3", "rank 1") == f"rank 1: rank 0 did not answer exchange 2 of ckpt/save {limit}"
    )


def test_more_than_eight_late_ranks_are_counted(port):
    got = _ranks(port, 11, [0, 10], lambda ex: ex.gather(None), timeout_s=0.5)
    assert re.fullmatch(r"rank 0: rank\(s\) 1, 2, 3, 4, 5, 6, 7, 8 and 1 more did not reach exchange 1 of .*", got[0])
    assert got[10] is None
    got = _ranks(port, 10, [0, 9], lambda ex: ex.barrier(), timeout_s=0.5)
    assert re.fullmatch(r"rank 0: rank\(s\) 1, 2, 3, 4, 5, 6, 7, 8 did not reach exchange 1 of .*", got[0]), got
