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

Directory of one checkpoint: ``index.json`` (INDEX, written last, by rank 0) and ``rank_NNNNN.safetensors``.
``index.json`` holds: format/version, step, data position, Adam step, the config and layout that wrote it, every
parameter's global shape and tp cut with its pieces, each shard's byte size and CRC-32, and per-rank RNG state.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.checkpoint.schema import check_index, shard_path
from engine.errors import CheckpointError  # defined there (torch-free); most modules import it from here
from engine.json_input import load_object

FORMAT, VERSION = "engine-checkpoint", 1
INDEX = "index.json"
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


def piece_key(name: str, state: str, tp_rank: int, start: int) -> str:
    return f"{name}/{state}/tp{tp_rank}/{start}"


def fsync_write(path: Path, text: str) -> None:
    """Write text durably (the rename that publishes it must not expose an empty file after a crash)."""
    with open(path, "w") as f:
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


def merge_index(ranks: list[dict], header: dict) -> dict:
    """rank 0: join every rank's piece lists (``{"file", "params": {name: {shape, tp_dim, tp_size, states:
    {state: [[tp_rank, start, end], ...]}}}, ...}``) into one index; a parameter's shape and tp cut must agree."""
    params: dict[str, dict] = {}
    for r in ranks:
        for name, p in r.pop("params").items():
            entry = params.setdefault(
                name, {"shape": p["shape"], "tp_dim": p["tp_dim"], "tp_size": p["tp_size"], "states": {}}
            )
            if (entry["shape"], entry["tp_dim"], entry["tp_size"]) != (p["shape"], p["tp_dim"], p["tp_size"]):
                raise RuntimeError(f"ranks disagree on the layout of {name}: {entry} vs {p}")  # a bug, not input
            for state, pieces in p["states"].items():
                entry["states"].setdefault(state, []).extend([r["file"], *piece] for piece in pieces)
    files = {r["file"]: {"bytes": r.pop("bytes"), "crc32": r.pop("crc32")} for r in ranks}
    return {"format": FORMAT, "version": VERSION, **header, "files": files, "ranks": ranks, "params": params}


def read_index(path: Path, share: tuple[int, int] | None = None) -> dict:
    """Parse ``path/index.json``, check its fields (engine/checkpoint/schema.py) and that every shard it lists lies
    in ``path`` and exists with its recorded size; ``share`` = (rank, world): only the shards whose position in
    the sorted file list is rank modulo world (each rank of a collective its own, as the CRC checks are shared:
    O(N / world) file-system operations per rank, not every rank the N shards). Anything unreadable (permissions,
    a directory in a file's place) is a CheckpointError naming the file, as a corrupt index is: ``resume: auto``
    then tries an older step."""
    index_path = path / INDEX
    try:
        return _read_index(path, index_path, share)
    except OSError as e:
        raise CheckpointError(f"cannot read {e.filename or index_path} ({e.strerror or e})") from None


def _read_index(path: Path, index_path: Path, share: tuple[int, int] | None) -> dict:
    if not index_path.is_file():
        raise CheckpointError(f"{index_path} is missing (an incomplete or foreign checkpoint)")
    try:
        text = index_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{index_path} is not UTF-8 text (byte {e.start}): a damaged file") from None
    index = load_object(text, str(index_path), CheckpointError)  # not JSON, a 5000-digit integer: one line
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{index_path} is not an {FORMAT} v{VERSION} index")
    check_index(index, index_path)
    rank, world = share or (0, 1)
    for i, file in enumerate(sorted(index["files"])):
        if i % world != rank:
            continue
        info, shard = index["files"][file], shard_path(path, file, index_path)
        if not shard.is_file():
            raise CheckpointError(f"shard {shard} listed in {index_path} is missing")
        size = shard.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"shard {shard} has {size} bytes, {index_path} records {info['bytes']} (truncated or overwritten)"
            )
    return index


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
    expected = {
        piece_key(name, state, tp, s): e - s
        for name, p in index["params"].items()
        for state, pieces in p["states"].items()
        for f, tp, s, e in pieces
        if f == file
    }
    try:
        with safe_open(str(shard), framework="pt") as f:
            keys = set(f.keys())
            for key, numel in expected.items():
                if key not in keys or f.get_slice(key).get_shape() != [numel]:
                    raise CheckpointError(
                        f"shard {shard} does not hold piece '{key}' of {numel} elements recorded in {path / INDEX}"
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

    def close(self) -> None:
        self._files.clear()  # safe_open handles release their memory maps when dropped

    def _open(self, file: str):
        if file not in self._files:
            self._files[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
        return self._files[file]

    def states(self, name: str) -> list[str]:
        return list(self._param(name)["states"])

    def _param(self, name: str) -> dict:
        if name not in self.params:
            raise CheckpointError(f"{self.path / INDEX} has no parameter '{name}' (a different model?)")
        return self.params[name]

    def _flat(self, name: str, state: str, tp_rank: int, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the flattened tp block ``tp_rank`` (of the writer's tp size): (b - a,) fp32."""
        out = torch.empty(b - a, dtype=torch.float32)
        covered = 0
        for file, tp, s, e in self._param(name)["states"].get(state, []):
            lo, hi = max(a, s), min(b, e)
            if tp != tp_rank or lo >= hi:
                continue
            try:
                piece = self._open(file).get_slice(piece_key(name, state, tp, s))[lo - s : hi - s]
            except Exception as err:
                raise CheckpointError(
                    f"shard {self.path / file}: cannot read piece of {name} {state} ({err})"
                ) from None
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
