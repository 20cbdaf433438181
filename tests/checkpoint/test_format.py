"""The on-disk format (engine/checkpoint/format.py) through its own write and read functions, without a model: four
ranks (tp 2 x dp 2, each holding a flat half of its tp block, as FSDP or ZeRO cut it) write their shards and parts,
rank 0 merges their plans into index.json and locator.jsonl as a save does, and the Reader puts back the full
tensors and any other cut (tp 1, 3 on another dimension, 4; any flat range; a column cut written at tp 4 read at
tp 2) exactly. Damage to a shard (its CRC, its size, a piece missing or of another length, a NaN with a matching
CRC) and to the metadata (a part missing, a locator line that is not JSON, a range no part places) is one
CheckpointError naming the file, as is a parameter the checkpoint lacks; ``read_index``'s share splits the shards
among the ranks that check them. The launcher cases (tests/checkpoint/test_checkpoint_read.py) cost a model build
each; these seconds for every cut.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint.format import (
    INDEX,
    LOCATOR,
    Reader,
    file_crc32,
    fsync_write,
    merge_index,
    part_name,
    piece_key,
    rank_entry,
    read_index,
    save_safetensors,
    shard_name,
    tp_box,
    verify_shard,
    write_part,
    write_shard,
)
from engine.errors import CheckpointError
from tests.checkpoint.versions import as_version_1

# name -> (shape, tp_dim): a row-cut weight, a column-cut weight, a row-cut bias, a replicated norm
PARAMS = {"w": ([6, 8], 0), "o": ([4, 6], 1), "b": ([6], 0), "norm": ([5], None)}
STATES = ("param", "exp_avg")
TP, DP = 2, 2
MODEL = {"vocab_size": 32, "hidden_size": 8, "num_heads": 2, "num_kv_heads": 1, "num_layers": 1}


def full_tensors() -> dict[tuple[str, str], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {(n, s): torch.randn(shape, generator=g) for n, (shape, _) in PARAMS.items() for s in STATES}


def tp_block(full: torch.Tensor, tp_dim: int | None, tp_rank: int) -> torch.Tensor:
    return full.reshape(-1) if tp_dim is None else full.chunk(TP, tp_dim)[tp_rank].reshape(-1)


def save(root: Path) -> tuple[Path, dict]:
    """Four ranks at tp 2 x dp 2 write their shards and parts; rank 0 merges the plans into index.json."""
    full, step = full_tensors(), root / "step_000003"
    step.mkdir(parents=True)
    plans = []
    for rank in range(TP * DP):
        tp_rank, dp_rank = rank // DP, rank % DP
        tensors, params = {}, {}
        for name, (shape, tp_dim) in PARAMS.items():
            if tp_dim is None and tp_rank:
                continue  # a replicated parameter is written by tp rank 0 only
            block_tp = 0 if tp_dim is None else tp_rank
            entry = params[name] = {"shape": shape, "tp_dim": tp_dim, "tp_size": 1 if tp_dim is None else TP}
            entry["states"] = {}
            for state in STATES:
                block = tp_block(full[name, state], tp_dim, block_tp)
                cut = (block.numel() + 1) // DP  # uneven halves (an odd block: the second rank holds one less)
                lo, hi = dp_rank * cut, min(block.numel(), (dp_rank + 1) * cut)
                tensors[piece_key(name, state, block_tp, lo)] = block[lo:hi].clone()
                entry["states"][state] = [[block_tp, lo, hi]]
        meta = {"rank": rank, "file": shard_name(rank), "params": params, "adam_step": 3 if rank == 1 else None}
        meta.update(write_shard(step / shard_name(rank), tensors))
        plans.append(write_part(step, rank, meta))
    publish(step, plans[::-1])  # in any order: parts by number
    return step, full


def publish(step: Path, plans: list[dict]) -> None:
    """Rank 0's commit: the ranks' plans merged into locator.jsonl and index.json (step 3, 48 samples)."""
    header = {"step": 3, "consumed_samples": 48, "config": {"model": MODEL}, "layout": {"world_size": len(plans)}}
    header["adam_step"] = max(p.pop("adam_step") or 0 for p in plans)
    index, extra = merge_index(plans, header)
    for name, text in extra.items():
        fsync_write(step / name, text)
    fsync_write(step / INDEX, json.dumps(index))


@pytest.fixture
def saved(tmp_path) -> tuple[Path, dict]:
    return save(tmp_path / "ckpt")


def test_a_save_reads_back_whole_and_at_every_other_cut(saved):
    step, full = saved
    index = read_index(step)
    assert index["parts"] == 4 and index["step"] == 3 and index["adam_step"] == 3
    reads_back_at_every_cut(step, full, index)
    umask = os.umask(0o022)
    os.umask(umask)
    assert {(step / shard_name(r)).stat().st_mode & 0o777 for r in range(4)} == {0o666 & ~umask}  # as index.json's


def reads_back_at_every_cut(step: Path, full: dict, index: dict) -> None:
    assert sorted(index["_share"]) == [shard_name(r) for r in range(4)]
    for file in index["_share"]:
        verify_shard(step, index, file)
    reader = Reader(step, index)
    assert reader.states("w") == list(STATES)
    for (name, state), want in full.items():
        assert torch.equal(reader.full(name, state), want), (name, state)
        shape, tp_dim = PARAMS[name]
        row = want[0].numel()  # a row of the global tensor: no block's is longer
        for dim, size in [(None, 1), (0, 2), (0, 3), (1, 2), (1, 3)]:
            if dim is not None and (dim >= len(shape) or shape[dim] % size):
                continue
            for rank in range(size):
                block = want.reshape(-1) if dim is None else want.chunk(size, dim)[rank].reshape(-1)
                n = block.numel()
                for start, end in [(0, n), (1, n - 1), (n // 2, n), (n // 2, n - 1), (0, 1), (n - 1, n), (2, 2)]:
                    got = reader.read(name, state, dim, size, rank, start, end)
                    assert torch.equal(got, block[start:end]), (name, state, dim, size, rank, start, end)
                    # what the read holds: the block rows the range touches, not the rows before them too
                    assert got.untyped_storage().nbytes() < 4 * (end - start + 2 * row), (name, dim, start, end)
    reader.close()


def test_the_index_and_locator_say_who_holds_what(saved):
    step, _ = saved
    index = json.loads((step / INDEX).read_text())
    assert index["params"]["w"]["states"] == list(STATES) and index["locator_bytes"] == (step / LOCATOR).stat().st_size
    lines = (step / LOCATOR).read_text().splitlines()
    assert len(lines) == sum(1 if tp_dim is None else TP for _, tp_dim in PARAMS.values())
    offset, length = index["params"]["w"]["where"][1]
    rows = json.loads((step / LOCATOR).read_bytes()[offset : offset + length])
    assert rows == [[1, 0, 12, 2], [1, 12, 24, 3]]  # tp block 1 of w: ranks 2 and 3, parts 2 and 3
    part = json.loads((step / part_name(3)).read_text())
    assert part["file"] == shard_name(3) and "adam_step" not in part
    assert part["params"]["o"] == {"states": {"param": [[1, 6, 12]], "exp_avg": [[1, 6, 12]]}}
    assert rank_entry(step, read_index(step), 3)["file"] == shard_name(3)
    for (start, end), part in [((2, 3), 3), ((0, 2), 2)]:  # a read opens only the parts overlapping its range
        index = read_index(step, (0, 4))  # rank 0 of 4: part 0 checked
        Reader(step, index).read("b", "param", 0, TP, 1, start, end)  # b's tp block 1: [0, 2) part 2, [2, 3) part 3
        assert sorted(index["_parts"]) == [0, part], (start, end)
    assert rank_entry(step, read_index(step), 4) == {}  # no such rank: a larger world resumes it


def test_ranks_disagreeing_on_a_cut_is_a_bug_named():
    plan = {"part": 0, "params": {"w": {"shape": [4], "tp_dim": None, "tp_size": 1, "states": ["param"], "rows": []}}}
    other = {"part": 1, "params": {"w": {**plan["params"]["w"], "shape": [5]}}}
    with pytest.raises(RuntimeError, match="ranks disagree on the layout of w"):
        merge_index([plan, other], {})


def test_each_rank_checks_its_share_of_the_shards(saved):
    step, _ = saved
    shares = [read_index(step, (rank, 3))["_share"] for rank in range(3)]
    assert shares == [[shard_name(0), shard_name(3)], [shard_name(1)], [shard_name(2)]]


def _rewrite(step: Path, rank: int, change) -> None:
    """Rank ``rank``'s shard changed by ``change`` (its tensors), its part's size and CRC made to match."""
    shard = step / shard_name(rank)
    tensors = load_file(str(shard))
    change(tensors)
    save_safetensors(tensors, shard)
    part = json.loads((step / part_name(rank)).read_text())
    part.update(bytes=shard.stat().st_size, crc32=file_crc32(shard))
    (step / part_name(rank)).write_text(json.dumps(part))


def test_a_damaged_shard_is_named(saved):
    step, _ = saved
    key = piece_key("w", "exp_avg", 1, 12)
    _rewrite(step, 3, lambda t: t[key].__setitem__(0, float("inf")))
    index = read_index(step)
    with pytest.raises(CheckpointError, match=r"holds NaN/inf values in w \(exp_avg\) of step 3: resuming it"):
        verify_shard(step, index, shard_name(3))
    _rewrite(step, 3, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"does not hold piece '{key}' of 12 elements recorded in .*part_00003"):
        verify_shard(step, read_index(step), shard_name(3))
    reader = Reader(step, read_index(step))  # a read that was not verified first: the piece is named all the same
    with pytest.raises(CheckpointError, match=f"shard {step / shard_name(3)}: cannot read piece of w exp_avg"):
        reader.full("w", "exp_avg")
    _rewrite(step, 3, lambda t: t.update({key: torch.zeros(11)}))
    with pytest.raises(CheckpointError, match=f"does not hold piece '{key}' of 12 elements"):
        verify_shard(step, read_index(step), shard_name(3))
    with pytest.raises(CheckpointError, match="piece of w exp_avg holds 11 of the 12 elements \\[12, 24\\)"):
        Reader(step, read_index(step)).full("w", "exp_avg")  # unverified: was a RuntimeError traceback
    (step / shard_name(3)).write_bytes(b"\xff" * 64)  # not safetensors, its size and CRC recorded
    part = json.loads((step / part_name(3)).read_text())
    part.update(bytes=64, crc32=file_crc32(step / shard_name(3)))
    (step / part_name(3)).write_text(json.dumps(part))
    with pytest.raises(CheckpointError, match=f"shard {step / shard_name(3)} is not a readable safetensors file"):
        verify_shard(step, read_index(step), shard_name(3))
    shard = step / shard_name(2)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # same size, another CRC
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"shard {shard} fails its CRC-32 check"):
        verify_shard(step, read_index(step), shard_name(2))
    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(CheckpointError, match=f"shard {shard} has {len(data) - 1} bytes, .*records {len(data)}"):
        read_index(step)
    assert read_index(step, (1, 2))["_share"] == [shard_name(1), shard_name(3)]  # not this rank's share


def test_a_shard_gone_after_the_index_check_is_named_with_the_reason(saved):
    """A shard removed or replaced between read_index's size check and its CRC check (a prune or a copy racing the
    resume) is one CheckpointError naming the shard and the system's reason, which resume catches to try an older
    step: not an OSError traceback, and not the errno's repr."""
    step, _ = saved
    index, shard = read_index(step), step / shard_name(1)
    shard.unlink()
    with pytest.raises(CheckpointError) as error:
        verify_shard(step, index, shard_name(1))
    assert str(error.value) == f"shard {shard} cannot be read (No such file or directory)"


