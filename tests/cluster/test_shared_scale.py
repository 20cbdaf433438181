"""The shared-directory check at 1,024 simulated ranks (issue 43): counted, never timed. Every rank runs the
engine's own steps (engine/cluster/shared.py, engine/cluster/exchange.py) over one in-process store, in lockstep
(launch/bench/scale.py ``simulate``): files written, file-system look-ups, store requests and bytes per rank."""

from __future__ import annotations

from pathlib import Path

from engine.cluster import shared
from launch.bench.scale import simulate

WORLD, PER_HOST = 1024, 8
HOSTS = WORLD // PER_HOST


def _check(tmp_path: Path, directory_of=lambda rank: None):
    """Every rank's (hosts, error) and the tally; ``directory_of(rank)`` gives a rank another checkpoint.dir."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def steps(exchange, rank):
        directories = [(out, "train.out_dir"), (directory_of(rank) or ckpt, "checkpoint.dir")]
        return shared.shared_steps(directories, "t0k", exchange, f"h{rank // PER_HOST + 1}")

    return simulate(WORLD, steps)


def test_one_token_per_host_and_2h_look_ups_at_1024_ranks(tmp_path):
    """Before issue 43 every rank wrote a token (2,048 files here) and looked up every rank's (2 x 1,024^2
    look-ups), and every rank's view was gathered to every rank. Now: one token per host and directory, rank 0
    looks up each host's, each host's writer rank 0's host's; a rank other than 0 makes a fixed number of store
    requests and receives a fixed number of bytes whatever the world."""
    tally, results = _check(tmp_path)
    assert all(error is None for _, error in results)
    assert results[0][0] == [f"h{r // PER_HOST + 1}" for r in range(WORLD)]  # rank 0 has every rank's host
    assert all(hosts is None for hosts, _ in results[1:])  # and only rank 0
    assert sum(tally.files) == 2 * HOSTS  # a token per host and directory
    writers = [r for r in range(WORLD) if r % PER_HOST == 0]
    assert [r for r in range(WORLD) if tally.files[r]] == writers
    # look-ups (stat calls): rank 0 each host's token, a writer rank 0's host's (plus mkdir's own check)
    assert tally.lookups[0] <= 2 * HOSTS + 4 and max(tally.lookups[1:]) <= 4
    assert sum(tally.lookups) <= 2 * HOSTS + 4 * HOSTS
    assert max(tally.requests[1:]) <= 8 and max(tally.bytes[1:]) <= 300
    assert tally.requests[0] <= 2 * WORLD + 16  # the coordinator: O(N)
    assert not list((tmp_path / "out").iterdir()) and not list((tmp_path / "ckpt").iterdir())  # tokens removed


def test_a_host_with_a_disk_of_its_own_is_named_on_every_rank_at_1024_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "SETTLE_S", 0.2)  # the missing token is waited for: briefly here
    _, results = _check(tmp_path, lambda rank: tmp_path / "own" if rank // PER_HOST == 41 else None)
    errors = {error for _, error in results}
    assert errors == {
        f"checkpoint.dir '{tmp_path / 'ckpt'}' is not shared by host(s) h42: rank 0 (on h1) and their ranks do not "
        f"see each other's files there, so a checkpoint would lack their shards; give a directory on a file system "
        f"every host mounts"
    }
