"""Benchmark: what the operation log (engine/trust/oplog.py, always on) costs a step.

    python launch/bench/oplog.py [--config configs/tiny.yaml] [--tp 2] [--pp 2] [--dp 1] [--steps 10] [--repeats 3]

``--tp`` x ``--pp`` x ``--dp`` forked gloo ranks build one Trainer and run blocks of ``--steps`` steps with the log
on and off (``oplog.begin`` / ``oplog.end`` swapped for functions that do nothing, so "off" still pays the two
calls: what the ring itself costs), alternating ``--repeats`` times so drift in machine load hits both alike.
Printed: the median step time of each and the ratio to off; the operations logged per step; and the cost of one
begin + end pair alone (a million of them timed in a loop), times the operations per step, against the step: the
share of the step the log can cost at most, which a ratio on a loaded machine cannot resolve below ~1 %.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine.trust.oplog as oplog  # noqa: E402
from engine.config import load  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.trainer import Trainer  # noqa: E402

REAL = (oplog.begin, oplog.end)


def _begin_off(kind, group, what, nbytes=0, peer=-1) -> int:
    return 0


def _end_off(i) -> None:
    return None


def pair_ns(count: int = 1_000_000) -> float:
    """Nanoseconds of one begin + end on a private ring, less the loop's own cost."""
    log = oplog.OpLog()
    start = time.perf_counter()
    for _ in range(count):
        log.end(log.begin("all-reduce", None, "layer", 4))
    spent = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(count):
        pass
    return (spent - (time.perf_counter() - start)) / count * 1e9


def measure(argv: list[str], steps: int, repeats: int) -> dict:
    """One rank: step times with the log on and off, and the operations it logged per step."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    trainer.train_step(trainer.next_local_batch())  # warm-up
    times: dict[str, list[float]] = {"on": [], "off": []}
    ops = []
    for _ in range(repeats):
        for name in ("off", "on"):
            oplog.begin, oplog.end = REAL if name == "on" else (_begin_off, _end_off)
            for _ in range(steps):
                before, start = oplog.LOG.n, time.perf_counter()
                trainer.train_step(trainer.next_local_batch())
                times[name].append(time.perf_counter() - start)
                if name == "on":
                    ops.append(oplog.LOG.n - before)
    oplog.begin, oplog.end = REAL
    return {"times": times, "ops": max(ops)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        argv = ["--config", args.config, "--train.out_dir", out, "--log.progress", "false"]
        argv += ["--parallel.tp", str(args.tp), "--parallel.pp", str(args.pp), "--train.steps", "100000"]
        world = args.tp * args.pp * args.dp
        got = run_ranks(measure, world, argv, args.steps, args.repeats, timeout_s=1800)[0]
    on, off = (statistics.median(got["times"][k]) for k in ("on", "off"))
    ns = pair_ns()
    print(f"{args.config} tp{args.tp} pp{args.pp} dp{args.dp}, {world} gloo ranks, rank 0:")
    print(f"  step  off {off * 1e3:8.1f} ms   on {on * 1e3:8.1f} ms   on/off {on / off:.4f}")
    share = got["ops"] * ns * 1e-9 / off
    print(f"  {got['ops']} operations logged per step x {ns:.0f} ns per begin + end = {share * 100:.4f} % of the step")


if __name__ == "__main__":
    main()
