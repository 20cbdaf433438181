"""The old flat all-reduce against torch DDP (dp_mode=ddp): exposed dp communication and peak gradient bytes.

    python launch/bench/dp_comm.py [--config configs/50m.yaml] [--dp 2 4] [--steps 5] [--warmup 1] [-- KEY VALUE ...]

``FlatAllReduce`` is the engine's ddp before torch DDP (git show e1100a7:engine/parallel/dp/fsdp.py): after the
whole backward, one flat copy of the gradients per dtype (torch._utils._flatten_dense_tensors), all-reduce SUM,
divide, copy back. It is registered as a dp mode at run time with one line (``MODES["flat"] = DpModeSpec(...)``): a new
mode is this one class plus that line.

Per dp size, every rank holds a flat trainer and a ddp trainer over the same process group, and four variants
take turns step by step (flat, flat without its all-reduce, ddp, ddp with its reducer never armed), so drift in
machine load hits all alike; medians after warm-up of:
- ``dp_comm``: the step's dp_comm phase (log.breakdown): the reduction that runs after backward;
- ``step``: the step time;
- ``exposed``: step time minus that of the same mode without its dp reduction: the communication that did not
  hide behind compute (under DDP it waits inside the last backward, so dp_comm alone would miss it).
Peak gradient bytes, measured in a separate run per mode (one step after DDP re-buckets): the gradient storages
held at the update plus the peak of new storages alive while the reduction runs (engine/metrics/memory.py
LiveTensorBytes around reduce_gradients, and around each DDP comm-hook call: the flat copy, a compression
buffer); DDP's buckets are counted with the gradients they are views of, once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # noqa: E402

from engine.kinds.dp_modes import (
    MODES,  # noqa: E402
    DpModeSpec,  # noqa: E402
)
from engine.metrics.memory import LiveTensorBytes, storage_bytes  # noqa: E402
from engine.optim import unique_params  # noqa: E402
from engine.parallel.dp.base import DataParallel, TorchOptimizerMixin  # noqa: E402
from engine.parallel.dp.state import TorchState  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402


class FlatAllReduce(TorchOptimizerMixin, DataParallel):
    """dp_mode=flat: gradients averaged over dp after the whole backward through one flat buffer per dtype."""

    reduce = True  # False: skip the all-reduce (the benchmark's no-communication baseline)
    probe = None  # a LiveTensorBytes to run the reduction under, or None

    def __init__(self, model, cfg, ctx):
        super().__init__(cfg, ctx)
        self.module = model
        self._build_optimizer()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        size = dist.get_world_size(self.ctx.dp_group)
        if not self.reduce or size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, _, p in unique_params(self.module):
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)  # (sum of numels,): the second copy of the gradients
            dist.all_reduce(flat, group=self.ctx.dp_group)  # gloo has no AVG: SUM, then divide
            flat.div_(size)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    def checkpoint_state(self):
        return TorchState(self.module, self.optimizer, self.ctx, fsdp=False)


def register() -> None:
    # no planner model: launch/plan.py refuses to price it rather than pricing it as ddp
    MODES["flat"] = DpModeSpec("flat", "launch.bench.dp_comm:FlatAllReduce", MODES["ddp"].state)


def build(argv: list[str], mode: str):
    from engine.config import load
    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer

    cfg = load([*argv, "--parallel.dp_mode", mode, "--train.out_dir", f"/tmp/bench_dp_comm/{mode}"])
    return Trainer(cfg, ParallelContext.from_config(cfg))


def set_reduction(trainer, on: bool) -> None:
    """Turn the dp reduction of ``trainer`` on or off: flat skips its all-reduce, DDP never arms its reducer nor
    reduces after the backward (instance attributes shadow DDP's methods; deleting them restores the methods)."""
    if isinstance(trainer.dp, FlatAllReduce):
        trainer.dp.reduce = on
    elif on:
        trainer.dp.__dict__.pop("before_backward", None)
        trainer.dp.__dict__.pop("reduce_gradients", None)
    else:
        trainer.dp.before_backward = lambda is_last, chunk=0: None
        trainer.dp.reduce_gradients = lambda: None


def timing_rank(argv: list[str], steps: int, warmup: int) -> dict:
    """Rank function: the four variants in turn; per variant the median step time and dp_comm phase."""
    register()
    trainers = {mode: build(argv, mode) for mode in ("flat", "ddp")}
    times: dict[tuple, list] = {}
    for i in range(warmup + steps):
        for mode, trainer in trainers.items():
            for on in (True, False):
                set_reduction(trainer, on)
                dist.barrier()
                record = trainer.train_step(trainer.next_local_batch())
                dist.barrier()
                if i >= warmup:
                    times.setdefault((mode, on), []).append((record["step_time"], record["time"].get("dp_comm", 0)))
    return {key: (statistics.median(t for t, _ in v), statistics.median(c for _, c in v)) for key, v in times.items()}


def memory_rank(argv: list[str], mode: str) -> dict:
    """Rank function: gradient bytes held at the update, and the peak of new storages while the reduction runs."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from engine.parallel.dp import ddp

    register()
    probe: dict = {"on": False, "peak": 0, "buckets": []}
    original = ddp.comm_hook

    def comm_hook(cfg, ctx):  # DDP's hook (torch's allreduce_hook for none), run under a LiveTensorBytes
        state, hook = original(cfg, ctx) or (ctx.dp_group, default_hooks.allreduce_hook)

        def measured(state, bucket):
            if not probe["on"]:
                return hook(state, bucket)
            probe["buckets"].append(bucket.buffer())
            with LiveTensorBytes() as live:
                fut = hook(state, bucket)
                fut.wait()
            probe["peak"] = max(probe["peak"], live.peak)
            return fut

        return state, measured

    ddp.comm_hook = comm_hook
    trainer = build(argv, mode)
    for _ in range(2):  # DDP re-buckets after its first step
        trainer.train_step(trainer.next_local_batch())
    probe["on"] = True
    trainer.forward_backward(trainer.next_local_batch())
    if mode == "flat":
        with LiveTensorBytes() as live:
            trainer.dp.reduce_gradients()
        probe["peak"] = live.peak
    held = storage_bytes([p.grad for p in trainer.model.parameters()] + probe["buckets"], set())
    return {"held": held, "temporary": probe["peak"], "params": trainer.dp.bytes_held()["params"]}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/50m.yaml")
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="more dotted overrides, e.g. train.seq_len 64")
    args = ap.parse_args(argv)
    base = [
        "--config",
        args.config,
        "--log.progress",
        "false",
        "--log.breakdown",
        "true",
        *[f"--{a}" if i % 2 == 0 else a for i, a in enumerate(args.overrides)],
    ]
    mib = 2**20
    print(
        f"{args.config} ({' '.join(args.overrides) or 'no overrides'}); medians of {args.steps} steps after "
        f"{args.warmup} warm-up, variants alternating step by step"
    )
    print(
        f"{'dp':>3} {'mode':<5} {'dp_comm ms':>10} {'step ms':>9} {'no-comm ms':>10} {'exposed ms':>10} "
        f"{'grads MiB':>9} {'temp MiB':>8} {'peak MiB':>8} {'/ params':>8}"
    )
    for dp in args.dp:
        t = run_ranks(timing_rank, dp, base, args.steps, args.warmup, timeout_s=3600)[0]
        for mode in ("flat", "ddp"):
            m = run_ranks(memory_rank, dp, base, mode, timeout_s=1800)[0]
            (step, comm), (off, _) = t[(mode, True)], t[(mode, False)]
            peak = m["held"] + m["temporary"]
            print(
                f"{dp:>3} {mode:<5} {1e3 * comm:>10.1f} {1e3 * step:>9.1f} {1e3 * off:>10.1f} "
                f"{1e3 * (step - off):>10.1f} {m['held'] / mib:>9.1f} {m['temporary'] / mib:>8.1f} "
                f"{peak / mib:>8.1f} {peak / m['params']:>8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
