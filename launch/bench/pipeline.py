"""Benchmark of the pipeline executor: measured bubble, peak activation memory, and our 1F1B against torch's.

    python launch/bench/pipeline.py [--pp 2 4] [--micro-batches 4 8 16] [--steps 8] [--hidden 256] [--layers 8]

For each pp, pp ranks are forked (gloo, one torch thread each, random tokens, fp32); three tables follow (about a
minute and a half on 2 cores with the defaults):
a) bubble per stage at each micro-batch count m, 1F1B: ``wait`` = executor.wait_s / step (time blocked on
   receives) and ``idle`` = (step - busy) / step, where step is the makespan (barrier to barrier) and busy is the
   stage's own run time minus its waits; idle adds the time a stage has finished and waits for the others.
   Theory for both: (p-1)/(m+p-1) (Narayanan et al. 2021, Sec. 2.2.1). Medians over --steps after --warmup.
b) peak bytes of activations saved for backward and alive at once, per stage, GPipe vs 1F1B (at --memory-pp,
   --memory-m): distinct storages packed by ``saved_tensors_hooks`` (parameters excluded), released when autograd
   frees the saved tensor. Stage outputs kept outside autograd are not counted (ours frees them once sent).
c) step time (makespan) of our 1F1B vs ``torch.distributed.pipelining.Schedule1F1B`` on the same stage module,
   same micro-batches, the two alternating step by step (--compare-steps each); the median over step pairs of
   ours/theirs (< 1: ours is faster), and the largest difference of their losses (same batches).
With more ranks than cores, ranks share cores and measured waits include time a neighbour was descheduled.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: E402

from engine.config import load  # noqa: E402
from engine.metrics.memory import SavedActivations  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.parallel.pp.executor import PipelineExecutor  # noqa: E402
from engine.parallel.pp.schedule import build, max_in_flight  # noqa: E402
from engine.parallel.tp.layers import vocab_parallel_cross_entropy  # noqa: E402
from engine.trainer import build_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (one rank per stage)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16], help="m for the bubble table")
    p.add_argument("--steps", type=int, default=8, help="measured steps per setting")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    p.add_argument("--memory-pp", type=int, default=4)
    p.add_argument("--memory-m", type=int, default=8)
    p.add_argument("--compare-m", type=int, default=8, help="m for ours vs torch's 1F1B")
    p.add_argument("--compare-steps", type=int, default=16, help="measured steps of each, ours vs torch's")
    add_model_args(p)
    return p.parse_args(argv)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and batch sizes (also launch/bench/schedules.py's)."""
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=1)


def model_line(args: argparse.Namespace) -> str:
    """The machine and the sizes of add_model_args, for a benchmark's first line."""
    return (
        f"{os.cpu_count()} cores, 1 torch thread per rank; layers={args.layers} hidden={args.hidden} "
        f"ffn={args.ffn} vocab={args.vocab} seq_len={args.seq_len} micro_batch_size={args.micro_batch_size} fp32"
    )


def config(args: argparse.Namespace, pp: int, *overrides: str):
    """tiny.yaml's heads with the sizes given, pp stages, and further dotted overrides (launch/bench/schedules.py:
    the schedule)."""
    return load(
        [
            "--config",
            str(ROOT / "configs/tiny.yaml"),
            "--parallel.pp",
            str(pp),
            "--model.num_layers",
            str(args.layers),
            "--model.hidden_size",
            str(args.hidden),
            "--model.intermediate_size",
            str(args.ffn),
            "--model.vocab_size",
            str(args.vocab),
            "--train.seq_len",
            str(args.seq_len),
            "--train.micro_batch_size",
            str(args.micro_batch_size),
            "--train.global_batch_size",
            str(max(args.micro_batches + [pp]) * args.micro_batch_size),
            *overrides,
        ]
    )


def setup(args: argparse.Namespace, pp: int):
    """Config, context and this rank's stage."""
    cfg = config(args, pp)
    ctx = ParallelContext.from_config(cfg)
    return cfg, ctx, build_model(cfg, ctx)