def test_a_missing_piece_is_named_alone(saved):
    """verify_shard's own verdict on a readable shard (a piece missing) reaches the user as it is, not wrapped in
    "is not a readable safetensors file (...)", which would send them looking for a torn file."""
    step, _ = saved
    key = piece_key("w", "param", 0, 0)
    _rewrite(step, 0, lambda t: t.pop(key))
    with pytest.raises(CheckpointError) as error:
        verify_shard(step, read_index(step), shard_name(0))
    recorded = step / part_name(0)
    assert (
        str(error.value)
        == f"shard {step / shard_name(0)} does not hold piece '{key}' of 12 elements recorded in {recorded}"
    )


def test_damaged_metadata_is_named(saved):
    step, _ = saved
    part, long = (step / part_name(3)).read_text(), "rank_" + "0" * 300 + ".safetensors"
    (step / part_name(3)).write_text(json.dumps({**json.loads(part), "file": long}))  # a name no file system holds
    try:  # Python 3.10-3.12: an over-long name raises here; later ones may call it no file
        (step / long).is_file()
        words = f"{step / long}"
    except OSError:
        words = f"cannot read {step / long} (File name too long)"
    with pytest.raises(CheckpointError, match=re.escape(words)):
        read_index(step)  # the file that cannot be read is named, not index.json
    (step / part_name(3)).write_bytes(b"\xff" + part.encode()[1:])
    with pytest.raises(CheckpointError, match=re.escape(f"{step / part_name(3)} is not UTF-8 text (byte 0)")):
        read_index(step)
    (step / part_name(3)).write_text(part)
    damaged = json.loads(part)
    del damaged["params"]["w"]["states"]["exp_avg"]  # part 3 no longer places its piece of w's exp_avg
    (step / part_name(3)).write_text(json.dumps(damaged))
    covered = f"{step / INDEX}: w exp_avg elements [0, 24) of tp block 1 are covered 12 times over 24"
    with pytest.raises(CheckpointError, match=re.escape(covered)):
        Reader(step, read_index(step)).full("w", "exp_avg")
    (step / part_name(3)).write_text(part)
    text = (step / LOCATOR).read_text()
    (step / LOCATOR).write_text("x" + text[1:])
    with pytest.raises(CheckpointError, match=r"locator.jsonl: the line of \w+ at byte 0 is not JSON"):
        read_index(step)
    (step / LOCATOR).write_text(text[:-1])
    with pytest.raises(CheckpointError, match=f"{step / LOCATOR} has {len(text) - 1} bytes"):
        read_index(step)
    (step / LOCATOR).write_text(text)
    (step / part_name(2)).unlink()
    with pytest.raises(CheckpointError, match=f"{step / part_name(2)} is missing"):
        read_index(step)
    index = json.loads((step / INDEX).read_text())
    (step / INDEX).write_text(json.dumps({**index, "version": 3}))
    with pytest.raises(CheckpointError, match="is not an engine-checkpoint v1 or v2 index"):
        read_index(step)


