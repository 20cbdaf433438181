"""Benchmark: what the step timing costs and what the warm-up step is (engine/metrics/timers.py, stepstats.py).

    python launch/bench/timers.py --config configs/tiny.yaml [--steps 12] [--repeats 2] [--set train.compile=true]

One process (tp = pp = dp = 1, on CUDA when there is one) runs Trainer.fit for ``--steps`` steps with
log.breakdown on (CUDA events / the host clock per phase) and off, alternating ``--repeats`` times so drift in
machine load hits both alike. Printed per setting: the first (warm-up) step's time, the median of the later
steps, their ratio, and the median of the later steps' unphased time (step_time minus the sum of its phases:
logging, the loss all-reduce and .item(), what no phase covers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config import load  # noqa: E402
from engine.parallel.layout.context import ParallelContext, destroy  # noqa: E402
from engine.trainer import Trainer  # noqa: E402


def run(args, breakdown: bool) -> list[dict]:
    overrides = [f"--{s.split('=', 1)[0]}={s.split('=', 1)[1]}" for s in args.set]
    with tempfile.TemporaryDirectory() as out:
        cfg = load(
            [
                "--config",
                args.config,
                "--train.steps",
                str(args.steps),
                "--log.progress",
                "false",
                "--log.breakdown",
                str(breakdown).lower(),
                "--train.eval_every",
                "0",
                "--train.out_dir",
                out,
                *overrides,
            ]
        )
        ctx = ParallelContext.from_config(cfg)
        try:
            return Trainer(cfg, ctx).fit()
        finally:
            destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE config override (repeatable)")
    args = parser.parse_args()
    rows: dict[bool, list] = {True: [], False: []}
    for _ in range(args.repeats):
        for breakdown in (True, False):
            history = run(args, breakdown)
            later = [r for r in history if not r.get("warmup")]
            rows[breakdown].append(
                {
                    "first": history[0]["step_time"],
                    "later": statistics.median(r["step_time"] for r in later),
                    "unphased": statistics.median(r["step_time"] - sum(r.get("time", {}).values()) for r in later),
                }
            )
    print(
        f"{'breakdown':>10}{'step 1 s':>10}{'later s':>10}{'ratio':>8}{'unphased s':>12}  (medians of {args.repeats})"
    )
    for breakdown, rs in rows.items():
        first, later = (statistics.median(r[k] for r in rs) for k in ("first", "later"))
        unphased = statistics.median(r["unphased"] for r in rs)
        print(
            f"{str(breakdown):>10}{first:>10.3f}{later:>10.3f}{first / later:>8.2f}"
            f"{unphased if breakdown else float('nan'):>12.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