def batch(cfg, m: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same random (m*mbs, s) inputs and labels on every rank."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (m * cfg.train.micro_batch_size, cfg.train.seq_len + 1), generator=gen
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def run_ours(executor: PipelineExecutor, model, cfg, ctx, m: int, step: int) -> float:
    """One 1F1B/GPipe step through our executor; the loss (mean over micro-batches) on the last stage."""
    inputs, labels = batch(cfg, m, step)
    mbs = cfg.train.micro_batch_size
    ys = labels.split(mbs)
    loss = executor.run(
        model, lambda out, mb: vocab_parallel_cross_entropy(out, ys[mb], ctx.tp_group) / m, list(inputs.split(mbs))
    )
    model.zero_grad(set_to_none=True)
    return loss.item()


def timed(ctx, fn):
    """(own seconds, makespan seconds, result) of fn() started together on every stage."""
    dist.barrier(group=ctx.pp_group)
    start = time.perf_counter()
    result = fn()
    own = time.perf_counter() - start
    dist.barrier(group=ctx.pp_group)
    return own, time.perf_counter() - start, result


def measure_bubble(args, cfg, ctx, model, m: int) -> dict:
    """Medians over the measured 1F1B steps of this stage's wait/step, idle/step, step and busy seconds."""
    act_shape = (cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.hidden_size)
    executor = PipelineExecutor(ctx, "1f1b", m, act_shape, torch.float32)
    rows = []
    for i in range(args.warmup + args.steps):
        own, step, _ = timed(ctx, lambda: run_ours(executor, model, cfg, ctx, m, i))
        busy = own - executor.wait_s
        if i >= args.warmup:
            rows.append({"wait": executor.wait_s / step, "idle": (step - busy) / step, "step": step, "busy": busy})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def measure_memory(args, cfg, ctx, model) -> dict:
    """Peak saved-activation bytes of one step of each schedule on this stage, and its micro-batches in flight."""
    act_shape = (cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.hidden_size)
    out = {}
    for name in ("gpipe", "1f1b"):
        executor = PipelineExecutor(ctx, name, args.memory_m, act_shape, torch.float32)
        tracker = SavedActivations(model)
        with tracker.hooks():
            run_ours(executor, model, cfg, ctx, args.memory_m, 0)
        out[name] = (tracker.peak, max_in_flight(build(name, ctx.pp, args.memory_m, ctx.pp_rank)))
    return out


def torch_1f1b(cfg, ctx, model, m: int) -> Schedule1F1B:
    """torch's PipelineStage around the same module, static metadata, unscaled loss and scale_grads=True."""
    mbs, s, h = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.hidden_size
    x = torch.zeros(mbs, s, dtype=torch.long) if ctx.is_first_stage else torch.empty(mbs, s, h, requires_grad=True)
    y = torch.empty(mbs, s, cfg.model.vocab_size if ctx.is_last_stage else h, requires_grad=True)
    stage = PipelineStage(model, ctx.pp_rank, ctx.pp, ctx.device, input_args=x, output_args=y, group=ctx.pp_group)
    return Schedule1F1B(stage, m, loss_fn=lambda out, target: vocab_parallel_cross_entropy(out, target, ctx.tp_group))


def run_theirs(schedule: Schedule1F1B, model, cfg, ctx, m: int, step: int) -> float:
    """The same step through torch's schedule; the mean loss on the last stage."""
    inputs, labels = batch(cfg, m, step)
    losses: list[torch.Tensor] = []
    schedule.step(
        *([inputs] if ctx.is_first_stage else []), **({"target": labels, "losses": losses} if ctx.is_last_stage else {})
    )
    model.zero_grad(set_to_none=True)
    return torch.stack(losses).mean().item() if losses else 0.0


def compare_torch(args, cfg, ctx, model) -> dict:
    """Makespans of ours and torch's 1F1B, alternating which goes first, on the same batches."""
    m = args.compare_m
    act_shape = (cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.hidden_size)
    executor, schedule = PipelineExecutor(ctx, "1f1b", m, act_shape, torch.float32), torch_1f1b(cfg, ctx, model, m)
    runs = {
        "ours": lambda i: run_ours(executor, model, cfg, ctx, m, i),
        "torch": lambda i: run_theirs(schedule, model, cfg, ctx, m, i),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    loss_diff = 0.0
    for i in range(args.warmup + args.compare_steps):
        losses = {}
        for name in ("ours", "torch") if i % 2 == 0 else ("torch", "ours"):
            _, step, losses[name] = timed(ctx, lambda: runs[name](i))
            if i >= args.warmup:
                times[name].append(step)
        loss_diff = max(loss_diff, abs(losses["ours"] - losses["torch"]))
    return {**times, "loss_diff": loss_diff}


def rank_main(args: argparse.Namespace) -> dict:
    """One forked rank: the measurements of tables a, b (at --memory-pp) and c for this pp."""
    world = dist.get_world_size()
    cfg, ctx, model = setup(args, world)
    return {
        "bubble": {m: measure_bubble(args, cfg, ctx, model, m) for m in args.micro_batches if m >= world},
        "memory": measure_memory(args, cfg, ctx, model) if world == args.memory_pp else None,
        "torch": compare_torch(args, cfg, ctx, model),
    }


def spawn(world: int, args: argparse.Namespace) -> list[dict]:
    """Fork `world` ranks with one torch thread each and return each rank's results, by stage."""
    return run_ranks(rank_main, world, args, timeout_s=600, threads=1)


def print_tables(results: dict[int, list[dict]], args: argparse.Namespace) -> None:
    mib = 2**20
    print(
        "\na) bubble per stage, our 1F1B (medians; wait = executor.wait_s/step, idle adds the tail after a "
        "stage's last op)"
    )
    print(f"{'pp':>3} {'m':>3} {'stage':>5} {'theory':>7} {'wait':>7} {'idle':>7} {'step ms':>8} {'busy ms':>8}")
    for pp, ranks in results.items():
        for m in ranks[0]["bubble"]:
            for stage, r in enumerate(ranks):
                b = r["bubble"][m]
                print(
                    f"{pp:>3} {m:>3} {stage:>5} {(pp - 1) / (m + pp - 1):>7.3f} {b['wait']:>7.3f} "
                    f"{b['idle']:>7.3f} {b['step'] * 1e3:>8.1f} {b['busy'] * 1e3:>8.1f}"
                )
    if args.memory_pp in results:
        print(
            f"\nb) peak saved activations per stage, pp={args.memory_pp} m={args.memory_m} (MiB; in flight = "
            "max micro-batches forwarded, not yet backwarded)"
        )
        print(f"{'stage':>5} {'GPipe':>8} {'1F1B':>8} {'1F1B/GPipe':>10} {'in flight':>10} {'expected':>8}")
        for stage, r in enumerate(results[args.memory_pp]):
            (g, g_fly), (o, o_fly) = r["memory"]["gpipe"], r["memory"]["1f1b"]
            print(
                f"{stage:>5} {g / mib:>8.2f} {o / mib:>8.2f} {o / g:>10.3f} {f'{o_fly}/{g_fly}':>10} "
                f"{o_fly / g_fly:>8.3f}"
            )
    print(
        f"\nc) step time, our 1F1B vs torch.distributed.pipelining.Schedule1F1B, m={args.compare_m} "
        f"(medians over {args.compare_steps} alternating steps; ratio: median of ours/torch per step pair)"
    )
    print(f"{'pp':>3} {'ours ms':>8} {'torch ms':>8} {'ours/torch':>10} {'max |loss diff|':>15}")
    for pp, ranks in results.items():
        c = ranks[0]["torch"]
        ratio = statistics.median(o / t for o, t in zip(c["ours"], c["torch"]))
        print(
            f"{pp:>3} {statistics.median(c['ours']) * 1e3:>8.1f} {statistics.median(c['torch']) * 1e3:>8.1f} "
            f"{ratio:>10.3f} {c['loss_diff']:>15.2e}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"{model_line(args)}; {args.warmup} warmup step(s) before each measurement")
    start = time.perf_counter()
    results = {pp: spawn(pp, args) for pp in args.pp}
    print_tables(results, args)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
