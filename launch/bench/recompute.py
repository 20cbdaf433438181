"""Benchmark: training step time, eager vs torch.compile and none vs full vs selective recomputation, side by side.

    python launch/bench/recompute.py [--config configs/tiny.yaml] [--steps 10] [--warmup 2] [--no-compile]

One process builds a Trainer (tp = pp = dp = 1) per variant on the same config and the same random global
batches; steps run alternately (variant A, B, C, ... then again), so drift in machine load hits all alike; the
figures are medians. The warmup steps include compilation (train.compile, inductor), whose time is shown apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.config import load  # noqa: E402
from engine.parallel.layout.context import ParallelContext, destroy  # noqa: E402
from engine.trainer import Trainer  # noqa: E402

VARIANTS = [
    ("eager", "none"),
    ("eager", "full"),
    ("eager", "selective"),
    ("compile", "none"),
    ("compile", "full"),
    ("compile", "selective"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    args = parser.parse_args()
    os.environ.pop("MASTER_ADDR", None)
    variants = [v for v in VARIANTS if not (args.no_compile and v[0] == "compile")]
    trainers, ctx = {}, None
    for run, ac in variants:
        cfg = load(
            [
                "--config",
                args.config,
                "--log.progress",
                "false",
                "--train.out_dir",
                "/tmp/engine-bench",
                "--train.activation_checkpointing",
                ac,
                "--train.compile",
                str(run == "compile").lower(),
            ]
        )
        ctx = ctx or ParallelContext.from_config(cfg)
        trainers[(run, ac)] = Trainer(cfg, ctx)
    t = cfg.train
    gen = torch.Generator().manual_seed(0)
    times = {v: [] for v in variants}
    first = {}
    for i in range(args.warmup + args.steps):
        batch = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_len + 1), generator=gen)
        for v in variants:
            start = time.perf_counter()
            loss = trainers[v].train_step(batch)["loss"]
            elapsed = time.perf_counter() - start
            if i == 0:
                first[v] = (elapsed, loss)
            elif i >= args.warmup:
                times[v].append(elapsed)
    destroy()
    print(
        f"{args.config}: {t.global_batch_size} x {t.seq_len} tokens per step, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; median of {args.steps} steps after {args.warmup} warmup"
    )
    base = statistics.median(times[("eager", "none")])
    print(f"{'run':<9}{'recompute':<11}{'step ms':>9}{'vs eager/none':>15}{'first step s':>14}{'step-1 loss':>13}")
    for v in variants:
        med = statistics.median(times[v])
        print(f"{v[0]:<9}{v[1]:<11}{1000 * med:>9.1f}{med / base:>15.3f}{first[v][0]:>14.1f}{first[v][1]:>13.6f}")


if __name__ == "__main__":
    main()
