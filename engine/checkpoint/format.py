"""The on-disk checkpoint format: one safetensors shard per rank holding flat pieces, and an index placing them.

Why our own format and not torch.distributed.checkpoint (DCP): DCP reshards DTensor state dicts, but ZeRO-1/2/3
keep parameters and Adam moments in DeepSpeed's flat fp32 partitions, which are not DTensors, and a change of
dp_mode (ddp <-> fsdp <-> zero) changes what the state dict even is. Every layout, however, holds each parameter
as the same two-level cut, which this format records directly:
  1. tensor parallel picks a *tp block* of the global tensor: ``full.chunk(tp_size, tp_dim)[tp_rank]``;
  2. data parallel keeps a flat range ``[start, end)`` of that block, flattened row-major: all of it (ddp), a row
     range (FSDP2 Shard(0)), or any flat fragment (ZeRO-1/2 partitions, ZeRO-3 per-parameter partitions).
A *piece* is such a range of one state (``param``, ``exp_avg``, ``exp_avg_sq``) stored as a 1-D fp32 tensor under
the key ``name/state/tp{tp_rank}/{start}``. ``Reader.read`` rebuilds any other cut (another tp size, another flat
range) from the overlapping pieces only, reading just the needed bytes with safetensors' ``get_slice``.

Directory of one checkpoint (version 2, issue 43): metadata in three levels, so that a rank reads in proportion to
what it loads, never every rank's entry:
- ``rank_NNNNN.safetensors``: the rank's shard; ``part_NNNNN.json`` (PART, written and fsynced by the rank itself):
  its shard's file name, byte size and CRC-32, its RNG state and coordinates, and its pieces
  (``params: {name: {states: {state: [[tp_rank, start, end], ...]}}}``);
- ``locator.jsonl`` (LOCATOR, rank 0): one line per tp block of each parameter, ``[[tp_rank, start, end, part],
  ...]``, sorted: which part holds which range of it (the ranges of a rank's states merged), from the small plans the
  ranks send (``write_part``'s return, through the store: DCP's coordinator plans, not the pieces);
- ``index.json`` (INDEX, written last, by rank 0: the commit): format/version, step, data position, Adam step, the
  config and layout that wrote it, the number of parts, and per parameter its global shape, tp cut, states and the
  byte ranges ``where`` of its locator lines, one per tp block.
A resume reads index.json (its size: the model's parameter count, not the ranks'), seeks to the locator lines of
the parameters it holds, and opens only the parts (and shards) holding ranges it needs; validation checks each
rank's share of the parts and locator lines (``read_index``'s ``share``). Version 1 (one index.json with every
rank's pieces under ``params``, ``files`` and ``ranks``) is still read: ``read_index`` and ``Reader`` take both.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.checkpoint.schema import check_index, check_locator, check_part, check_top, shard_path
from engine.errors import CheckpointError  # defined there (torch-free); most modules import it from here
from engine.json_input import load_object

FORMAT, VERSION = "engine-checkpoint", 2
INDEX, LOCATOR = "index.json", "locator.jsonl"
# The process umask, read once at import (in the main thread: os.umask can only be read by setting it).
_UMASK = os.umask(0o022)
os.umask(_UMASK)
MODEL_SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_embeddings",
    "attention_bias",
)


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def part_name(number: int) -> str:
    return f"part_{number:05d}.json"


def piece_key(name: str, state: str, tp_rank: int, start: int) -> str:
    return f"{name}/{state}/tp{tp_rank}/{start}"


def fsync_write(path: Path, text: str) -> None:
    """Write text durably (the rename that publishes it must not expose an empty file after a crash)."""
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def file_crc32(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file with the mode every other file gets (0666 & ~umask): safetensors creates its file
    mode 0600, so the users who can read index.json or an export's config.json (a group on a shared file system)
    could not read the weights beside it."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_UMASK)


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Save one rank's pieces (CPU tensors that share no storage) and fsync; returns {"bytes", "crc32"}."""
    save_safetensors(tensors, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "crc32": file_crc32(path)}


