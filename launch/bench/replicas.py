"""Benchmark: what train.check_replicas_every 1 (engine/trust/replicas.py, a check after every step) costs a step.

    python launch/bench/replicas.py [--config configs/tiny.yaml] [--dp 2] [--tp 1] [--steps 10] [--repeats 3]

``--dp`` x ``--tp`` forked gloo ranks build one Trainer (ddp: every parameter compared over dp, the norms over tp)
and run blocks of ``--steps`` steps with the check off and with it after every step, alternating ``--repeats``
times so drift in machine load hits both alike. Printed: the median step time of each (the check included) and the
ratio to off, and the median time of the check alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config import load  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.trainer import Trainer  # noqa: E402


def measure(argv: list[str], steps: int, repeats: int) -> dict[str, list[float]]:
    """One rank: step times with the check off and on, and the check's own times."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    trainer.train_step(trainer.next_local_batch())  # warm-up
    times: dict[str, list[float]] = {"off": [], "every step": [], "check alone": []}
    for _ in range(repeats):
        for name in ("off", "every step"):
            for _ in range(steps):
                start = time.perf_counter()
                trainer.train_step(trainer.next_local_batch())
                if name != "off":
                    checked = time.perf_counter()
                    trainer.replicas.maybe_check(trainer.step)
                    times["check alone"].append(time.perf_counter() - checked)
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    for name, default in (("dp", 2), ("tp", 1), ("steps", 10), ("repeats", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        argv = ["--config", args.config, "--train.steps", "1000000", "--log.progress", "false"]
        argv += ["--train.out_dir", out, "--train.check_replicas_every", "1"]
        argv += ["--parallel.dp", str(args.dp), "--parallel.tp", str(args.tp)]
        times = run_ranks(measure, args.dp * args.tp, argv, args.steps, args.repeats, timeout_s=1800)[0]
    base = statistics.median(times["off"])
    print(f"{'replica check':>14}{'step s':>10}{'ratio':>8}  (rank 0, median of {args.steps * args.repeats} steps)")
    for name, ts in times.items():
        print(f"{name:>14}{statistics.median(ts):>10.4f}{statistics.median(ts) / base:>8.4f}", flush=True)


if __name__ == "__main__":
    main()
