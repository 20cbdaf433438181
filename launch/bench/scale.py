"""Benchmark: the control plane at 8 ... 16,384 simulated ranks, run with the engine's own code (issue 43).

    python launch/bench/scale.py [--ranks 8 64 512 4096 16384] [--parts mesh,groups,shared,save,resume,...]

One process acts for every rank. Each part runs the engine's functions, not a model of them; what a part counts
is deterministic (requests, keys, bytes, files, look-ups, calls), what it times is CPU seconds (this machine is
shared: wall time means nothing here). The parts:

- ``mesh``: the rank arithmetic every rank runs to list every group of every kind (the four axes, mp, embed, ep and
  expert-dp: engine/parallel/layout/mesh.py), as split_group needs them under NCCL; CPU and peak Python memory.
- ``groups``: ParallelContext (engine/parallel/layout/context.py) built for rank 0 of a world of N in torch's
  "fake" backend (a real process group of N ranks in one process, no peers): the ``new_group`` calls it makes
  (its own groups; DeviceMesh's own per-subgroup calls counted apart), and the CPU it takes.
- ``shared``: the shared-directory check (engine/cluster/shared.py) of N ranks, 8 per host, on a scratch folder
  (train.out_dir and checkpoint.dir), all ranks' steps over one in-process store (engine/cluster/exchange.py
  ``lockstep``): files written, file-system look-ups, store requests, keys and bytes.
- ``save``: a save's metadata (engine/checkpoint/checkpointer.py: each rank writes its part of the index and sends
  its plan, the ranges it holds, to rank 0 through the store; ``merge_index``, the locator and index.json written;
  the verdict back) on synthetic per-rank piece lists of an 8B model (32 layers, hidden 4,096, tp 8, pp up to 8,
  ZeRO over dp) with each rank's RNG state, as a save writes them (fsync skipped: a scratch folder).
- ``resume``: the last rank's ``read_index`` of that checkpoint (N empty shard files on the scratch folder) with its
  share of the shards and parts to check, and then the location of every piece it holds (``Reader.pieces``), as a
  resume makes them: CPU, peak memory, files opened, bytes read and file-system look-ups.
- the store parts of ``launch/bench/scale_store.py`` when it is present (start-up, heartbeat: a real TCPStore in
  another process): its ``PARTS`` dict, or its ``measure*`` functions, each ``fn(n) -> {column: value}``.

Columns (a part fills those it measures): ``req/rank`` store requests of the busiest rank other than rank 0 (the
coordinator), ``req/r0`` rank 0's, ``req/job`` all ranks'; ``keys`` the most keys the store held at once; ``B/rank``,
``B/r0``, ``B/job`` the bytes sent and received the same way; ``files`` files opened (written: the tokens);
``look/rank``, ``look/job`` file-system look-ups (``os.stat`` calls); ``groups/rank`` process groups a rank
creates; ``store_cpu_s`` the store server's CPU seconds (store parts); ``cpu_s/rank`` CPU seconds of the busiest
rank; ``MB/rank`` its peak Python memory (tracemalloc).
docs/benchmarks.md says how to read it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import tracemalloc
import unittest.mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from engine.checkpoint.format import (  # noqa: E402
    INDEX,
    LOCATOR,
    Reader,
    merge_index,
    part_name,
    read_index,
    shard_name,
    write_part,
)
from engine.cluster import shared  # noqa: E402
from engine.cluster.exchange import StoreExchange, lockstep  # noqa: E402
from engine.parallel.layout.checks import Layout  # noqa: E402
from engine.parallel.layout.mesh import DATA_AXES, MODEL_PARALLEL, Mesh  # noqa: E402

SIZES = (8, 64, 512, 4096, 16384)
PER_HOST = 8
COLUMNS = (
    "req/rank",
    "req/r0",
    "req/job",
    "keys",
    "B/rank",
    "B/r0",
    "B/job",
    "files",
    "look/rank",
    "look/job",
    "groups/rank",
    "store_cpu_s",
    "cpu_s/rank",
    "MB/rank",
)


def layout_for(n: int) -> Layout:
    """The layout simulated at ``n`` ranks: tp 8 within a host, pp up to 8, the rest dp; ep 8 (2 at 8 ranks)."""
    tp, pp = (2, 2) if n == 8 else (8, min(8, max(1, n // 64)))
    dp = n // (tp * pp)
    return Layout(tp=tp, pp=pp, dp=dp, ep=min(8, dp))


# ---- counting ---------------------------------------------------------------------------------------------------
class Tally:
    """Per simulated rank: store requests and bytes, look-ups, files, CPU; the store's live keys."""

    def __init__(self, world: int):
        self.requests, self.bytes = [0] * world, [0] * world
        self.lookups, self.files, self.cpu = [0] * world, [0] * world, [0.0] * world
        self.read = [0] * world  # bytes read from the files opened
        self.live: set[str] = set()
        self.peak_keys, self.rank = 0, 0

    def row(self) -> dict:
        rest = slice(1, None) if len(self.requests) > 1 else slice(0, 1)
        return {
            "req/rank": max(self.requests[rest]),
            "req/r0": self.requests[0],
            "req/job": sum(self.requests),
            "keys": self.peak_keys,
            "B/rank": max(self.bytes[rest]),
            "B/r0": self.bytes[0],
            "B/job": sum(self.bytes),
            "files": sum(self.files),
            "look/rank": max(self.lookups),
            "look/job": sum(self.lookups),
            "cpu_s/rank": max(self.cpu),
        }


