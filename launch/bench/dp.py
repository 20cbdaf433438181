"""Benchmark of the data-parallel modes: per-rank model-state bytes against the ZeRO paper, and step times.

    python launch/bench/dp.py [--config configs/tiny.yaml] [--dp 2 4 8] [--time-dp 2] [--steps 6]

a) Memory. For each dp and mode (ddp, fsdp with resharding, DeepSpeed ZeRO-1/2/3), dp ranks are forked (gloo);
   each runs one optimizer step (so Adam's moments exist), then the next step's forward and backward, and counts
   the bytes of distinct storages it holds right before that step's update: parameters (FSDP and ZeRO-3: the
   local shard), gradients (ZeRO: its reduced partitions and accumulation copies), optimizer state (Adam moments,
   and DeepSpeed's fp32 master partition) and other DeepSpeed buffers (reduction buckets). Compared with
   ``engine.planning.dp.model_state_bytes`` (Rajbhandari et al. 2020, Sec. 5): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N
   with 16-bit weights and fp32 Adam (measured on the zero modes with train.dtype=bf16), and the fp32 analogue
   (4+4+8 bytes, no master copy) for every mode in fp32.
b) Step time. At --time-dp ranks one process holds a trainer of every mode over the same process group and
   the modes take turns step by step (A B C ... A B C ...), so drift in machine load hits all alike; the medians
   are printed as ratios to ddp.
DeepSpeed's reduction buckets come from engine/kinds/ds_config.py (5e7 elements): they dominate a small model's
"other" column on purpose, as they would on a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from engine.config import load  # noqa: E402
from engine.model.transformer import build, count_params  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.planning.dp import model_state_bytes  # noqa: E402

MODES = {
    "ddp": ["--parallel.dp_mode", "ddp"],
    "fsdp": ["--parallel.dp_mode", "fsdp", "--parallel.reshard_after_forward", "true"],
    "zero1": ["--parallel.dp_mode", "zero", "--parallel.zero_stage", "1"],
    "zero2": ["--parallel.dp_mode", "zero", "--parallel.zero_stage", "2"],
    "zero3": ["--parallel.dp_mode", "zero", "--parallel.zero_stage", "3"],
}
STAGE = {"ddp": 0, "fsdp": 3, "zero1": 1, "zero2": 2, "zero3": 3}


def memory_rank(argv: list[str]) -> dict:
    from engine.trainer import Trainer

    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    trainer.train_step(trainer.next_local_batch())
    trainer.forward_backward(trainer.next_local_batch())
    gc.collect()
    return {"bytes": trainer.dp.bytes_held(), "params": count_params(build(cfg.model))}  # Ψ, the whole model


def timing_rank(argv: list[str], modes: list[str], steps: int, warmup: int) -> dict:
    from engine.trainer import Trainer

    trainers = {}
    for mode in modes:
        cfg = load([*argv, *MODES[mode]])
        trainers[mode] = Trainer(cfg, ParallelContext.from_config(cfg))
    times: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(warmup + steps):
        for mode, trainer in trainers.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            record = trainer.train_step(trainer.next_local_batch())
            torch.distributed.barrier()
            if i >= warmup:
                times[mode].append(time.perf_counter() - start)
            losses[mode].append(record["loss"])
    return {"median": {m: statistics.median(t) for m, t in times.items()}, "losses": losses}


def memory_table(base: list[str], dps: list[int], modes: list[str]) -> None:
    mib = 2**20
    print(
        "a) per-rank model-state bytes (MiB) right before the optimizer update; formula = "
        "engine.planning.dp.model_state_bytes(Ψ, N, stage)"
    )
    print(
        f"{'precision':<9} {'mode':<6} {'dp':>3} {'params':>8} {'grads':>8} {'optim':>8} {'p+g+o':>8} "
        f"{'formula':>8} {'ratio':>6} {'other':>8}"
    )
    for precision, dtype in (("fp32", "fp32"), ("mixed", "bf16")):
        for mode in modes:
            if precision == "mixed" and not mode.startswith("zero"):
                continue  # ddp/fsdp bf16 here is autocast over fp32 weights: the fp32 rows apply
            for dp in dps:
                r = run_ranks(memory_rank, dp, [*base, *MODES[mode], "--train.dtype", dtype], timeout_s=900)[0]
                b, psi = r["bytes"], r["params"]
                pgo = b["params"] + b["grads"] + b["optimizer"]
                want = model_state_bytes(psi, dp, STAGE[mode], precision)
                print(
                    f"{precision:<9} {mode:<6} {dp:>3} {b['params'] / mib:>8.2f} {b['grads'] / mib:>8.2f} "
                    f"{b['optimizer'] / mib:>8.2f} {pgo / mib:>8.2f} {want / mib:>8.2f} {pgo / want:>6.3f} "
                    f"{b.get('other', 0) / mib:>8.2f}",
                    flush=True,
                )
    print(
        f"Ψ = {psi:,} parameters. DeepSpeed keeps an fp32 master partition even in fp32 training (+4Ψ/N over "
        "the fp32 formula); in bf16 it accumulates gradients in fp32 (train.dtype=bf16 sets grad_accum_dtype)."
    )


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--time-dp", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args(argv)
    base = [
        "--config",
        args.config,
        "--log.progress",
        "false",
        "--train.global_batch_size",
        "16",
        "--train.micro_batch_size",
        "2",
        "--train.out_dir",
        "/tmp/bench_dp",
    ]
    if not args.skip_memory:
        memory_table(base, args.dp, args.modes)
    r = run_ranks(timing_rank, args.time_dp, base, args.modes, args.steps, args.warmup, timeout_s=1800)[0]
    ddp = r["median"].get("ddp")
    print(
        f"\nb) step time at dp={args.time_dp}, modes alternating step by step, median of {args.steps} "
        f"(after {args.warmup} warm-up)"
    )
    for mode, t in r["median"].items():
        ratio = f"{t / ddp:.3f}" if ddp else "-"
        same = max(abs(a - b) / abs(b) for a, b in zip(r["losses"][mode], r["losses"][args.modes[0]]))
        print(
            f"  {mode:<6} {1000 * t:8.1f} ms/step   / ddp = {ratio}   max rel loss diff vs {args.modes[0]}: {same:.1e}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