def write_part(folder: Path, number: int, meta: dict) -> dict:
    """A rank's part of the index, written durably by the rank beside its shard: ``meta`` is its entry (``rank``,
    ``file``, ``bytes``, ``crc32``, ``params: {name: {shape, tp_dim, tp_size, states: {state: [[tp, start, end],
    ...]}}}``, optionally ``coords``, ``rng``, ``adam_step``). Returns its plan for rank 0 (``merge_index``): the
    part's number, Adam's step, and per parameter its cut, states and the ranges held (states merged): no pieces,
    no RNG state (a plan is ~1/4 of the entry)."""
    entry = {k: v for k, v in meta.items() if k not in ("params", "adam_step")}
    entry["params"] = {name: {"states": p["states"]} for name, p in meta["params"].items()}
    fsync_write(folder / part_name(number), json.dumps(entry))
    plan = {}
    for name, p in meta["params"].items():
        rows = sorted({tuple(piece) for pieces in p["states"].values() for piece in pieces})
        plan[name] = {**{k: p[k] for k in ("shape", "tp_dim", "tp_size")}, "states": list(p["states"]), "rows": rows}
    return {"part": number, "adam_step": meta.get("adam_step"), "params": plan}


def merge_index(plans: list[dict], header: dict) -> tuple[dict, dict[str, str]]:
    """rank 0: the top-level index and the locator (``{LOCATOR: text}``, for publish to write before the index) from
    every part's plan; a parameter's shape and tp cut must agree."""
    params: dict[str, dict] = {}
    rows: dict[str, list] = {}
    for plan in sorted(plans, key=lambda plan: plan["part"]):
        for name, p in plan["params"].items():
            entry = params.setdefault(name, {k: p[k] for k in ("shape", "tp_dim", "tp_size")} | {"states": []})
            if (entry["shape"], entry["tp_dim"], entry["tp_size"]) != (p["shape"], p["tp_dim"], p["tp_size"]):
                raise RuntimeError(f"ranks disagree on the layout of {name}: {entry} vs {p}")  # a bug, not input
            entry["states"] += [state for state in p["states"] if state not in entry["states"]]
            rows.setdefault(name, []).extend([*row, plan["part"]] for row in p["rows"])
    lines, offset = [], 0
    for name, entry in params.items():
        entry["where"] = []
        for tp in range(entry["tp_size"]):  # a line per tp block: a rank reads the rows of the blocks it needs
            line = json.dumps(sorted(row for row in rows[name] if row[0] == tp)) + "\n"
            entry["where"].append([offset, len(line)])  # ASCII: characters are bytes
            lines.append(line)
            offset += len(line)
    top = {"format": FORMAT, "version": VERSION, **header, "parts": len(plans), "locator_bytes": offset}
    return {**top, "params": params}, {LOCATOR: "".join(lines)}


def read_index(path: Path, share: tuple[int, int] | None = None) -> dict:
    """Parse ``path/index.json``, check its fields (engine/checkpoint/schema.py) and that every shard of ``share``
    lies in ``path`` and exists with its recorded size; ``share`` = (rank, world): only the shards (and, version 2,
    the parts and locator lines) whose position is rank modulo world (each rank of a collective its own, as the CRC
    checks are shared: O(N / world) file-system operations per rank). ``index["_share"]`` lists the shard files
    checked, ``index["files"]`` holds their size and CRC (version 1: every shard's). Anything unreadable
    (permissions, a directory in a file's place) is a CheckpointError naming the file, as a corrupt index is:
    ``resume: auto`` then tries an older step."""
    index_path = path / INDEX
    try:
        return _read_index(path, index_path, share or (0, 1))
    except OSError as e:
        raise CheckpointError(f"cannot read {e.filename or index_path} ({e.strerror or e})") from None


def _load_json(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing (an incomplete or foreign checkpoint)")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not UTF-8 text (byte {e.start}): a damaged file") from None
    return load_object(text, str(file), CheckpointError)  # not JSON, a 5000-digit integer: one line


