"""The store traffic of the heartbeat and the start-up is O(1) per rank (issue 43): a real TCPStore (libuv) in a
process of its own, two client processes acting for 64 and then 1,024 ranks, each rank running the engine's own
code (engine/cluster/startup.py arrive/settle; engine/cluster/heartbeat.py enter/exchange/judge) on a client that
counts requests and keys (launch/bench/scale_store.py). Counts, never times: the same per rank at both sizes.
Before, every rank read every rank's counter each beat (keys per rank = N) and polled the start-up count 5 times
a second."""

from __future__ import annotations

import pytest

from engine.cluster.heartbeat import slice_size, watched
from launch.bench.scale_store import measure_heartbeat, measure_startup

SMALL, LARGE = 64, 1024


@pytest.fixture(scope="module")
def heartbeat():
    return measure_heartbeat(SMALL, rounds=6), measure_heartbeat(LARGE, rounds=6)


def test_every_rank_is_read_by_one_watcher_on_another_host_and_every_watcher_is_read():
    for world, local in [(2, 1), (3, None), (16, 8), (20, 8), (1024, 8), (10, 72)]:
        size = slice_size(world, local)
        readers = {}
        for rank in range(world):
            for peer in watched(rank, world, size):
                assert peer not in readers, (world, local, peer)
                readers[peer] = rank
        assert sorted(readers) == list(range(world)), (world, local)
        assert all(readers[r] // size != r // size for r in range(world)), (world, local)  # not its own slice
        assert max(len(watched(r, world, size)) for r in range(world)) <= 64


def test_slices_are_the_hosts_of_either_launcher(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "4")  # the deepspeed launcher's ranks per host
    assert slice_size(16) == 4 and watched(0, 16, 4) == [4, 5, 6, 7] and watched(12, 16, 4) == [0, 1, 2, 3]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's
    assert slice_size(16) == 2


def test_heartbeat_costs_each_rank_the_same_requests_and_keys_at_1024_ranks_as_at_64(heartbeat):
    small, large = heartbeat
    # every rank sets its counter; a watcher (1 in 8) reads its slice's 8 counters, verdict and alarm; the others
    # read verdict every third beat
    assert large["requests_per_rank_per_round"] == small["requests_per_rank_per_round"] == 1 + 1 / 8 + 7 / 8 / 3
    assert large["keys_per_rank_per_round"] == small["keys_per_rank_per_round"] == 1 + (8 + 2) / 8 + 7 / 8 / 3
    assert large["start_requests_per_rank"] == small["start_requests_per_rank"] <= 6, (small, large)
    # the host names read once: the watched slice's and rank 0's (one key fewer where rank 0 is in the slice)
    assert abs(large["start_keys_per_rank"] - small["start_keys_per_rank"]) < 0.1, (small, large)
    assert large["start_keys_per_rank"] <= 12, (small, large)
    # bytes per rank grow only with the digits of a rank's number in its key
    assert large["bytes_per_round"] / LARGE < 1.1 * small["bytes_per_round"] / SMALL, (small, large)


def test_startup_costs_each_rank_four_requests_at_1024_ranks_as_at_64():
    """set host, add to the count, then one blocking wait and one read (the rank completing the count: a
    compare-set instead of the two); before, a waiting rank asked 5 times a second for as long as it waited."""
    small, large = measure_startup(SMALL), measure_startup(LARGE)
    assert small["requests"] == 4 * SMALL - 1 and large["requests"] == 4 * LARGE - 1, (small, large)
    assert small["keys"] == 4 * SMALL - 1 and large["keys"] == 4 * LARGE - 1, (small, large)
