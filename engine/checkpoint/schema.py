"""The shape of a checkpoint's index.json (engine/checkpoint/format.py), checked whole before any field is used;
version 2's parts and locator lines (``check_top``, ``check_part``, ``check_locator``) as they are read.

Why: an index that is valid JSON but hand-edited or foreign (a files entry that is a number, consumed_samples
missing, no ranks, adam_step "abc", a piece of 3 numbers) used to fail deep in the load with a KeyError or
TypeError, after the checkpoint had been chosen, so ``resume: auto`` never fell back to an older step (issue 34).
``check_index`` raises one CheckpointError naming the field, what it holds and what the format gives it, so the
checkpointer treats the step as it treats a corrupt one. The specs are small checkers: ``spec(value, where)``
raises ``_Bad`` with the path of the field (``params['x'].states.param[0]``) and what would be valid. Keys not
named here are allowed (another version's additions); the cross-field rules (a piece's file is a listed shard,
its range inside its tp block, one rank entry per rank) follow the type check.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from engine.config import ModelConfig
from engine.config_checks import validate_heads
from engine.errors import CheckpointError, ConfigError

Spec = Callable[[object, str], None]


class _Bad(Exception):
    """A field that is not what the format gives it: ``str(e)`` says where, what it holds and what is valid."""

    def __init__(self, where: str, value: object, expected: str):
        super().__init__(f"{where} is {_short(value)}, not {expected}")


class _Missing(_Bad):
    def __init__(self, where: str):
        Exception.__init__(self, f"{where} is missing (the format requires it)")


class _Said(_Bad):
    """A rule between fields that engine/config_checks.py words: its line, up to the advice meant for a config."""

    def __init__(self, where: str, error: Exception):
        Exception.__init__(self, f"{where}: {str(error).split(';')[0]}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def integer(lo: int = 0, hi: int | None = None) -> Spec:
    def check(v, where):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
            raise _Bad(where, v, f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))

    return check


def number(v, where):
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _Bad(where, v, "a number")


def text(v, where):
    if not isinstance(v, str):
        raise _Bad(where, v, "a string")


def boolean(v, where):
    if not isinstance(v, bool):
        raise _Bad(where, v, "true or false")


def maybe(spec: Spec) -> Spec:
    def check(v, where):
        if v is not None:
            spec(v, where)

    return check


def list_of(spec: Spec, min_len: int = 0) -> Spec:
    def check(v, where):
        if not isinstance(v, list) or len(v) < min_len:
            raise _Bad(where, v, f"a list of at least {min_len} entries" if min_len else "a list")
        for i, item in enumerate(v):
            spec(item, f"{where}[{i}]")

    return check


def row(*specs: Spec, what: str) -> Spec:
    """A fixed-length list, e.g. a piece [file, tp_rank, start, end]."""

    def check(v, where):
        if not isinstance(v, list) or len(v) != len(specs):
            raise _Bad(where, v, what)
        for i, (spec, item) in enumerate(zip(specs, v)):
            spec(item, f"{where}[{i}]")

    return check


def mapping(spec: Spec) -> Spec:
    """An object of any keys, each value ``spec``."""

    def check(v, where):
        if not isinstance(v, dict):
            raise _Bad(where, v, "an object")
        for key, item in v.items():
            spec(item, f"{where}[{key!r}]")

    return check


def fields(required: dict[str, Spec], optional: dict[str, Spec] | None = None) -> Spec:
    """An object with the ``required`` keys (and, when present, the ``optional`` ones) of the given specs."""

    def check(v, where):
        if not isinstance(v, dict):
            raise _Bad(where, v, f"an object with {', '.join(map(repr, required)) or 'entries'}")
        for key, spec in {**required, **(optional or {})}.items():
            if key in v:
                spec(v[key], f"{where}.{key}" if where else key)
            elif key in required:
                raise _Missing(f"{where}.{key}" if where else key)

    return check


PIECE = row(text, integer(), integer(), integer(), what="a piece [shard file, tp rank, start, end]")
RNG = fields(
    {
        "python": row(
            integer(),
            list_of(integer(0, 2**32 - 1)),
            maybe(number),
            what="Python's random state [version, [ints], gauss]",
        ),
        "numpy": row(text, integer(), integer(), number, what="NumPy's state [kind, pos, has_gauss, gauss]"),
    }
)
# The model shape an export builds from (absent keys take ModelConfig's defaults: an older checkpoint's); the sizes
# are >= 1 as engine/config_checks.py requires (num_heads 0 divided by zero building the model: issue 42)
MODEL = fields(
    {},
    {
        **{
            k: integer(1)
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
        },
        "head_dim": integer(),  # 0: hidden_size / num_heads
        "num_experts": integer(),  # 0: dense
        "tie_embeddings": boolean,
        "attention_bias": boolean,
        "family": text,
    },
)
INDEX = fields(
    {
        "step": integer(),
        "consumed_samples": integer(),
        "config": fields({"model": MODEL}, {"train": fields({})}),
        "layout": fields({}),
        "files": mapping(fields({"bytes": integer(), "crc32": integer(0, 2**32 - 1)})),
        "ranks": list_of(fields({"rank": integer(), "file": text}, {"rng": RNG}), 1),
        "params": mapping(
            fields(
                {
                    "shape": list_of(integer(), 1),
                    "tp_dim": maybe(integer(0, 1)),
                    "tp_size": integer(1),
                    "states": mapping(list_of(PIECE, 1)),
                }
            )
        ),
    },
    {"adam_step": maybe(integer()), "model_only": boolean},
)

# Version 2 (engine/checkpoint/format.py): the top level, a rank's part, a parameter's locator line.
TOP = fields(
    {
        "step": integer(),
        "consumed_samples": integer(),
        "config": fields({"model": MODEL}, {"train": fields({})}),
        "layout": fields({}),
        "parts": integer(1),
        "locator_bytes": integer(),
        "params": mapping(
            fields(
                {
                    "shape": list_of(integer(), 1),
                    "tp_dim": maybe(integer(0, 1)),
                    "tp_size": integer(1),
                    "states": list_of(text, 1),
                    "where": list_of(row(integer(), integer(), what="[offset, length] in locator.jsonl"), 1),
                }
            )
        ),
    },
    {"adam_step": maybe(integer()), "model_only": boolean},
)
PART = fields(
    {
        "rank": integer(),
        "file": text,
        "bytes": integer(),
        "crc32": integer(0, 2**32 - 1),
        "params": mapping(
            fields(
                {"states": mapping(list_of(row(integer(), integer(), integer(), what="a piece [tp rank, start, end]")))}
            )
        ),
    },
    {"rng": RNG},
)
LOCATION = row(integer(), integer(), integer(), integer(), what="a location [tp rank, start, end, part]")


def _consistent(index: dict) -> None:
    """The rules between fields: what the load indexes by (rank, shard file, tp block) must exist."""
    files, ranks, world = index["files"], index["ranks"], index["layout"].get("world_size")
    for i, r in enumerate(ranks):
        if r["rank"] != i or r["file"] not in files:
            raise _Bad(
                f"ranks[{i}]",
                {"rank": r["rank"], "file": r["file"]},
                f"rank {i}'s entry, with a shard file listed in 'files'",
            )
    if isinstance(world, int) and len(ranks) != world:
        raise _Bad("ranks", f"{len(ranks)} entries", f"one per rank of layout.world_size={world}")
    moments = False
    for name, p in index["params"].items():
        block, tp_size = _block(p, f"params[{name!r}].tp_dim"), p["tp_size"]
        for state, pieces in p["states"].items():
            moments = moments or state != "param"
            for i, (file, tp, start, end) in enumerate(pieces):
                if file not in files or tp >= tp_size or not start <= end <= block:
                    raise _Bad(
                        f"params[{name!r}].states.{state}[{i}]",
                        pieces[i],
                        f"a piece of a listed shard, tp rank < {tp_size}, 0 <= start <= end <= {block}",
                    )
    if moments and not index.get("model_only") and index.get("adam_step") is None:
        raise _Bad("adam_step", index.get("adam_step"), "Adam's step count (the index holds Adam moments)")
    _heads(index["config"]["model"])


def _heads(model: dict) -> None:
    """The saved model's heads divide as a config's must (engine/config_checks.py): a hand-edited num_heads of 128
    for hidden_size 64 left a head width of 0 to divide by when the model was built."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        validate_heads(ModelConfig(**{k: v for k, v in model.items() if k in known}))
    except ConfigError as e:
        raise _Said("config.model", e) from None


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _block(p: dict, where: str = "tp_dim") -> int:
    """Elements of one tp block of parameter entry ``p``, after checking that its tp cut divides its shape."""
    shape, tp_size = p["shape"], p["tp_size"]
    if (p["tp_dim"] == 1 and len(shape) != 2) or (p["tp_dim"] is not None and shape[p["tp_dim"]] % tp_size):
        raise _Bad(where, p["tp_dim"], f"a dimension of {shape} that {tp_size} divides")
    return _numel(shape) // (tp_size if p["tp_dim"] is not None else 1)


