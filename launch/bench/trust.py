"""Benchmark: what each trust part (engine/trust/) costs a step, side by side in one run, against the same steps off.

    python launch/bench/trust.py [--config configs/tiny.yaml] [--dp 2] [--steps 30] [--replicas-every 10]

``--dp`` forked gloo ranks build one Trainer each and run ``--steps`` steps with no trust part and as many with each
part called after the step as Trainer.fit calls it, taking turns step by step so the machine's drifting load hits
all alike. The parts, at their heaviest always-on setting: the straggler report at log.every 1 (the default: its
steps gathered and judged every 4th call), the goodput ledger written after every step (log.every 1), and the
replica check (train.check_replicas_every, off by default) run at every call and charged 1/``--replicas-every`` of
its time, its cost per step at that interval. Printed, on rank 0 (which judges the stragglers and writes the
ledger): the median step time with each part (called every step) and its ratio to off, the mean time of the part
alone (its reports and writes included), its interval in steps, and the ratio at that interval, 1 + (part alone /
interval) / off step: the figure to read on a loaded machine, where step times drift by more than a part costs.
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


def parts(trainer: Trainer) -> dict:
    """Each part as Trainer.fit calls it after a step (record: that step's)."""

    def stragglers(record: dict) -> None:
        trainer.stragglers.add(record)
        trainer.stragglers.report(record)

    return {
        "straggler report": stragglers,
        "goodput ledger": lambda record: trainer.goodput.step(trainer.step, record["step_time"], write=True),
        "replica check": lambda record: trainer.replicas.maybe_check(trainer.step),
    }


def measure(argv: list[str], steps: int) -> dict[str, list[float]]:
    """One rank: ``steps`` step times with no part and with each part, the parts taking turns step by step (so the
    machine's drifting load hits all alike), and each part's own times."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    trainer.train_step(trainer.next_local_batch())  # warm-up (and the report's warm-up step, left out)
    turns = [("off", None), *parts(trainer).items()]
    times: dict[str, list[float]] = {"off": []} | {k: [] for n, _ in turns[1:] for k in (n, f"{n} alone")}
    for i in range(steps * len(turns)):
        name, call = turns[i % len(turns)]
        start = time.perf_counter()
        record = trainer.train_step(trainer.next_local_batch())
        if call is not None:
            begun = time.perf_counter()
            call(record)
            times[f"{name} alone"].append(time.perf_counter() - begun)
        times[name].append(time.perf_counter() - start)
    return times


def rank0_times(args: argparse.Namespace) -> dict[str, list[float]]:
    """Start the ranks (every part on: each is called, or not, by the bench itself); rank 0's times."""
    argv = ["--config", args.config, "--train.steps", "1000000", "--log.progress", "false", "--log.every", "1"]
    argv += ["--train.check_replicas_every", "1", "--parallel.dp", str(args.dp)]
    with tempfile.TemporaryDirectory() as out:
        return run_ranks(measure, args.dp, [*argv, "--train.out_dir", out], args.steps, timeout_s=1800)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = {"config": "configs/tiny.yaml", "dp": 2, "steps": 30, "replicas-every": 10}
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    args = parser.parse_args()
    times = rank0_times(args)
    base = statistics.median(times.pop("off"))
    every = {"replica check": args.replicas_every}
    print(f"rank 0 of dp {args.dp}, {args.steps} steps each (median; a part alone: mean); off: {base:.4f} s a step")
    print(f"{'part':>17}{'step s':>9}{'ratio':>7}{'alone s':>9}{'interval':>10}{'ratio at it':>13}")
    for name in [n for n in times if not n.endswith(" alone")]:
        step, alone = statistics.median(times[name]), statistics.mean(times[f"{name} alone"])
        n = every.get(name, 1)
        print(f"{name:>17}{step:>9.4f}{step / base:>7.3f}{alone:>9.5f}{n:>10}{1 + alone / n / base:>13.4f}", flush=True)


if __name__ == "__main__":
    main()
