"""Loss curves of DDP's gradient compression (parallel.grad_compression) against one process, and bytes on the wire.

    python launch/bench/compression.py [--config configs/tiny.yaml] [--steps 300] [--broken] [-- KEY VALUE ...]

One dp = 1 run (grad_compression none) and one dp = 2 run per hook (none, bf16, fp16, powersgd) from the same
seed and global batches. For each, the max / mean / final absolute loss difference to the dp = 1 curve, the mean
relative grad-norm difference, and the bytes each rank all-reduces per step (the payload handed to the
collective, after warm-up: bucket numel x 4 for fp32, x 2 for bf16/fp16; PowerSGD's P and Q factors plus the
tensors it leaves uncompressed, counted by its own PowerSGDState; a ring all-reduce sends about twice that).
``--broken`` adds two wrong hooks as negative controls for the bounds in tests/parallel/dp/test_ddp.py: ``local`` (odd
buckets not reduced: each rank keeps its own gradient there) and ``sum`` (all-reduce without dividing by dp).

The hook is observed by wrapping ``engine.parallel.dp.ddp.comm_hook`` in the forked ranks (``spy``), which tests
also use (tests/parallel/dp/test_ddp.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from engine.parallel.layout.spawn import run_ranks  # noqa: E402

HOOKS = ("none", "bf16", "fp16", "powersgd")
BROKEN = ("local", "sum")


def spy(log: list, broken: str | None = None) -> None:
    """Patch ddp.comm_hook so that every bucket DDP reduces is appended to ``log`` as a dict: index, numel,
    storage (data pointer and bytes of the bucket's storage), wire (bytes all-reduced for it). ``broken`` swaps
    in a wrong reduction: ``local`` leaves odd buckets unreduced, ``sum`` forgets the division by dp."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from engine.parallel.dp import ddp

    original = getattr(ddp.comm_hook, "original", ddp.comm_hook)  # not a spy of a spy: one per rank and run

    def comm_hook(cfg, ctx):
        made = original(cfg, ctx)
        state, hook = made if made is not None else (ctx.dp_group, default_hooks.allreduce_hook)
        wire_itemsize = 2 if cfg.parallel.grad_compression in ("bf16", "fp16") else None

        def spying(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
            buf = bucket.buffer()  # (bucket numel,): the gradients of the bucket's parameters, as views
            before = getattr(state, "total_numel_after_compression", 0)
            if broken == "local" and bucket.index() % 2:
                fut = torch.futures.Future()
                fut.set_result(buf)
            elif broken == "sum":
                fut = dist.all_reduce(buf, group=ctx.dp_group, async_op=True).get_future().then(lambda f: f.value()[0])
            else:
                fut = hook(state, bucket)
            # PowerSGD counts the elements it all-reduces (P, Q, uncompressed tensors) once past its warm-up.
            compressed = getattr(state, "total_numel_after_compression", 0) - before
            wire = (
                compressed * buf.element_size() if compressed else buf.numel() * (wire_itemsize or buf.element_size())
            )
            log.append(
                {
                    "index": bucket.index(),
                    "numel": buf.numel(),
                    "storage": buf.untyped_storage().data_ptr(),
                    "storage_bytes": buf.untyped_storage().nbytes(),
                    "wire": wire,
                }
            )
            return fut

        return state, spying

    comm_hook.original = original
    ddp.comm_hook = comm_hook


def train_rank(argvs: list[list[str]], broken: str | None = None) -> list[dict]:
    """Rank function: train each argv with the hook spied on; per run the losses, grad norms, the buckets
    reduced in each step (a list per step), and after the last step the gradient storages and bytes held."""
    from engine.config import load
    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer

    warnings.filterwarnings("ignore")
    out = []
    for argv in argvs:
        log: list = []
        spy(log, broken)
        cfg = load(argv)
        trainer = Trainer(cfg, ParallelContext.from_config(cfg))
        per_step: list = []

        def end_of_backward(event: str) -> None:  # the step's buckets are all reduced by the update
            if event == "update":
                per_step.append(log[:])
                log.clear()

        trainer.observers.append(end_of_backward)
        history = trainer.fit()
        params = list(trainer.model.parameters())
        out.append(
            {
                "loss": [r["loss"] for r in history],
                "grad_norm": [r["grad_norm"] for r in history],
                "buckets": per_step,
                "bytes": trainer.dp.bytes_held(),
                "grad_storages": [None if p.grad is None else p.grad.untyped_storage().data_ptr() for p in params],
            }
        )
    return out


def differences(run: dict, ref: dict) -> dict:
    """Absolute loss differences to the reference curve (max, mean, final) and the mean relative grad-norm one."""
    d = [abs(a - b) for a, b in zip(run["loss"], ref["loss"])]
    g = [abs(a - b) / b for a, b in zip(run["grad_norm"], ref["grad_norm"])]
    return {"max": max(d), "mean": statistics.fmean(d), "final": d[-1], "grad_norm": statistics.fmean(g)}


def wire_bytes(run: dict) -> int:
    """Bytes all-reduced per step by one rank, in the last step (past every warm-up)."""
    return sum(b["wire"] for b in run["buckets"][-1])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--broken", action="store_true", help="add the wrong hooks (negative controls)")
    ap.add_argument("overrides", nargs="*", help="more dotted overrides, e.g. train.seq_len 64")
    args = ap.parse_args(argv)
    # 4 MB buckets: several even for the tiny model (5M fp32 gradients), so that ``local`` leaves some unreduced.
    base = [
        "--config",
        args.config,
        "--log.progress",
        "false",
        "--log.breakdown",
        "false",
        "--parallel.bucket_mb",
        "4",
        "--train.steps",
        str(args.steps),
        *[f"--{a}" if i % 2 == 0 else a for i, a in enumerate(args.overrides)],
    ]
    out = "/tmp/bench_compression"
    (ref,) = run_ranks(train_rank, 1, [[*base, "--train.out_dir", f"{out}/dp1"]], timeout_s=7200)[0]
    runs = run_ranks(
        train_rank,
        2,
        [[*base, "--parallel.grad_compression", h, "--train.out_dir", f"{out}/{h}"] for h in HOOKS],
        timeout_s=7200,
    )[0]
    rows = list(zip(HOOKS, runs))
    if args.broken:
        for bad in BROKEN:
            argv = [*base, "--train.out_dir", f"{out}/{bad}"]
            rows.append((f"none+{bad}", run_ranks(train_rank, 2, [argv], bad, timeout_s=7200)[0][0]))
    print(
        f"{args.config}, {args.steps} steps ({' '.join(args.overrides) or 'no overrides'}); dp=1 loss "
        f"{ref['loss'][0]:.3f} -> {ref['loss'][-1]:.3f}; {len(ref['buckets'][-1])} bucket(s) at dp=2"
    )
    print(
        f"{'dp=2 hook':<14} {'max |dloss|':>11} {'mean |dloss|':>12} {'final |dloss|':>13} "
        f"{'mean rel dnorm':>14} {'wire B/step':>12} {'vs none':>8}"
    )
    full = wire_bytes(runs[0])
    for name, run in rows:
        d, wire = differences(run, ref), wire_bytes(run)
        print(
            f"{name:<14} {d['max']:>11.4f} {d['mean']:>12.4f} {d['final']:>13.4f} {d['grad_norm']:>14.4f} "
            f"{wire:>12,} {wire / full:>8.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