def _ranges(rows: list, p: dict, where: str, what: str) -> None:
    """Every row's [tp rank, start, end] (its first three entries) lies inside a tp block of parameter ``p``."""
    block = _block(p)
    for i, r in enumerate(rows):
        if r[0] >= p["tp_size"] or not r[1] <= r[2] <= block:
            raise _Bad(f"{where}[{i}]", r, f"{what}, tp rank < {p['tp_size']}, 0 <= start <= end <= {block}")


def _checked(spec: Spec, rules: Callable[[], None], path: Path) -> Callable[[object], None]:
    def check(value):
        try:
            spec(value, "")
            rules()
        except _Bad as e:
            raise CheckpointError(f"{path}: {e} (a hand-edited or foreign index)") from None

    return check


def check_top(index: dict, index_path: Path) -> None:
    """``check_index`` for a version-2 top-level index.json."""

    def rules():
        for name, p in index["params"].items():
            _block(p, f"params[{name!r}].tp_dim")
            if len(p["where"]) != p["tp_size"] or any(a + n > index["locator_bytes"] for a, n in p["where"]):
                expected = f"{p['tp_size']} ranges (one per tp block) of the {index['locator_bytes']} bytes"
                raise _Bad(f"params[{name!r}].where", p["where"], expected)
        moments = any(s != "param" for p in index["params"].values() for s in p["states"])
        if moments and not index.get("model_only") and index.get("adam_step") is None:
            raise _Bad("adam_step", index.get("adam_step"), "Adam's step count (the index holds Adam moments)")
        _heads(index["config"]["model"])

    _checked(TOP, rules, index_path)(index)


