"""Checkpoint metadata at 1,024 simulated ranks (issue 43): counted, never timed. The engine's own save exchange
(engine/checkpoint/checkpointer.py's, over engine/cluster/exchange.py), read_index and the Reader's piece lookup run
for every rank by launch/bench/scale.py on synthetic piece lists of an 8B model (tp 8, pp 8, ZeRO over dp)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.checkpoint.format import CheckpointError, Reader, read_index, shard_name
from launch.bench.scale import Tally, file_calls, layout_for, locate_held, measure_save, synthetic_meta

WORLD = 1024


def test_a_save_gathers_small_plans_to_rank_0_only():
    """Each rank writes its own part of the index and sends rank 0 a plan of ~2 KB (the ranges it holds: no pieces
    per state, no RNG state) and receives a fixed few bytes; rank 0 receives one plan per rank. Before issue 43 a
    rank sent its whole entry (~4.2 KB pickled at this layout), and before that every entry went to every rank."""
    row = measure_save(WORLD)
    assert row["req/rank"] <= 5 and row["B/rank"] <= 3 * 1024 and row["files"] == 1, row
    assert (WORLD - 1) * 1024 <= row["B/r0"] <= WORLD * 3 * 1024, row
    assert row["B/job"] <= 2 * row["B/r0"] + WORLD * 512


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint's metadata as a save of 1,024 ranks writes it, beside 1,024 empty shards."""
    folder = tmp_path_factory.mktemp("saved")
    measure_save(WORLD, folder)
    for r in range(WORLD):
        (folder / shard_name(r)).touch()
    return folder


def rchar() -> int:
    """Bytes this process has read so far, by the kernel's count (Linux: /proc/self/io)."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar:"))[6:])


def test_a_resume_reads_the_metadata_of_what_it_loads(saved):
    """The last of 1,024 ranks resumes at the layout that saved: read_index (its share of the shards and parts, as
    checkpointer.py's _validate) and then the location of every piece it holds (as Reader.read in load_into). It
    opens the top level, the locator and the parts that hold its ranges, a few files, and reads under 5 % of the
    checkpoint's metadata. Before issue 43 it parsed the whole index.json, every rank's pieces and RNG state
    (7 MB at this size: 118 MB at 16,384 ranks)."""
    metadata = sum(p.stat().st_size for p in saved.iterdir() if p.suffix in (".json", ".jsonl"))
    rank, tally = WORLD - 1, Tally(1)
    before = rchar()
    with file_calls(tally):
        index = read_index(saved, share=(rank, WORLD))
    validated = rchar() - before
    assert validated <= metadata // 50 and tally.files[0] <= 4, (validated, metadata, tally.files)
    held = synthetic_meta(rank, layout_for(WORLD))["params"]
    reader = Reader(saved, index)
    with file_calls(tally):
        found = locate_held(reader, held)
    reader.close()
    assert all(found) and len(found) == 3 * len(held) == 3 * 24, len(found)
    assert rchar() - before <= metadata // 20, (rchar() - before, metadata)
    assert tally.files[0] <= 4 + 8, tally.files  # the parts read: its own, and the 8 tp ranks' copies of a norm


def test_a_resume_checks_only_its_share_of_the_shards(saved):
    """read_index as a resume calls it: the last rank looks up its share of the shard files (one) and parts, not
    all 1,024 (before issue 43 every rank made 4 look-ups per shard: 4 N^2 for the job); a missing shard, or a
    missing part, is still found, by the rank whose share holds it."""
    tally = Tally(1)
    with file_calls(tally):
        index = read_index(saved, share=(WORLD - 1, WORLD))
    assert index["parts"] == WORLD and index["_share"] == [shard_name(WORLD - 1)] and tally.lookups[0] <= 12
    part = (saved / "part_00007.json").read_bytes()
    (saved / shard_name(5)).unlink()
    (saved / "part_00007.json").unlink()
    try:
        with pytest.raises(CheckpointError, match="rank_00005.safetensors listed in .*part_00005.json is missing"):
            read_index(saved, share=(5, WORLD))
        with pytest.raises(CheckpointError, match="part_00007.json is missing"):
            read_index(saved, share=(7, WORLD))
        read_index(saved, share=(6, WORLD))
    finally:
        (saved / shard_name(5)).touch()
        (saved / "part_00007.json").write_bytes(part)
