"""Zero bubble under ddp: the dp reduction overlapped with the W's vs exposed after the last W, side by side.

    nice -n 5 python launch/bench/zb_dp.py [--pp 2] [--dp 2] [--micro-batches 8] [--steps 6] [--bucket-mb 1]

(launch/bench/schedules.py prints the same table as its section d.) pp * dp ranks are forked (gloo, one torch
thread each, fp32, the bundled corpus). Each rank builds two trainers of the same config, schedule zero_bubble and
dp_mode ddp: ``overlapped`` (each bucket of a chunk's gradients all-reduced as the chunk's last W completes it,
engine/parallel/dp/buckets.py) and ``exposed`` (DDP.overlap_weight_reduction = False: every bucket all-reduced
after the last W, the engine's path before issue 27). Their steps alternate, in a rotating order, so machine
noise hits both alike; medians over --steps after one warmup step. Printed per pipeline stage (the mean over its
dp ranks): ``dp_comm``, the trainer's phase of the same name (reduce_gradients: what of the dp reduction is still
to do after the last W; overlapped, only the wait for buckets already in flight), and the step time. Both
variants compute the same mean gradients, so their losses are printed too (they agree to rounding).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.parallel.layout.spawn import run_ranks  # noqa: E402

VARIANTS = ("overlapped", "exposed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8, help="m per dp rank per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args(argv)
    if args.pp < 2 or args.dp < 2 or args.micro_batches < args.pp or args.steps < 1 or args.bucket_mb <= 0:
        p.error(
            f"need --pp >= 2, --dp >= 2, --micro-batches >= pp, --steps >= 1, --bucket-mb > 0 (got pp "
            f"{args.pp}, dp {args.dp}, m {args.micro_batches}, steps {args.steps}, bucket {args.bucket_mb})"
        )
    return args


def add_args(p: argparse.ArgumentParser) -> None:
    """The options launch/bench/schedules.py shares."""
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks per stage (zero bubble x ddp)")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="parallel.bucket_mb of both variants")


def argv_of(args: argparse.Namespace, out_dir: str) -> list[str]:
    return [
        "--config",
        str(ROOT / "configs/tiny.yaml"),
        "--parallel.pp",
        str(args.pp),
        "--parallel.dp",
        str(args.dp),
        "--parallel.schedule",
        "zero_bubble",
        "--parallel.dp_mode",
        "ddp",
        "--parallel.bucket_mb",
        str(args.bucket_mb),
        "--model.num_layers",
        str(args.layers),
        "--model.hidden_size",
        str(args.hidden),
        "--model.intermediate_size",
        str(args.hidden * 8 // 3),
        "--train.seq_len",
        str(args.seq_len),
        "--train.micro_batch_size",
        "1",
        "--train.global_batch_size",
        str(args.micro_batches * args.dp),
        "--train.steps",
        str(args.steps + 1),
        "--log.breakdown",
        "true",
        "--log.progress",
        "false",
        "--train.out_dir",
        out_dir,
    ]


def rank_main(args: argparse.Namespace, out_dir: str) -> dict:
    """One forked rank: both trainers, alternating; {variant: {"dp_comm": [...], "step": [...], "loss": [...]}}."""
    import warnings

    from engine.config import load
    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer

    warnings.filterwarnings("ignore")
    trainers = {}
    for name in VARIANTS:
        cfg = load(argv_of(args, f"{out_dir}/{name}"))
        trainers[name] = Trainer(
            cfg, ParallelContext.from_config(cfg) if not trainers else next(iter(trainers.values())).ctx
        )
        trainers[name].dp.overlap_weight_reduction = name == "overlapped"
    rows = {name: {"dp_comm": [], "step": [], "loss": []} for name in VARIANTS}
    for i in range(args.steps + 1):
        for name in VARIANTS[i % 2 :] + VARIANTS[: i % 2]:
            trainer = trainers[name]
            record = trainer.train_step(trainer.next_local_batch())
            if i:  # the first step warms up (DDP and the allocator)
                rows[name]["dp_comm"].append(record["time"].get("dp_comm", 0.0))
                rows[name]["step"].append(record["step_time"])
                rows[name]["loss"].append(record["loss"])
    return {"pp_rank": trainers["exposed"].ctx.pp_rank, **rows}


def measure(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        return run_ranks(rank_main, args.pp * args.dp, args, out_dir, timeout_s=900, threads=1)


def print_table(ranks: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nd) zero bubble x ddp at pp {args.pp}, dp {args.dp}, m {args.micro_batches}, bucket_mb "
        f"{args.bucket_mb}: the dp reduction overlapped with the W's vs exposed after the last W (medians over "
        f"{args.steps} steps; mean over a stage's dp ranks)"
    )
    print(f"{'stage':>5} {'variant':>10} {'dp_comm ms':>10} {'step ms':>8} {'dp_comm/step':>12}")
    for stage in range(args.pp):
        at = [r for r in ranks if r["pp_rank"] == stage]
        for name in VARIANTS:
            comm = statistics.mean(statistics.median(r[name]["dp_comm"]) for r in at)
            step = statistics.mean(statistics.median(r[name]["step"]) for r in at)
            print(f"{stage:>5} {name:>10} {comm * 1e3:>10.2f} {step * 1e3:>8.1f} {comm / step:>12.3f}")
    diff = max(abs(a - b) for r in ranks for a, b in zip(r["overlapped"]["loss"], r["exposed"]["loss"]))
    print(f"largest loss difference between the variants: {diff:.2e}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_table(measure(args), args)


if __name__ == "__main__":
    main()