def _read_index(path: Path, index_path: Path, share: tuple[int, int]) -> dict:
    index = _load_json(index_path)
    if index.get("format") != FORMAT or index.get("version") not in (1, VERSION):
        raise CheckpointError(f"{index_path} is not an {FORMAT} v1 or v{VERSION} index")
    rank, world = share
    if index["version"] == 1:
        check_index(index, index_path)
        index["_share"] = [f for i, f in enumerate(sorted(index["files"])) if i % world == rank]
    else:
        check_top(index, index_path)
        _check_size(path / LOCATOR, index["locator_bytes"], index_path, what="")
        index["files"], index["_parts"], index["_share"] = {}, {}, []
        for number in range(rank, index["parts"], world):
            index["_share"].append(load_part(path, index, number)["file"])
        blocks = [(name, tp) for name, p in index["params"].items() for tp in range(p["tp_size"])]
        if blocks[rank::world]:
            with (path / LOCATOR).open("rb") as locator:
                for name, tp in blocks[rank::world]:
                    locate(locator, index, name, tp, path)
    for file in index["_share"]:
        info = index["files"][file]
        listed_in = path / part_name(info["part"]) if "part" in info else index_path
        _check_size(shard_path(path, file, listed_in), info["bytes"], listed_in)
    return index


def _check_size(file: Path, size: int, listed_in: Path, what: str = "shard ") -> None:
    if not file.is_file():
        raise CheckpointError(f"{what}{file} listed in {listed_in} is missing")
    if file.stat().st_size != size:
        raise CheckpointError(
            f"{what}{file} has {file.stat().st_size} bytes, {listed_in} records {size} (truncated or overwritten)"
        )


def load_part(path: Path, index: dict, number: int) -> dict:
    """Part ``number`` of a version-2 checkpoint, read once and checked against the index (``index["_parts"]``
    keeps it; ``index["files"]`` gets its shard's size and CRC)."""
    if number not in index["_parts"]:
        file = path / part_name(number)
        part = _load_json(file)
        check_part(part, index, file)
        shard_path(path, part["file"], file)
        index["_parts"][number] = part
        index["files"][part["file"]] = {"bytes": part["bytes"], "crc32": part["crc32"], "part": number}
    return index["_parts"][number]


def locate(locator, index: dict, name: str, tp_rank: int, path: Path) -> list[list[int]]:
    """The locator rows ``[tp_rank, start, end, part]`` of tp block ``tp_rank`` of parameter ``name`` (version 2)
    from ``locator``, the open ``path / LOCATOR``: one seek and one read of its line, checked against the index."""
    offset, length = index["params"][name]["where"][tp_rank]
    locator.seek(offset)
    data = locator.read(length)
    try:
        rows = json.loads(data)
    except ValueError:
        raise CheckpointError(
            f"{path / LOCATOR}: the line of {name} at byte {offset} is not JSON (a damaged file)"
        ) from None
    check_locator(rows, index, name, tp_rank, path / LOCATOR)
    return rows


def rank_entry(path: Path, index: dict, rank: int) -> dict:
    """Rank ``rank``'s entry (its shard ``file`` and ``rng``), or {} when the checkpoint has no such rank."""
    if index["version"] == 1:
        return index["ranks"][rank] if rank < len(index["ranks"]) else {}
    return load_part(path, index, rank) if rank < index["parts"] else {}


def _expected(index: dict, file: str) -> dict[str, int]:
    """{piece key: elements} of every piece the index places in shard ``file``."""
    if index["version"] == 1:
        return {
            piece_key(name, state, tp, s): e - s
            for name, p in index["params"].items()
            for state, pieces in p["states"].items()
            for f, tp, s, e in pieces
            if f == file
        }
    part = index["_parts"][index["files"][file]["part"]]
    return {
        piece_key(name, state, tp, s): e - s
        for name, p in part["params"].items()
        for state, pieces in p["states"].items()
        for tp, s, e in pieces
    }


