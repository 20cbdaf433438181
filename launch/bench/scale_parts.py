"""Three parts of the scale benchmark (issue 43): preflight's plan, data start-up and the layout search, at a given
size.

    python launch/bench/scale_parts.py [--hosts 8 64 512 2048] [--readers 8 64 512 4096] [--devices 8 64 ...]

``measure_preflight(hosts)``: the plan preflight runs at that many hosts of 8 ranks (engine/cluster/linktest.py's
link_rounds, launch/preflight.py's plan): host-check waves at the default fan-out, link pairs and rounds (checked
disjoint), and the estimated seconds from the per-unit times preflight's --plan-only assumes; beside it the serial
plan used before. ``measure_data(readers)``: ``readers`` simulated data readers (one TrainData each, in this process,
one after another) open one synthetic indexed corpus; full reads of its .bin are counted as bytes reduced by max()
(the token-range scan) over its size. Before issue 43 every reader scanned it (full reads = readers).
``measure_search(devices)``: launch/plan.py's search (engine/planning/search.py, its table's 15 best, every
schedule searched) of Llama 3 8B on ``devices`` H100s of 80 GB: the valid layouts, those planned in full (memory),
those timed (step time simulated), and its CPU seconds. Before issue 43 every valid layout was planned and timed.
Counts, not times: the machine is shared (the search's CPU seconds are process time).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import struct
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.cluster.hostcheck import FANOUT  # noqa: E402
from engine.cluster.linktest import link_rounds  # noqa: E402
from engine.config import load  # noqa: E402
from engine.data import blend  # noqa: E402
from engine.planning.schedules import SEARCHED  # noqa: E402
from engine.planning.search import Hardware, search  # noqa: E402
from launch.preflight import plan  # noqa: E402

SLOTS, CHECK_S, ROUND_S = 8, 10.0, 0.06  # preflight --plan-only's defaults
SEARCH_CONFIG, SEARCH_TOP = "configs/llama-3-8b.yaml", 15  # launch/plan.py's --top default


def measure_preflight(hosts: int) -> dict:
    """Preflight's plan at ``hosts`` hosts x 8 ranks: waves, pairs, rounds, estimates (counts from the code)."""
    labels = [f"h{r // SLOTS}" for r in range(hosts * SLOTS)]
    rounds = link_rounds(labels)
    disjoint = all(len({x for p in r for x in p}) == 2 * len(r) for r in rounds)
    _, seconds = plan(hosts, SLOTS, FANOUT, CHECK_S, ROUND_S)
    n = hosts * SLOTS
    serial = n * (n - 1) // 2 if n <= 16 else hosts * (hosts - 1) // 2 + hosts * (SLOTS - 1)
    return {
        "hosts": hosts,
        "ranks": n,
        "fanout": FANOUT,
        "check_waves": -(-hosts // FANOUT),
        "link_pairs": sum(len(r) for r in rounds),
        "link_rounds": len(rounds),
        "max_pairs_per_round": max((len(r) for r in rounds), default=0),
        "rounds_disjoint": disjoint,
        "estimate_s": round(seconds, 1),
        "before_pairs": serial,
        "before_estimate_s": round(-(-hosts // 32) * CHECK_S + serial * ROUND_S, 1),
    }


def write_corpus(prefix: pathlib.Path, tokens: int, doc_len: int = 1000) -> str:
    """A Megatron indexed dataset (int32) of ``tokens`` token ids below 4,000, documents of ``doc_len``."""
    ids = (np.arange(tokens, dtype=np.int64) * 7919 % 4000).astype(np.int32)
    lengths = np.full(tokens // doc_len, doc_len, dtype=np.int32)
    lengths[-1] += tokens - int(lengths.sum())
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 4]).astype(np.int64)
    ids.tofile(f"{prefix}.bin")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(blend.INDEX_HEADER + struct.pack("<QBQQ", 1, 4, len(lengths), len(lengths) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    return str(prefix)


def measure_data(readers: int, tokens: int = 1 << 20) -> dict:
    """``readers`` data readers open one corpus of ``tokens`` int32 tokens: full reads of its .bin among them."""
    scanned = [0]
    real_max = np.memmap.max

    def counting_max(self, *args, **kwargs):
        if str(getattr(self, "filename", "") or "").endswith("corpus.bin"):
            scanned[0] += self.nbytes
        return real_max(self, *args, **kwargs)

    with tempfile.TemporaryDirectory() as folder:
        prefix = write_corpus(pathlib.Path(folder) / "corpus", tokens)
        spec = blend.DataSpec([prefix], [], 128, 1234, 4096, 0.01)
        np.memmap.max = counting_max
        try:
            for _ in range(readers):
                blend.TrainData(spec, None)
        finally:
            np.memmap.max = real_max
        size = pathlib.Path(f"{prefix}.bin").stat().st_size
    return {
        "readers": readers,
        "corpus_bytes": size,
        "full_reads": scanned[0] / size,
        "bytes_read_per_reader": scanned[0] / readers,
        "before_full_reads": readers,
    }


def measure_search(devices: int) -> dict:
    """launch/plan.py's search of SEARCH_CONFIG on ``devices`` H100s (80 GB): layouts valid, planned, timed; CPU."""
    cfg = load(["--config", str(ROOT / SEARCH_CONFIG)])
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, backend="nccl"))  # as plan.py
    counts: dict = {}
    start = time.process_time()
    best = search(cfg, devices, Hardware(), SEARCHED, top=SEARCH_TOP, counts=counts)
    return {
        "cpu_s/rank": time.process_time() - start,
        "note": f"{cfg.model.name}, gbs {cfg.train.global_batch_size}",
        **counts,
        "best_step_s": round(best[0].time.total, 3) if best else None,
        "before_planned": counts["valid"],
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[8, 64, 512, 2048])
    p.add_argument("--readers", type=int, nargs="+", default=[8, 64, 512, 4096])
    p.add_argument("--devices", type=int, nargs="+", default=[8, 64, 512, 4096, 16384])
    args = p.parse_args(argv)
    for h in args.hosts:
        print(measure_preflight(h), flush=True)
    for r in args.readers:
        print(measure_data(r), flush=True)
    for d in args.devices:
        print(measure_search(d), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