def test_a_tp_cut_of_another_kind_is_refused():
    assert tp_box([6, 8], 1, 2, 1) == (0, 6, 4, 8) and tp_box([6], 0, 3, 2) == (4, 6, 0, 1)
    assert tp_box([6, 8], None, 2, 1) == (0, 6, 0, 8) and tp_box([0, 8], 0, 1, 0) == (0, 0, 0, 0)
    with pytest.raises(CheckpointError, match="tp_dim=1 of a 3-D parameter is not supported"):
        tp_box([2, 2, 2], 1, 2, 0)


def test_a_version_1_checkpoint_reads_back_shares_and_names_damage_as_version_2(saved):
    """The format before issue 43 (one index.json with every rank's pieces, files and entries) is still read: every
    cut, each rank's share of the shards, the ranks' entries, and a damaged piece named with index.json."""
    step, full = saved
    as_version_1(step)
    index = read_index(step)
    assert index["version"] == 1 and not (step / LOCATOR).exists()
    reads_back_at_every_cut(step, full, index)
    shares = [read_index(step, (rank, 3))["_share"] for rank in range(3)]
    assert shares == [[shard_name(0), shard_name(3)], [shard_name(1)], [shard_name(2)]]
    assert rank_entry(step, index, 3)["file"] == shard_name(3) and rank_entry(step, index, 4) == {}
    key = piece_key("w", "exp_avg", 1, 12)
    shard = step / shard_name(3)
    tensors = load_file(str(shard))
    tensors[key] = torch.zeros(11)
    save_safetensors(tensors, shard)
    files = json.loads((step / INDEX).read_text())
    files["files"][shard_name(3)] = {"bytes": shard.stat().st_size, "crc32": file_crc32(shard)}
    (step / INDEX).write_text(json.dumps(files))
    with pytest.raises(CheckpointError, match=f"does not hold piece '{key}' of 12 elements recorded in .*index.json"):
        verify_shard(step, read_index(step), shard_name(3))


