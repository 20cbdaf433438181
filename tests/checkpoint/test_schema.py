"""The index's shape (engine/checkpoint/schema.py), checked through its own entry points on small hand-made indexes:
a valid one of each version passes, and each field or rule between fields at and just past its bound is refused
with one CheckpointError naming the file, the field, what it holds and what is valid. The launcher cases (a damaged
step that ``resume: auto`` skips: tests/checkpoint/test_checkpoint_read.py) cost a model build each; these cost
nothing, so every bound is tried on both sides.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from engine.checkpoint.schema import check_index, check_locator, check_part, check_top, shard_path
from engine.errors import CheckpointError

SHARDS = ("rank_00000.safetensors", "rank_00001.safetensors")
MODEL = {"vocab_size": 32, "hidden_size": 8, "num_heads": 2, "num_kv_heads": 1, "num_layers": 1}
RNG = {"python": [3, [0, 2**32 - 1], None], "numpy": ["MT19937", 624, 0, 0.0]}


def version_1() -> dict:
    """Two ranks at tp 2: a (4, 6) weight cut on dim 0 (blocks of 12) and a (6,) norm both ranks hold whole."""
    return {
        "step": 0,
        "consumed_samples": 0,
        "config": {"model": dict(MODEL), "train": {}},
        "layout": {"world_size": 2},
        "files": {f: {"bytes": 0, "crc32": 2**32 - 1} for f in SHARDS},
        "ranks": [{"rank": i, "file": f, "rng": copy.deepcopy(RNG)} for i, f in enumerate(SHARDS)],
        "params": {
            "w": {
                "shape": [4, 6],
                "tp_dim": 0,
                "tp_size": 2,
                "states": {
                    "param": [[SHARDS[0], 0, 0, 12], [SHARDS[1], 1, 0, 12]],
                    "exp_avg": [[SHARDS[0], 0, 0, 6], [SHARDS[1], 1, 6, 12]],
                },
            },
            "norm": {"shape": [6], "tp_dim": None, "tp_size": 1, "states": {"param": [[SHARDS[0], 0, 6, 6]]}},
        },
        "adam_step": 0,
        "model_only": False,
    }


def refused(check, index, *words: str) -> str:
    with pytest.raises(CheckpointError) as e:
        check(index)
    line = str(e.value)
    assert "\n" not in line and line.endswith("(a hand-edited or foreign index)"), line
    for w in words:
        assert w in line, line
    return line


def v1(index) -> None:
    check_index(index, Path("ck/index.json"))


def edited(change) -> dict:
    index = version_1()
    change(index)
    return index


def w_piece(i: int, value: list):
    return lambda x: x["params"]["w"]["states"]["param"].__setitem__(i, value)


def test_a_valid_version_1_index_passes_at_every_bound():
    v1(version_1())
    v1(edited(lambda x: x.update(adam_step=None, model_only=True)))  # a model-only export: moments, no Adam step
    v1(edited(lambda x: x["params"]["w"]["states"].pop("exp_avg") and x.update(adam_step=None)))  # no moments
    v1(edited(lambda x: x["layout"].pop("world_size")))  # an older layout: no world size to match
    v1(edited(lambda x: x["ranks"][0].pop("rng")))
    v1(edited(lambda x: x.update(extra={"another version's key": 1})))
    v1(edited(lambda x: x["params"]["w"].update(tp_dim=1)))  # a row-parallel weight: (4, 6) cut on dim 1


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda x: x.pop("consumed_samples"), ["ck/index.json: consumed_samples is missing (the format requires it)"]),
        (lambda x: x.update(step=-1), ["step is -1, not an integer >= 0"]),
        (lambda x: x.update(step=True), ["step is True, not an integer >= 0"]),
        (lambda x: x.update(step=2.0), ["step is 2.0, not an integer"]),
        (lambda x: x.update(adam_step="abc"), ["adam_step is 'abc', not an integer >= 0"]),
        (lambda x: x.update(model_only=1), ["model_only is 1, not true or false"]),
        (lambda x: x.update(config=[]), ["config is [], not an object with 'model'"]),
        (lambda x: x["config"].pop("model"), ["config.model is missing"]),
        (lambda x: x["config"]["model"].update(num_heads=0), ["config.model.num_heads is 0, not an integer >= 1"]),
        (lambda x: x["config"]["model"].update(family=3), ["config.model.family is 3, not a string"]),
        (lambda x: x["config"]["model"].update(tie_embeddings="no"), ["tie_embeddings is 'no', not true or false"]),
        (lambda x: x["config"].update(train=5), ["config.train is 5, not an object with entries"]),
        (lambda x: x.update(layout=None), ["layout is None, not an object"]),
        (lambda x: x.update(files=[]), ["files is [], not an object"]),
        (
            lambda x: x["files"][SHARDS[0]].update(crc32=2**32),
            [f"files['{SHARDS[0]}'].crc32 is 4294967296, not an integer >= 0 and <= 4294967295"],
        ),
        (lambda x: x["files"][SHARDS[1]].update(bytes=-1), [f"files['{SHARDS[1]}'].bytes is -1"]),
        (lambda x: x.update(ranks=[]), ["ranks is [], not a list of at least 1 entries"]),
        (lambda x: x.update(ranks={}), ["ranks is {}, not a list of at least 1 entries"]),
        (lambda x: x["ranks"][1].pop("file"), ["ranks[1].file is missing"]),
        (lambda x: x["ranks"][1]["rng"]["python"].pop(), ["ranks[1].rng.python is", "not Python's random state"]),
        (lambda x: x["ranks"][1]["rng"]["python"][1].append(2**32), ["ranks[1].rng.python[1][2] is 4294967296"]),
        (lambda x: x["ranks"][1]["rng"]["python"][1].append(-1), ["ranks[1].rng.python[1][2] is -1, not an integer"]),
        (lambda x: x["ranks"][0]["rng"]["python"].__setitem__(2, "g"), ["ranks[0].rng.python[2] is 'g', not a num"]),
        (lambda x: x["ranks"][0]["rng"]["numpy"].__setitem__(3, None), ["ranks[0].rng.numpy[3] is None, not a num"]),
        (lambda x: x["params"]["w"].update(shape=[]), ["params['w'].shape is [], not a list of at least 1 entries"]),
        (lambda x: x["params"]["w"].update(shape=(4, 6)), ["params['w'].shape is (4, 6), not a list of at least 1"]),
        (lambda x: x["params"]["w"].update(tp_dim=2), ["params['w'].tp_dim is 2, not an integer >= 0 and <= 1"]),
        (lambda x: x["params"]["w"].update(tp_dim=-1), ["params['w'].tp_dim is -1, not an integer >= 0 and <= 1"]),
        (lambda x: x["params"]["w"].update(tp_size=0), ["params['w'].tp_size is 0, not an integer >= 1"]),
        (lambda x: x["params"]["w"]["states"].update(param=[]), ["states['param'] is [], not a list of at least 1"]),
        (w_piece(0, [SHARDS[0], 0, 0]), ["states['param'][0] is", "not a piece [shard file, tp rank, start, end]"]),
        (w_piece(0, [SHARDS[0], 0, 0, 12, 1]), ["states['param'][0] is", "not a piece"]),
        (w_piece(0, [0, 0, 0, 12]), ["states['param'][0][0] is 0, not a string"]),
    ],
)
def test_a_field_that_is_not_what_the_format_gives_it_is_named(change, words):
    refused(v1, edited(change), *words)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda x: x["ranks"].reverse(), ["ranks[0] is {'rank': 1, ", "not rank 0's entry, with a shard file listed"]),
        (lambda x: x["ranks"][1].update(file="rank_00002.safetensors"), ["ranks[1] is", "listed in 'files'"]),
        (lambda x: x["layout"].update(world_size=3), ["ranks is '2 entries', not one per rank of layout.world_size=3"]),
        (lambda x: x["layout"].update(world_size=1), ["one per rank of layout.world_size=1"]),
        (w_piece(1, ["rank_00002.safetensors", 1, 0, 12]), ["params['w'].states.param[1] is", "a listed shard"]),
        (w_piece(1, [SHARDS[1], 2, 0, 12]), ["params['w'].states.param[1] is", "tp rank < 2, 0 <= start <= end <= 12"]),
        (w_piece(0, [SHARDS[0], 0, 0, 13]), ["params['w'].states.param[0] is ['rank_00000.safetensors', 0, 0, 13]"]),
        (w_piece(0, [SHARDS[0], 0, 7, 6]), ["params['w'].states.param[0] is", "0 <= start <= end <= 12"]),
        (lambda x: x["params"]["norm"]["states"]["param"][0].__setitem__(3, 7), ["params['norm'].states.param[0]"]),
        (
            lambda x: x["params"]["w"].update(shape=[5, 6]),
            ["params['w'].tp_dim is 0, not a dimension of [5, 6] that 2"],
        ),
        (lambda x: x["params"]["w"].update(shape=[24], tp_dim=1), ["params['w'].tp_dim is 1, not a dimension of [24]"]),
        (lambda x: x.update(adam_step=None), ["adam_step is None, not Adam's step count (the index holds Adam"]),
        (lambda x: x.pop("adam_step"), ["adam_step is None, not Adam's step count"]),
        (
            lambda x: x["config"]["model"].update(num_heads=16),
            ["config.model: model.hidden_size=8 is not divisible by model.num_heads=16 ("],
        ),
        (lambda x: x["config"]["model"].update(num_kv_heads=3), ["config.model: model.num_heads=2 is not divisible"]),
    ],
)
def test_a_rule_between_fields_is_checked_after_the_types(change, words):
    line = refused(v1, edited(change), *words)
    assert "; make it divisible" not in line  # the config's advice is not an index's


def test_a_long_value_is_cut_to_60_characters():
    long = "x" * 100
    line = refused(v1, edited(lambda x: x.update(step=long)))
    assert f"step is '{'x' * 56}..., not an integer" in line
    fits = "y" * 58  # its repr: 60 characters, shown whole
    assert f"step is '{fits}', not" in refused(v1, edited(lambda x: x.update(step=fits)))
    over = "z" * 59  # 61: cut
    assert f"step is '{'z' * 56}..., not" in refused(v1, edited(lambda x: x.update(step=over)))


def version_2() -> dict:
    """The top-level index.json of version 2 for the same parameters: 2 parts, locator lines of 40 bytes each."""
    return {
        "step": 3,
        "consumed_samples": 48,
        "config": {"model": dict(MODEL)},
        "layout": {},
        "parts": 2,
        "locator_bytes": 120,
        "params": {
            "w": {
                "shape": [4, 6],
                "tp_dim": 0,
                "tp_size": 2,
                "states": ["param", "exp_avg"],
                "where": [[0, 40], [40, 40]],
            },
            "norm": {"shape": [6], "tp_dim": None, "tp_size": 1, "states": ["param"], "where": [[80, 40]]},
        },
        "adam_step": 2,
    }


def top(index) -> None:
    check_top(index, Path("ck/index.json"))


def test_version_2s_top_level_is_checked():
    top(version_2())
    index = version_2()
    index["params"]["w"]["states"] = ["param"]
    index.pop("adam_step")
    top(index)  # no moments: no Adam step needed
    for change, words in (
        (lambda x: x.update(parts=0), ["parts is 0, not an integer >= 1"]),
        (lambda x: x["params"]["w"].update(tp_dim=-1), ["params['w'].tp_dim is -1, not an integer >= 0 and <= 1"]),
        (lambda x: x["params"]["w"].update(tp_dim=2), ["params['w'].tp_dim is 2, not an integer >= 0 and <= 1"]),
        (lambda x: x.update(locator_bytes=-1), ["locator_bytes is -1"]),
        (lambda x: x["params"]["w"].update(states=[]), ["params['w'].states is [], not a list of at least 1"]),
        (lambda x: x["params"]["w"]["where"].pop(), ["params['w'].where is [[0, 40]], not 2 ranges (one per tp"]),
        (lambda x: x["params"]["w"]["where"].append([0, 1]), ["params['w'].where is", "2 ranges"]),
        (lambda x: x["params"]["norm"].update(where=[[81, 40]]), ["params['norm'].where is [[81, 40]]", "120 bytes"]),
        (lambda x: x["params"]["w"]["where"][0].pop(), ["params['w'].where[0] is [0], not [offset, length] in loc"]),
        (lambda x: x["params"]["w"].update(shape=[3, 6]), ["params['w'].tp_dim is 0, not a dimension of [3, 6]"]),
        (lambda x: x["params"]["w"].update(tp_size=0), ["params['w'].tp_size is 0, not an integer >= 1"]),
        (lambda x: x["params"]["w"].update(shape=[]), ["params['w'].shape is [], not a list of at least 1 entries"]),
        (lambda x: x["params"]["norm"].update(where=[]), ["params['norm'].where is [], not a list of at least 1"]),
        (lambda x: x.pop("adam_step"), ["adam_step is None, not Adam's step count"]),
        (lambda x: x["config"]["model"].update(num_kv_heads=0), ["config.model.num_kv_heads is 0"]),
        (lambda x: x["config"]["model"].update(head_dim=5), ["config.model: model.head_dim=5 must be even for RoPE"]),
    ):
        index = version_2()
        change(index)
        refused(top, index, *words)
    model_only = version_2()
    model_only.update(model_only=True, adam_step=None)
    top(model_only)


def test_a_part_and_a_locator_line_are_checked_against_the_index():
    index = version_2()
    part = {
        "rank": 1,
        "file": SHARDS[1],
        "bytes": 10,
        "crc32": 0,
        "params": {"w": {"states": {"param": [[1, 0, 12]], "exp_avg": [[1, 6, 12]]}}, "norm": {"states": {}}},
        "rng": copy.deepcopy(RNG),
    }

    def check(p):
        check_part(p, index, Path("ck/part_00001.json"))

    check(part)
    empty = copy.deepcopy(part)
    empty["params"]["w"]["states"]["exp_avg"] = [[1, 6, 6]]  # a piece of no elements (start == end) is valid
    check(empty)
    for change, words in (
        (lambda p: p.update(bytes="5"), ["ck/part_00001.json: bytes is '5', not an integer"]),
        (lambda p: p.update(crc32=2**32), ["crc32 is 4294967296, not an integer >= 0 and <= 4294967295"]),
        (lambda p: p["params"].update(x={"states": {}}), ["params['x'] is 'a parameter', not one of the 2 index.json"]),
        (lambda p: p["params"]["w"]["states"]["param"][0].pop(), ["['param'][0] is [1, 0], not a piece [tp rank"]),
        (lambda p: p["params"]["w"]["states"]["param"].__setitem__(0, [2, 0, 12]), ["tp rank < 2, 0 <= start <= e"]),
        (lambda p: p["params"]["w"]["states"]["param"].__setitem__(0, [1, 0, 13]), ["params['w'].states.param[0]"]),
        (lambda p: p["params"]["w"]["states"]["param"].__setitem__(0, [1, 5, 4]), ["0 <= start <= end <= 12"]),
        (lambda p: p["params"]["norm"]["states"].update(param=[[0, 0, 7]]), ["end <= 6"]),
    ):
        damaged = copy.deepcopy(part)
        change(damaged)
        refused(check, damaged, *words)

    def line(rows, tp_rank=1):
        check_locator(rows, index, "w", tp_rank, Path("ck/locator.jsonl"))

    line([[1, 0, 6, 0], [1, 6, 12, 1]])
    line([])
    for rows, words in (
        ([[1, 0, 6, 2]], ["ck/locator.jsonl: ['w'][0] is [1, 0, 6, 2], not a location in tp block 1, in one of the 2"]),
        ([[0, 0, 6, 0]], ["['w'][0] is [0, 0, 6, 0], not a location in tp block 1"]),
        ([[1, 0, 13, 0]], ["['w'][0] is [1, 0, 13, 0], not a location, tp rank < 2, 0 <= start <= end <= 12"]),
        ([[1, 0, 6]], ["[0] is [1, 0, 6], not a location [tp rank, start, end, part]"]),
        ({"rows": 1}, ["is {'rows': 1}, not a list"]),
    ):
        refused(line, rows, *words)


def test_a_shard_outside_its_step_directory_is_refused(tmp_path):
    step, index = tmp_path / "step_000003", tmp_path / "step_000003" / "index.json"
    (step / "sub").mkdir(parents=True)
    assert shard_path(step, "rank_00000.safetensors", index) == step / "rank_00000.safetensors"
    assert shard_path(step, "sub/../rank_00000.safetensors", index) == step / "sub/../rank_00000.safetensors"
    os.symlink(tmp_path / "elsewhere", step / "out")
    for name in ("../rank_00000.safetensors", str(tmp_path / "rank_00000.safetensors"), "out/rank_00000.safetensors"):
        with pytest.raises(CheckpointError, match="outside the checkpoint directory") as e:
            shard_path(step, name, index)
        assert str(e.value).startswith(f"{index}: shard '{name}' resolves to ")
