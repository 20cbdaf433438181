"""Benchmark: what the heartbeat (engine/cluster/heartbeat.py) costs a training step.

    python launch/bench/heartbeat.py [--config configs/tiny.yaml] [--ranks 2] [--steps 10] [--repeats 3]

``--ranks`` forked gloo ranks (dp) build one Trainer and run blocks of ``--steps`` steps with no heartbeat, with
the default one (parallel.heartbeat_timeout_s 30: a beat every 3 s) and with a 10 times busier one (3 s: a beat
every 0.3 s), alternating ``--repeats`` times so drift in machine load hits all alike. Printed: the median step
time of each and its ratio to no heartbeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.cluster.heartbeat import Heartbeat  # noqa: E402
from engine.config import load  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.trainer import Trainer  # noqa: E402

SETTINGS = {"off": 0.0, "default (30 s)": 30.0, "busy (3 s)": 3.0}


def measure(config: str, out: str, steps: int, repeats: int) -> dict[str, list[float]]:
    """One rank: step times per setting (``out``: the run's out_dir, one for all ranks)."""
    cfg = load(["--config", config, "--train.steps", "1000000", "--log.progress", "false", "--train.out_dir", out])
    ctx = ParallelContext.from_config(cfg)
    trainer = Trainer(cfg, ctx)
    trainer.train_step(trainer.next_local_batch())  # warm-up
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(repeats):
        for name, timeout in SETTINGS.items():
            beat = Heartbeat(ctx.rank, ctx.world_size, timeout, lambda: trainer.step).start() if timeout else None
            for _ in range(steps):
                start = time.perf_counter()
                trainer.train_step(trainer.next_local_batch())
                times[name].append(time.perf_counter() - start)
            if beat is not None:
                beat.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    for name, default in (("ranks", 2), ("steps", 10), ("repeats", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        times = run_ranks(measure, args.ranks, args.config, out, args.steps, args.repeats, timeout_s=1800)[0]
    base = statistics.median(times["off"])
    print(
        f"{'heartbeat':>16}{'step s':>10}{'ratio':>8}  (rank 0, median of {args.steps * args.repeats} steps, "
        f"{args.ranks} ranks)"
    )
    for name, ts in times.items():
        print(f"{name:>16}{statistics.median(ts):>10.4f}{statistics.median(ts) / base:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