def test_a_read_of_part_of_a_block_names_the_range_it_misses_and_a_parameter_the_checkpoint_lacks(saved):
    """A resume at another cut reads part of a writer's tp block (from element 8 on here); a piece of it that no
    part places any more is one CheckpointError naming the elements asked for and how many were found, in the
    block's own numbers; a parameter the checkpoint does not hold is named with its index.json (another model)."""
    step, _ = saved
    damaged = json.loads((step / part_name(3)).read_text())
    del damaged["params"]["w"]["states"]["exp_avg"]  # part 3 no longer places w's exp_avg [12, 24) of tp block 1
    (step / part_name(3)).write_text(json.dumps(damaged))
    reader = Reader(step, read_index(step))
    covered = f"{step / INDEX}: w exp_avg elements [8, 24) of tp block 1 are covered 4 times over 16 (a missing"
    with pytest.raises(CheckpointError, match=re.escape(covered)):
        reader.read("w", "exp_avg", 0, TP, 1, 8, 24)  # block rows 1-2 of tp block 1: [0, 12) is part 2's only
    with pytest.raises(CheckpointError, match=re.escape(f"{step / INDEX} has no parameter 'lm_head' (a different")):
        reader.full("lm_head")
    reader.close()


def test_a_column_cut_written_at_tp_4_reads_back_at_tp_2_and_1(tmp_path):
    """tp 4 -> tp 2 along the columns (a row-parallel weight resumed at half the tp size): each block read is two
    written blocks side by side, each copied into its own columns only; at tp 1, four of them."""
    full, step = torch.randn(3, 8, generator=torch.Generator().manual_seed(1)), tmp_path / "step_000003"
    step.mkdir()
    plans = []
    for rank, block in enumerate(full.chunk(4, 1)):
        param = {"shape": [3, 8], "tp_dim": 1, "tp_size": 4, "states": {"param": [[rank, 0, 6]]}}
        meta = {"rank": rank, "file": shard_name(rank), "params": {"o": param}}
        meta.update(write_shard(step / shard_name(rank), {piece_key("o", "param", rank, 0): block.reshape(-1)}))
        plans.append(write_part(step, rank, meta))
    publish(step, plans)
    reader = Reader(step, read_index(step))
    for size in (1, 2, 4):
        for rank, want in enumerate(full.chunk(size, 1)):
            got = reader.read("o", "param", 1, size, rank, 0, want.numel())
            assert torch.equal(got, want.reshape(-1)), (size, rank)
    reader.close()