def check_part(part: dict, index: dict, part_path: Path) -> None:
    """A rank's part: its fields, and every piece inside a tp block of a parameter the index lists."""

    def rules():
        for name, p in part["params"].items():
            if name not in index["params"]:
                raise _Bad(f"params[{name!r}]", "a parameter", f"one of the {len(index['params'])} index.json lists")
            for state, pieces in p["states"].items():
                _ranges(pieces, index["params"][name], f"params[{name!r}].states.{state}", "a piece")

    _checked(PART, rules, part_path)(part)


def check_locator(rows: object, index: dict, name: str, tp_rank: int, path: Path) -> None:
    """The locator line of tp block ``tp_rank`` of a parameter: rows [tp rank, start, end, part] inside that
    block, of an existing part."""

    def rules():
        _ranges(rows, index["params"][name], f"[{name!r}]", "a location")
        for i, r in enumerate(rows):
            if r[0] != tp_rank or r[3] >= index["parts"]:
                where = f"a location in tp block {tp_rank}, in one of the {index['parts']} parts"
                raise _Bad(f"[{name!r}][{i}]", r, where)

    _checked(list_of(LOCATION), rules, path)(rows)


def check_index(index: dict, index_path: Path) -> None:
    """Raise one CheckpointError naming ``index_path``, the field and what would be valid, unless ``index`` (a
    parsed object whose format and version are ours) has every field the load reads, of the format's types."""
    try:
        INDEX(index, "")
        _consistent(index)
    except _Bad as e:
        raise CheckpointError(f"{index_path}: {e} (a hand-edited or foreign index)") from None


def shard_path(step_dir: Path, file: str, index_path: Path) -> Path:
    """``step_dir / file``, refused unless it resolves inside ``step_dir``: an index naming ``../../elsewhere``
    (or an absolute path, or a symlink out) must not make a resume read another directory's files."""
    path = step_dir / file
    if not path.resolve().is_relative_to(step_dir.resolve()):
        raise CheckpointError(
            f"{index_path}: shard '{file}' resolves to {path.resolve()}, outside the checkpoint "
            f"directory {step_dir} (a hand-edited or foreign index)"
        )
    return path