class CountingStore:
    """One simulated rank's client of a shared in-process store: counts its requests and the bytes they carry."""

    def __init__(self, store, tally: Tally, rank: int):
        self.store, self.tally, self.rank = store, tally, rank

    def _count(self, nbytes: int = 0, added=(), removed=()) -> None:
        self.tally.requests[self.rank] += 1
        self.tally.bytes[self.rank] += nbytes
        self.tally.live.update(added)
        self.tally.live.difference_update(removed)
        self.tally.peak_keys = max(self.tally.peak_keys, len(self.tally.live))

    def set(self, key, value):
        self._count(len(key) + len(value), added=[key])
        return self.store.set(key, value)

    def get(self, key):
        value = self.store.get(key)
        self._count(len(key) + len(value))
        return value

    def multi_get(self, keys):
        values = self.store.multi_get(keys)
        self._count(sum(map(len, keys)) + sum(map(len, values)))
        return values

    def wait(self, keys, timeout=None):
        self._count(sum(map(len, keys)))
        return self.store.wait(keys, timeout) if timeout is not None else self.store.wait(keys)

    def check(self, keys):
        self._count(sum(map(len, keys)))
        return self.store.check(keys)

    def add(self, key, amount):
        self._count(len(key) + 8, added=[key])
        return self.store.add(key, amount)

    def delete_key(self, key):
        self._count(len(key), removed=[key])
        return self.store.delete_key(key)


def counted(tally: Tally, rank: int, steps):
    """Rank ``rank``'s steps, each step's CPU seconds and stat/open calls counted to it."""
    while True:
        tally.rank, start = rank, time.process_time()
        try:
            kind = next(steps)
        except StopIteration as done:
            return done.value
        finally:
            tally.cpu[rank] += time.process_time() - start
        yield kind


@contextlib.contextmanager
def file_calls(tally: Tally):
    """Count ``os.stat`` (every look-up: Path.exists, is_file, stat, mkdir's check) and ``io.open`` (a file
    written or read) to the rank being run, passing each call on."""
    stat, opener = os.stat, io.open

    def counting_stat(*args, **kwargs):
        tally.lookups[tally.rank] += 1
        return stat(*args, **kwargs)

    def counting_open(*args, **kwargs):
        tally.files[tally.rank] += 1
        return _Reading(opener(*args, **kwargs), tally)

    os.stat, io.open = counting_stat, counting_open
    try:
        yield
    finally:
        os.stat, io.open = stat, opener


class _Reading:
    """A file opened under ``file_calls``: what ``read`` returns is counted to the rank being run."""

    def __init__(self, file, tally: Tally):
        self.file, self.tally = file, tally

    def read(self, *args):
        data = self.file.read(*args)
        self.tally.read[self.tally.rank] += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __iter__(self):
        return iter(self.file)

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)


def simulate(world: int, protocol) -> tuple[Tally, list]:
    """Run ``protocol(exchange, rank)`` (steps) for every rank in lockstep over one store; the tally and results."""
    tally, store = Tally(world), dist.HashStore()
    runs = [
        counted(tally, r, protocol(StoreExchange(CountingStore(store, tally, r), r, world, 60.0, "bench"), r))
        for r in range(world)
    ]
    with file_calls(tally):
        results = lockstep(runs)
    return tally, results


# ---- the parts ----------------------------------------------------------------------------------------------------
def measure_mesh(n: int) -> dict:
    layout = layout_for(n)
    mesh = Mesh(layout.axes)
    tracemalloc.start()
    start = time.process_time()
    lists = [mesh.groups_spanning((axis,)) for axis in mesh.names]
    lists += [mesh.groups_spanning(MODEL_PARALLEL), mesh.ends_along("pp"), *mesh.split_groups(DATA_AXES, layout.ep)]
    cpu = time.process_time() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"cpu_s/rank": cpu, "MB/rank": peak / 2**20, "note": f"{sum(map(len, lists))} groups listed"}


