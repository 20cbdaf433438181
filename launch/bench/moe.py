"""Expert parallelism side by side: step time, all-to-all bytes and per-expert load against parallel.ep.

    python launch/bench/moe.py [--config configs/tiny-moe.yaml] [--world 4] [--ep 1 2 4] [--steps 6] [--warmup 2]
                               [-- KEY VALUE ...]

For each ep (dividing the world, all of it dp), the tiny MoE trains ``steps`` steps in ``world`` forked ranks
(gloo on the CPU; the same code on NCCL) and prints, per ep:
- ``step_s``: the median step time after ``warmup`` steps (rank 0's ``step_time``);
- ``a2a_MB``: bytes each rank sends to other ranks by all-to-all per step (token copies and their gradients, the
  counts exchange included; rows kept on the rank itself are not sent), the mean over ranks, counted by wrapping
  ``torch.distributed.all_to_all_single`` in engine/parallel/ep/dispatch.py;
- ``rows/rank max/mean``: token copies the experts of the busiest ep rank compute per step against the mean (the
  load imbalance ep turns into waiting: 1.00 is even);
- ``tok/expert min/max/cv``: token copies per expert over the step (metrics.jsonl's moe_tokens_per_expert_*);
- ``planned``: the planner's a2a bytes per rank (engine/planning/ep.py: the mean; routing decides the measured);
- ``peak MB meas/plan``: one more step measured as tests/planning/test_planner.py measures it (launch/bench/measure.py:
  tensors held plus the peak of live allocations), the largest over the ranks, beside engine/planning/planner.py's
  peak for the rank, and their ratio (the issue asks 10 %). The planner's expert activations are the busiest
  rank's (its EP_IMBALANCE margin, engine/planning/moe.py, from this bench's rows/rank column).
At ep 1 there is no all-to-all and every rank computes its own tokens' copies for all E experts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch.distributed as dist  # noqa: E402

from engine.config import load  # noqa: E402
from engine.parallel.ep import dispatch  # noqa: E402
from engine.parallel.layout.checks import micro_batches_per_step, resolve_layout  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.planning import ep as ep_plan  # noqa: E402
from engine.planning.planner import stage_memory  # noqa: E402
from engine.trainer import Trainer  # noqa: E402
from launch.bench.measure import measure_step  # noqa: E402


class Counter:
    """Wraps all_to_all_single: bytes sent to other ranks, and rows received by this rank's experts."""

    def __init__(self):
        self.sent = self.rows = 0
        self.inner = dist.all_to_all_single
        self.after_counts = False  # the first copy exchange after a counts exchange is the dispatch

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        me = dist.get_rank(group)
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        splits = input_split_sizes or [input.shape[0] // dist.get_world_size(group)] * dist.get_world_size(group)
        self.sent += sum(n for j, n in enumerate(splits) if j != me) * row
        if self.after_counts:  # the dispatch: the rows this rank's experts compute
            self.rows += sum(output_split_sizes)
        self.after_counts = not input.is_floating_point()  # the (ep, E/ep) counts
        return self.inner(output, input, output_split_sizes, input_split_sizes, group=group, **kw)


def bench_rank(argv: list[str], steps: int, warmup: int) -> dict:
    counter = Counter()
    dispatch.dist.all_to_all_single = counter  # the module's dist is torch.distributed: restored below
    try:
        cfg = load(argv)
        trainer = Trainer(cfg, ParallelContext.from_config(cfg))
        history = trainer.fit()
    finally:
        dispatch.dist.all_to_all_single = counter.inner
    last = history[-1]
    measured = measure_step(trainer, trainer.next_local_batch())["peak"]  # optimizer state exists: a later step
    return {
        "peak": measured,
        "stage": trainer.ctx.pp_rank,
        "step_s": statistics.median(r["step_time"] for r in history[warmup:]),
        "sent": counter.sent / steps,
        "rows": counter.rows / steps,
        "tok": (last["moe_tokens_per_expert_min"], last["moe_tokens_per_expert_max"], last["moe_tokens_per_expert_cv"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny-moe.yaml")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    print(
        f"{'ep':>3} {'step_s':>8} {'a2a_MB':>8} {'planned':>8} {'rows/rank max/mean':>19} "
        f"{'tok/expert min/max/cv':>22} {'peak MB meas/plan':>18} {'ratio':>6}"
    )
    for ep in args.ep:
        with tempfile.TemporaryDirectory() as out:
            argv = [
                "--config",
                args.config,
                "--train.steps",
                str(args.steps),
                "--parallel.ep",
                str(ep),
                "--log.progress",
                "false",
                "--train.eval_every",
                "0",
                "--train.out_dir",
                out,
                *extra,
            ]
            per_rank = run_ranks(bench_rank, args.world, argv, args.steps, args.warmup, timeout_s=1800)
        rows = [r["rows"] for r in per_rank]
        imbalance = max(rows) / statistics.mean(rows) if ep > 1 else 1.0
        tmin, tmax, cv = per_rank[0]["tok"]
        planned_sent, measured, planned = planned_figures(load(argv), args.world, per_rank)
        print(
            f"{ep:>3} {per_rank[0]['step_s']:>8.3f} {statistics.mean(r['sent'] for r in per_rank) / 2**20:>8.2f} "
            f"{planned_sent / 2**20:>8.2f} {imbalance:>19.2f} {f'{tmin}/{tmax}/{cv:.2f}':>22} "
            f"{f'{measured / 2**20:.2f}/{planned / 2**20:.2f}':>18} {measured / planned:>6.3f}",
            flush=True,
        )


def planned_figures(cfg, world: int, per_rank: list[dict]) -> tuple[float, float, float]:
    """(planned a2a bytes per rank per step, the largest measured peak, the planner's peak for that rank's stage)."""
    layout = resolve_layout(cfg, world)
    fwd, bwd = ep_plan.a2a_bytes_per_layer(cfg, layout.ep)
    layers = ep_plan.moe_layers(cfg.model, range(cfg.model.num_layers)) / layout.pp  # MoE layers a rank runs
    sent = (fwd + bwd) * layers * micro_batches_per_step(cfg.train, layout.dp)
    top = max(per_rank, key=lambda r: r["peak"])
    return sent, top["peak"], stage_memory(cfg, world, top["stage"], layout=layout).total


if __name__ == "__main__":
    main()
