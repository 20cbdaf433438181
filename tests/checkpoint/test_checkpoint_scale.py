"""Checkpoint metadata at 1,024 simulated ranks (issue 43): counted, never timed. The engine's own save exchange
(engine/checkpoint/checkpointer.py's, over engine/cluster/exchange.py) and read_index run for every rank by
launch/bench/scale.py on synthetic piece lists of an 8B model (tp 8, pp 8, ZeRO over dp)."""

from __future__ import annotations

import json

import pytest

from engine.checkpoint.format import INDEX, CheckpointError, merge_index, read_index, shard_name
from launch.bench.scale import Tally, file_calls, measure_save

WORLD = 1024


def test_a_save_gathers_piece_lists_to_rank_0_only():
    """Each rank sends its piece list once and receives a fixed few bytes; rank 0 receives them all. Before issue 43
    every rank received every rank's, all-gathered over a world-sized gloo group."""
    row = measure_save(WORLD)
    assert row["req/rank"] <= 5 and row["B/rank"] <= 2 * 8 * 1024  # its own entry (~7 KB pickled: ~4 KB)
    assert row["B/r0"] >= (WORLD - 1) * 3 * 1024  # every other rank's entry, once
    assert row["B/job"] <= 2 * row["B/r0"] + WORLD * 512


def test_a_resume_checks_only_its_share_of_the_shards(tmp_path):
    """read_index as a resume calls it (engine/checkpoint/checkpointer.py ``_validate``), on an index of 1,024
    ranks with one piece each: the last rank looks up its share of the shard files (one), not all 1,024 (before
    issue 43 every rank made 4 look-ups per shard: 4 N^2 for the job)."""
    piece = {"shape": [WORLD], "tp_dim": None, "tp_size": 1}
    metas = [
        {
            "rank": r,
            "file": shard_name(r),
            "bytes": 0,
            "crc32": 0,
            "params": {"w": {**piece, "states": {"param": [[0, r, r + 1]]}}},
        }
        for r in range(WORLD)
    ]
    header = {
        "step": 1,
        "consumed_samples": 0,
        "model_only": True,
        "config": {"model": {}},
        "layout": {"world_size": WORLD},
    }
    (tmp_path / INDEX).write_text(json.dumps(merge_index(metas, header)))
    for r in range(WORLD):
        (tmp_path / shard_name(r)).touch()
    tally = Tally(1)
    with file_calls(tally):
        index = read_index(tmp_path, share=(WORLD - 1, WORLD))
    assert len(index["files"]) == WORLD and tally.lookups[0] <= 8, tally.lookups
    (tmp_path / shard_name(5)).unlink()  # a missing shard is still found, by the rank whose share holds it
    with pytest.raises(CheckpointError, match="rank_00005.safetensors listed in .* is missing"):
        read_index(tmp_path, share=(5, WORLD))
    read_index(tmp_path, share=(6, WORLD))