def measure_groups(n: int) -> dict:
    """Rank 0 of a fake world of n: ParallelContext's own new_group calls, and DeviceMesh's beside them."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from engine.parallel.layout.context import ParallelContext

    layout = layout_for(n)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        calls, original = [], dist.new_group
        names, sizes = zip(*layout.axes)
        start = time.process_time()
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        dist.new_group = lambda ranks=None, *a, **k: calls.append(ranks) or original(ranks, *a, **k)
        try:
            ParallelContext(layout, mesh, torch.device("cpu"), "gloo")
        finally:
            dist.new_group = original
        cpu = time.process_time() - start
    finally:
        dist.destroy_process_group()
    held = sum(1 for ranks in calls if 0 in ranks)
    note = f"{layout.axes}; new_group calls of its own: {len(calls)} ({held} holding the rank)"
    return {"groups/rank": len(calls), "cpu_s/rank": cpu, "note": note}


def measure_shared(n: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        directories = [(Path(scratch, "out"), "train.out_dir"), (Path(scratch, "ckpt"), "checkpoint.dir")]
        tally, results = simulate(
            n, lambda ex, r: shared.shared_steps(directories, "bench", ex, f"host{r // PER_HOST:05d}")
        )
    assert all(error is None for _, error in results), results[0]
    return {**tally.row(), "note": f"{-(-n // PER_HOST)} hosts, 2 directories"}


def synthetic_meta(rank: int, layout: Layout) -> dict:
    """Rank ``rank``'s index entry as a save makes it (engine/checkpoint/contents.py): its RNG states and its piece
    of every parameter and Adam moment of its stage, for an 8B model (Llama 3 8B's shapes), ZeRO over dp."""
    mesh, hidden, layers = Mesh(layout.axes), 4096, 32
    at = mesh.coords(rank)
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    shapes = {"qkv": ([6144, hidden], 0), "o": ([hidden, hidden], 1), "gate_up": ([28672, hidden], 0)}
    shapes |= {"down": ([hidden, 14336], 1), "input_norm": ([hidden], None), "post_norm": ([hidden], None)}
    params = {}
    for layer in range(at["pp"] * layers // pp, (at["pp"] + 1) * layers // pp):
        for part, (shape, tp_dim) in shapes.items():
            block = shape[0] * (shape[1] if len(shape) > 1 else 1) // (tp if tp_dim is not None else 1)
            start, end = block * at["dp"] // dp, block * (at["dp"] + 1) // dp
            piece = [[at["tp"] if tp_dim is not None else 0, start, end]]
            params[f"model.layers.{layer}.{part}.weight"] = {
                "shape": shape,
                "tp_dim": tp_dim,
                "tp_size": tp if tp_dim is not None else 1,
                "states": {s: piece for s in ("param", "exp_avg", "exp_avg_sq")},
            }
    rng = {"python": [3, list(range(rank, rank + 625)), None], "numpy": ["MT19937", 624, 0, 0.0]}
    return {"rank": rank, "file": shard_name(rank), "coords": at, "rng": rng, "params": params, "adam_step": 1}


def _header(layout: Layout, n: int) -> dict:
    model = {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "vocab_size": 128256}
    return {
        "step": 1,
        "consumed_samples": 0,
        "model_only": False,
        "config": {"model": model},
        "layout": {"world_size": n, **dict(layout.axes)},
    }


def measure_save(n: int, folder: Path | None = None) -> dict:
    """The save's metadata, as checkpointer.py makes it: each rank writes its part of the index and sends its plan
    to rank 0, which merges the plans and writes the locator and index.json (into ``folder`` if given)."""
    layout = layout_for(n)

    def protocol(exchange, rank, parts: Path):
        meta = {**synthetic_meta(rank, layout), "bytes": 0, "crc32": 0}
        plan = write_part(parts, rank, meta)
        yield "gather"
        plans = exchange.gather(plan)
        if rank == 0:
            steps = [m.pop("adam_step") for m in plans]
            index, locator = merge_index(plans, {**_header(layout, n), "adam_step": max(steps)})
            for name, text in {**locator, INDEX: json.dumps(index)}.items():
                (parts / name).write_text(text)
        yield "gather"
        exchange.gather(None)
        yield "broadcast"
        return exchange.broadcast(None)

    # The scratch folder is not a checkpoint: its durability is not measured (an fsync per part is disk wait, not
    # CPU, and made 16,384 parts take minutes of wall time on this machine's disk)
    with tempfile.TemporaryDirectory() as scratch, unittest.mock.patch("os.fsync"):
        tally, _ = simulate(n, lambda exchange, rank: protocol(exchange, rank, Path(folder or scratch)))
        part = (Path(folder or scratch) / part_name(min(1, n - 1))).stat().st_size
    return {**tally.row(), "files": max(tally.files[1:] or tally.files), "note": f"{part / 1024:.1f} KB per part"}


def locate_held(reader: Reader, held: dict) -> list[list]:
    """Where the pieces of every parameter state a rank holds (``held``: its entry's params) lie, as Reader.read
    finds them in a load: [(file, start, end), ...] per piece."""
    return [
        reader.pieces(name, state, *piece)
        for name, p in held.items()
        for state, pieces in p["states"].items()
        for piece in pieces
    ]


def measure_resume(n: int) -> dict:
    """The last rank's resume at the layout that saved: ``read_index`` with its share of the shards (as
    checkpointer.py's _validate) and the pieces of everything it holds located (as Reader.read does in load_into):
    files opened, bytes read, look-ups, CPU and peak memory."""
    with tempfile.TemporaryDirectory() as scratch:
        folder, rank = Path(scratch), n - 1
        for r in range(n):
            (folder / shard_name(r)).touch()
        measure_save(n, folder)
        held = synthetic_meta(rank, layout_for(n))["params"]
        tally = Tally(1)
        tracemalloc.start()
        start = time.process_time()
        with file_calls(tally):
            index = read_index(folder, share=(rank, n))
            reader = Reader(folder, index)
            found = locate_held(reader, held)
            reader.close()
        cpu, peak = time.process_time() - start, tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        sizes = [(folder / name).stat().st_size for name in (INDEX, LOCATOR)]
    assert all(found), "a piece held was not located"
    row = {"cpu_s/rank": cpu, "MB/rank": peak / 2**20, "look/rank": tally.lookups[0], "look/job": tally.lookups[0] * n}
    note = f"index.json {sizes[0] / 1024:.0f} KB, locator.jsonl {sizes[1] / 2**20:.1f} MB"
    return {**row, "files": tally.files[0], "read_KB/rank": tally.read[0] / 1024, "note": note}


PARTS = {
    "mesh": measure_mesh,
    "groups": measure_groups,
    "shared": measure_shared,
    "save": measure_save,
    "resume": measure_resume,
}


def _store_parts() -> dict:
    """The store parts of launch/bench/scale_store.py (start-up, heartbeat), when that file is present."""
    try:
        from launch.bench import scale_store
    except ImportError:
        return {}
    found = getattr(scale_store, "PARTS", None)
    if isinstance(found, dict):
        return dict(found)
    return {
        name.removeprefix("measure_") or name: fn
        for name, fn in vars(scale_store).items()
        if name.startswith("measure") and callable(fn)
    }


def _launch_parts() -> dict:
    """Preflight's plan (N ranks as N / 8 hosts of 8), the data readers' corpus scans (N readers) and the layout
    search (N devices) of launch/bench/scale_parts.py, when that file is present."""
    try:
        from launch.bench import scale_parts
    except ImportError:
        return {}
    return {
        "preflight": lambda n: scale_parts.measure_preflight(n // scale_parts.SLOTS),
        "data": scale_parts.measure_data,
        "search": scale_parts.measure_search,
    }


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def main(argv: list[str] | None = None) -> int:
    parts = {**PARTS, **_store_parts(), **_launch_parts()}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=list(SIZES), metavar="N")
    ap.add_argument("--parts", default=",".join(parts), help=f"comma-separated, of: {', '.join(parts)}")
    args = ap.parse_args(argv)
    chosen = [p for p in args.parts.split(",") if p]
    unknown = [p for p in chosen if p not in parts]
    bad = [n for n in args.ranks if n < 8 or n % 8]
    if unknown or bad:
        what = f"--parts {', '.join(unknown)}" if unknown else f"--ranks {', '.join(map(str, bad))}"
        valid = f"valid: {', '.join(parts)}" if unknown else "valid: multiples of 8, at least 8"
        print(f"error: {what} is not valid ({valid})", file=sys.stderr)
        return 2
    print("| part | N | " + " | ".join(COLUMNS) + " | note |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for part in chosen:
        for n in args.ranks:
            row = parts[part](n)
            cells = [_cell(row.get(c)) for c in COLUMNS]
            extra = [f"{k} {_cell(v)}" for k, v in row.items() if k not in COLUMNS and k != "note"]
            note = "; ".join(([row["note"]] if "note" in row else []) + extra)
            print(f"| {part} | {n:,} | " + " | ".join(cells) + f" | {note} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