def verify_shard(path: Path, index: dict, file: str) -> None:
    """Check one shard's CRC-32, that its header holds every piece the index places in it, with that length, and
    that every piece is finite: NaN/inf weights or moments pass a CRC (the save refuses them, but a hand-made or
    older checkpoint may hold them) and would be resumed as garbage."""
    shard = path / file
    try:
        crc = file_crc32(shard)
    except OSError as e:
        raise CheckpointError(f"shard {shard} cannot be read ({e.strerror or e})") from None
    if crc != index["files"][file]["crc32"]:
        raise CheckpointError(f"shard {shard} fails its CRC-32 check (corrupt)")
    expected, info = _expected(index, file), index["files"][file]
    recorded = path / (part_name(info["part"]) if "part" in info else INDEX)
    try:
        with safe_open(str(shard), framework="pt") as f:
            keys = set(f.keys())
            for key, numel in expected.items():
                if key not in keys or f.get_slice(key).get_shape() != [numel]:
                    raise CheckpointError(
                        f"shard {shard} does not hold piece '{key}' of {numel} elements recorded in {recorded}"
                    )
                if not _finite(f.get_slice(key), numel):
                    name, state = key.split("/")[:2]
                    raise CheckpointError(
                        f"shard {shard} holds NaN/inf values in {name} ({state}) of step "
                        f"{index['step']}: resuming it would train on garbage"
                    )
    except CheckpointError:
        raise
    except Exception as e:  # a header safetensors cannot parse
        raise CheckpointError(f"shard {shard} is not a readable safetensors file ({e})") from None


def _finite(piece, numel: int, chunk: int = 1 << 24) -> bool:
    """No NaN/inf in a piece, read a chunk (64 MB of fp32) at a time: memory stays bounded whatever its size."""
    return all(torch.isfinite(piece[a : a + chunk]).all() for a in range(0, numel, chunk))


