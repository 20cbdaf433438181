"""Benchmark of parallel.pp_layers auto against the even split, side by side in one run: the slowest stage's compute
and the step time, at pp 2 and 4.

    nice -n 5 python launch/bench/stage_balance.py [--pp 2 4] [--micro-batches 8] [--steps 4] [--layers 8]
        [--vocab 4096]

For each pp, pp ranks are forked (gloo, one torch thread each, fp32, random tokens; tiny.yaml's heads, 8 layers and
tiny's vocabulary of 4096 by default, so the LM head weighs about 1.3 layers as it does in tiny). Each rank builds
its stage twice, once per split (engine/planning/balance.py layer_counts), and the two 1F1B runs alternate step by
step, in a rotating order, so machine noise hits them alike (launch/bench/schedules.py's Run: computes timed in
thread CPU seconds). Medians are over the --steps after the --warmup ones. Printed per (pp, split):

- ``layers``: the split; ``plan``: the slowest stage's FLOPs per token (balance.stage_cost) and its ratio to the
  even split's;
- per stage, ``F+B+L``: the stage's compute for one micro-batch (thread CPU ms, medians of forward, backward and
  on the last stage the loss), the quantity the split balances; ``slowest``: its maximum over stages;
- ``step``: the makespan (barrier to barrier, wall ms) and the median per step of its ratio to the even split's.

With more ranks than free cores (pp 4 on 2 cores) the ranks take turns, which stretches wall-clock step times;
thread CPU times (the per-stage columns) are not inflated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.planning.balance import layer_counts, stage_cost  # noqa: E402
from engine.trainer import build_model  # noqa: E402
from launch.bench.pipeline import add_model_args, config, model_line  # noqa: E402
from launch.bench.schedules import Run, rotated  # noqa: E402

SPLITS = {"even": (), "auto": ("--parallel.pp_layers", "auto")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (one rank per stage)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[8], help="m per step")
    p.add_argument("--steps", type=int, default=4, help="measured steps of each split per (pp, m)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    add_model_args(p)
    p.set_defaults(vocab=4096)  # tiny's vocabulary: the head whose cost the auto split accounts for
    args = p.parse_args(argv)
    bad = [(pp, m) for pp in args.pp for m in args.micro_batches if pp < 2 or m < pp or pp > args.layers]
    if bad or args.steps < 1 or args.warmup < 1:
        p.error(
            f"need 2 <= pp <= --layers, each m >= pp, --steps and --warmup >= 1 (got (pp, m) {bad}, "
            f"steps {args.steps}, warmup {args.warmup})"
        )
    return args


def rank_main(args: argparse.Namespace) -> dict:
    """One forked rank: for each m, the two splits alternating step by step; {m: {split: summary}}."""
    pp = dist.get_world_size()
    cfgs = {n: config(args, pp, *extra) for n, extra in SPLITS.items()}
    ctx = ParallelContext.from_config(cfgs["even"])
    stages = {n: build_model(cfg, ctx) for n, cfg in cfgs.items()}
    out = {}
    for m in args.micro_batches:
        runs = {n: Run("1f1b", 1, cfgs[n], ctx, stages[n], m) for n in SPLITS}
        for i in range(args.warmup + args.steps):
            for n in rotated(SPLITS, i):
                runs[n].step(i, args.warmup)
        out[m] = {n: r.summary() for n, r in runs.items()}
    return out


def stage_ms(summary: dict) -> float:
    """One micro-batch's compute on a stage: forward + backward (+ loss on the last), thread CPU ms."""
    return sum(summary["ops"].get(op, 0.0) for op in ("F", "B", "L")) * 1e3


def report(pp: int, m: int, ranks: list[dict], args: argparse.Namespace) -> None:
    plans = {}
    for n, extra in SPLITS.items():
        cfg = config(args, pp, *extra)
        counts = layer_counts(cfg, pp)
        plans[n] = counts, max(stage_cost(cfg, pp, s, k) for s, k in enumerate(counts))
    for n in SPLITS:
        counts, slowest_plan = plans[n]
        per_stage = [stage_ms(r[n]) for r in ranks]
        steps, even_steps = ranks[0][n]["steps"], ranks[0]["even"]["steps"]
        ratio = statistics.median(a / b for a, b in zip(steps, even_steps))
        print(
            f"{pp:>2} {m:>3} {n:>5} {str(counts):>14} {slowest_plan / 1e6:>7.2f} "
            f"{slowest_plan / plans['even'][1]:>6.3f}  {' '.join(f'{t:6.1f}' for t in per_stage):<27} "
            f"{max(per_stage):>7.1f} {max(per_stage) / max(stage_ms(r['even']) for r in ranks):>6.3f} "
            f"{ranks[0][n]['step'] * 1e3:>8.1f} {ratio:>6.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"{model_line(args)}, 1f1b; {args.steps} measured steps of each split per (pp, m)")
    start = time.perf_counter()
    results = {pp: run_ranks(rank_main, pp, args, timeout_s=900, threads=1) for pp in args.pp}
    print(
        f"\n{'pp':>2} {'m':>3} {'split':>5} {'layers':>14} {'plan MF':>7} {'/even':>6}  "
        f"{'F+B+L ms per stage':<27} {'slowest':>7} {'/even':>6} {'step ms':>8} {'/even':>6}"
    )
    for pp, ranks in results.items():
        for m in args.micro_batches:
            report(pp, m, [r[m] for r in ranks], args)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