def _as_2d(shape: list[int]) -> tuple[int, int]:
    """Rows and row length of a parameter (1-D: one row per element, so a flat range is a row range)."""
    if len(shape) == 1:
        return shape[0], 1
    rows = shape[0]
    return rows, (torch.Size(shape).numel() // rows if rows else 0)


def tp_box(shape: list[int], tp_dim: int | None, tp_size: int, tp_rank: int) -> tuple[int, int, int, int]:
    """(row0, row1, col0, col1) of a tp block in the (rows, row length) view of the global tensor."""
    rows, cols = _as_2d(shape)
    if tp_dim is None or tp_size == 1:
        return 0, rows, 0, cols
    if tp_dim == 0:
        n = rows // tp_size
        return tp_rank * n, (tp_rank + 1) * n, 0, cols
    if tp_dim == 1 and len(shape) == 2:
        n = cols // tp_size
        return 0, rows, tp_rank * n, (tp_rank + 1) * n
    raise CheckpointError(f"tp_dim={tp_dim} of a {len(shape)}-D parameter is not supported")


class Reader:
    """Reads any cut of any parameter state of one checkpoint directory from the pieces that overlap it."""

    def __init__(self, path: Path, index: dict):
        self.path, self.index, self.params = path, index, index["params"]
        self._files: dict[str, object] = {}
        self._rows: dict[tuple[str, int], list] = {}  # version 2: the locator rows of each tp block read so far
        self._locator = None  # version 2: locator.jsonl, opened at the first parameter located

    def close(self) -> None:
        self._files.clear()  # safe_open handles release their memory maps when dropped
        if self._locator is not None:
            self._locator.close()
            self._locator = None

    def _open(self, file: str):
        if file not in self._files:
            self._files[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
        return self._files[file]

    def states(self, name: str) -> list[str]:
        return list(self._param(name)["states"])  # version 1: the pieces by state; 2: the states' names

    def pieces(self, name: str, state: str, tp_rank: int, a: int, b: int) -> list[tuple[str, int, int]]:
        """(file, start, end) of the pieces of ``name``'s ``state`` in tp block ``tp_rank`` overlapping [a, b):
        version 2 opens only the parts whose locator rows overlap it."""
        if self.index["version"] == 1:
            return [(f, s, e) for f, tp, s, e in self._param(name)["states"].get(state, []) if tp == tp_rank]
        if (name, tp_rank) not in self._rows:
            if self._locator is None:
                self._locator = (self.path / LOCATOR).open("rb")
            self._rows[name, tp_rank] = locate(self._locator, self.index, name, tp_rank, self.path)
        numbers = dict.fromkeys(n for _, s, e, n in self._rows[name, tp_rank] if s < b and a < e)
        found = []
        for number in numbers:
            part = load_part(self.path, self.index, number)
            pieces = part["params"].get(name, {}).get("states", {}).get(state, [])
            found += [(part["file"], s, e) for tp, s, e in pieces if tp == tp_rank]
        return found

    def _param(self, name: str) -> dict:
        if name not in self.params:
            raise CheckpointError(f"{self.path / INDEX} has no parameter '{name}' (a different model?)")
        return self.params[name]

    def _flat(self, name: str, state: str, tp_rank: int, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the flattened tp block ``tp_rank`` (of the writer's tp size): (b - a,) fp32."""
        out = torch.empty(b - a, dtype=torch.float32)
        covered = 0
        for file, s, e in self.pieces(name, state, tp_rank, a, b):
            lo, hi = max(a, s), min(b, e)
            if lo >= hi:
                continue
            try:
                piece = self._open(file).get_slice(piece_key(name, state, tp_rank, s))[lo - s : hi - s]
            except Exception as err:
                raise CheckpointError(
                    f"shard {self.path / file}: cannot read piece of {name} {state} ({err})"
                ) from None
            if piece.numel() != hi - lo:  # a shard rewritten with a shorter piece, read without verify_shard
                raise CheckpointError(
                    f"shard {self.path / file}: piece of {name} {state} holds {piece.numel()} of the "
                    f"{hi - lo} elements [{lo}, {hi}) that {INDEX} places there"
                )
            out[lo - a : hi - a] = piece
            covered += hi - lo
        if covered != b - a:
            raise CheckpointError(
                f"{self.path / INDEX}: {name} {state} elements [{a}, {b}) of tp block "
                f"{tp_rank} are covered {covered} times over {b - a} (a missing shard?)"
            )
        return out

    def read(
        self, name: str, state: str, tp_dim: int | None, tp_size: int, tp_rank: int, start: int, end: int
    ) -> torch.Tensor:
        """Elements [start, end) of the flattened tp block (tp_dim, tp_size, tp_rank) of ``name``'s ``state``:
        a (end - start,) fp32 tensor, assembled from the writer's tp blocks that overlap it."""
        meta = self._param(name)
        shape = meta["shape"]
        if end <= start:
            return torch.empty(0, dtype=torch.float32)
        r0, _, c0, c1 = tp_box(shape, tp_dim, tp_size, tp_rank)
        width = c1 - c0
        ra, rb = start // width, -(-end // width)  # block rows touched by the flat range
        out = torch.empty(rb - ra, width, dtype=torch.float32)  # (rows, width) of this block
        want_r0, want_r1 = r0 + ra, r0 + rb  # the same rows in global coordinates
        for q in range(meta["tp_size"]):
            q_r0, q_r1, q_c0, q_c1 = tp_box(shape, meta["tp_dim"], meta["tp_size"], q)
            rows = max(want_r0, q_r0), min(want_r1, q_r1)
            cols = max(c0, q_c0), min(c1, q_c1)
            if rows[0] >= rows[1] or cols[0] >= cols[1]:
                continue
            q_width = q_c1 - q_c0
            i0, i1 = rows[0] - q_r0, rows[1] - q_r0
            block = self._flat(name, state, q, i0 * q_width, i1 * q_width).view(i1 - i0, q_width)
            out[rows[0] - want_r0 : rows[1] - want_r0, cols[0] - c0 : cols[1] - c0] = block[
                :, cols[0] - q_c0 : cols[1] - q_c0
            ]
        return out.view(-1)[start - ra * width : end - ra * width]

    def full(self, name: str, state: str = "param") -> torch.Tensor:
        """The whole global tensor (export)."""
        shape = self._param(name)["shape"]
        numel = torch.Size(shape).numel()
        return self.read(name, state, None, 1, 0, 0, numel).view(shape)
