"""Benchmark: our tensor parallelism against DTensor's, and planned against measured memory per rank.

    python launch/bench/tp.py [--config configs/tiny.yaml] [--tp 2] [--steps 20] [--memory-config ...] [--tables abcd]

a) Step time (forward + backward) at tp ranks (forked, gloo, one torch thread each) of our Megatron-style layers
   (engine/parallel/tp/layers.py, vocab-parallel loss) against the same engine/model/transformer.py modules parallelised
   by torch.distributed.tensor.parallel.parallelize_module with torchtitan's Llama plan (ColwiseParallel q/k/v and
   gate/up, RowwiseParallel o/down, RowwiseParallel vocab-sharded embedding, ColwiseParallel LM head kept sharded for
   loss_parallel), from the same initial weights, on the same random batches, the two alternating step by step. Printed:
   median step times and the median over step pairs of ours / DTensor (< 1: ours is faster), and the largest difference
   of their losses.
b) Per-rank memory of a few layouts, measured by launch/bench/measure.py on the Trainer's third step, next
   to engine.planning.planner.stage_memory's plan for the same rank: model state, peak saved activations, step peak.
c) Sequence parallelism (parallel.sequence_parallel): peak bytes saved for backward per rank at tp 2 and 4, without
   and with it, measured the same way as b) next to the plan (engine/planning/activations.py), and the measured
   saving. The residual stream, the norms and the layer inputs are (b, s/tp, h) with it (Korthikanti et al. 2022).
d) Collectives per decoder layer, forward and backward, at the tp sizes of c) without and with sequence parallelism
   and with activation checkpointing none and full: calls of each kind and bytes per token, counted on the c10d
   calls, next to Megatron-LM's design and the counts before the q/k/v, gate/up fusion
   (launch/bench/tp_collectives.py, which also runs alone; tests/parallel/tp/test_tp_collectives.py asserts the counts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module  # noqa: E402

from engine.config import load  # noqa: E402
from engine.model import transformer as model_lib  # noqa: E402
from engine.model.fused import FusedLinear, interleave  # noqa: E402
from engine.model.init import materialize  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.parallel.tp.layers import LAYER_PLAN, vocab_parallel_cross_entropy  # noqa: E402
from engine.planning.planner import stage_memory  # noqa: E402
from engine.trainer import build_model  # noqa: E402
from launch.bench.measure import measure_rank  # noqa: E402
from launch.bench.tp_collectives import print_collectives  # noqa: E402

MEMORY_LAYOUTS = {
    "tp2": (2, ["--parallel.tp", "2"]),
    "pp2-1f1b": (2, ["--parallel.pp", "2"]),
    "pp2-gpipe": (2, ["--parallel.pp", "2", "--parallel.schedule", "gpipe"]),
    "fsdp2-keep": (2, ["--parallel.dp_mode", "fsdp", "--parallel.reshard_after_forward", "false"]),
    "checkpointing": (1, ["--train.activation_checkpointing", "true"]),
    "tp2-sp": (2, ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    "tp4-sp": (4, ["--parallel.tp", "4", "--parallel.sequence_parallel", "true"]),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs/tiny.yaml"), help="model for table a")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="measured steps of each, alternating")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--memory-config", default=str(ROOT / "configs/tiny.yaml"), help="model for table b")
    p.add_argument("--memory-layouts", nargs="*", default=list(MEMORY_LAYOUTS), choices=list(MEMORY_LAYOUTS))
    p.add_argument("--sp-tp", nargs="*", type=int, default=[2, 4], help="tp sizes of tables c and d")
    p.add_argument("--tables", default="abcd", help="which tables to print (a, b, c, d)")
    return p.parse_args(argv)


def dtensor_model(cfg, mesh) -> torch.nn.Module:
    """The unsharded engine model with our initial weights, parallelised by DTensor (torchtitan's plan, without
    sequence parallelism, which our layers do not do either)."""
    model = materialize(model_lib.build(cfg.model), torch.device("cpu"), cfg.train.seed, cfg.model.init_std)
    with torch.no_grad():  # fused q/k/v, gate/up: DTensor's contiguous row chunks must be [q_r; k_r; v_r] as ours
        for module in model.modules():
            if isinstance(module, FusedLinear):
                for p in (module.weight, module.bias):
                    if p is not None:
                        p.copy_(interleave(p.detach().clone(), module.parts, mesh.size()))
    styles = {"column": ColwiseParallel, "row": RowwiseParallel}
    layer_plan = {path: styles[style]() for path, style in LAYER_PLAN.items()}  # the same table as ours
    for layer in model.model.layers.values():
        parallelize_module(layer, mesh, layer_plan)
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )
    return model


def batch(cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same random (mbs, s) inputs and labels on every rank."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def step_ours(model, ctx, x, y) -> float:
    loss = vocab_parallel_cross_entropy(model(x), y, ctx.tp_group)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def step_dtensor(model, x, y) -> float:
    with loss_parallel():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()


def compare_tp(args: argparse.Namespace) -> dict:
    """Rank function: both models on this tp rank, timed alternately between barriers."""
    cfg = load(
        [
            "--config",
            args.config,
            "--parallel.tp",
            str(args.tp),
            "--train.seq_len",
            str(args.seq_len),
            "--train.micro_batch_size",
            str(args.micro_batch_size),
            "--train.global_batch_size",
            str(args.micro_batch_size),
        ]
    )
    ctx = ParallelContext.from_config(cfg)
    ours, theirs = build_model(cfg, ctx), dtensor_model(cfg, ctx.mesh["tp"])
    runs = {"ours": lambda x, y: step_ours(ours, ctx, x, y), "dtensor": lambda x, y: step_dtensor(theirs, x, y)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    loss_diff = 0.0
    for i in range(args.warmup + args.steps):
        x, y = batch(cfg, i)
        losses = {}
        for name in ("ours", "dtensor") if i % 2 == 0 else ("dtensor", "ours"):
            dist.barrier(group=ctx.tp_group)
            start = time.perf_counter()
            losses[name] = runs[name](x, y)
            dist.barrier(group=ctx.tp_group)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
        loss_diff = max(loss_diff, abs(losses["ours"] - losses["dtensor"]))
    return {**times, "loss_diff": loss_diff, "params_M": model_lib.count_params(theirs) / 1e6}


def print_tp(args: argparse.Namespace, result: dict) -> None:
    ratio = statistics.median(o / d for o, d in zip(result["ours"], result["dtensor"]))
    print(
        f"\na) tensor parallel, forward + backward of one micro-batch ({args.micro_batch_size} x {args.seq_len} "
        f"tokens), {Path(args.config).name} ({result['params_M']:.1f}M), tp={args.tp}, gloo, 1 thread per rank; "
        f"medians of {args.steps} alternating steps"
    )
    print(f"{'ours ms':>8} {'DTensor ms':>10} {'ours/DTensor':>12} {'max |loss diff|':>15}")
    print(
        f"{statistics.median(result['ours']) * 1e3:>8.1f} {statistics.median(result['dtensor']) * 1e3:>10.1f} "
        f"{ratio:>12.3f} {result['loss_diff']:>15.2e}"
    )


def print_memory(args: argparse.Namespace) -> None:
    base = ["--config", args.memory_config, "--log.progress", "false"]
    print(
        f"\nb) memory per rank, planned (engine/planning/planner.py) vs measured (engine/metrics/memory.py), "
        f"{Path(args.memory_config).name}, MB (1e6 bytes); ratios are measured / planned"
    )
    print(
        f"{'layout':<14} {'stage':>5} {'state':>8} {'ratio':>6} {'saved act':>9} {'ratio':>6} {'peak':>8} {'ratio':>6}"
    )
    for name in args.memory_layouts:
        world, extra = MEMORY_LAYOUTS[name]
        with tempfile.TemporaryDirectory() as out:
            argv = base + extra + ["--train.out_dir", out]
            cfg = load(argv)
            for got in run_ranks(measure_rank, world, argv, threads=1, timeout_s=600):
                if got["tp_rank"] != 0:
                    continue  # tp peers hold the same amounts
                plan = stage_memory(cfg, world, got["stage"])
                state = got["params"] + got["grads"] + got["optimizer"]
                act = (
                    "-"
                    if cfg.train.activation_checkpointing != "none"
                    else f"{got['activations'] / plan.activations:.3f}"
                )
                print(
                    f"{name:<14} {got['stage']:>5} {state / 1e6:>8.2f} {state / plan.state:>6.3f} "
                    f"{got['activations'] / 1e6:>9.2f} {act:>6} {got['peak'] / 1e6:>8.2f} "
                    f"{got['peak'] / plan.total:>6.3f}",
                    flush=True,
                )


def saved_activations(argv: list[str], world: int) -> tuple[float, float]:
    """(measured, planned) peak bytes saved for backward on tp rank 0 of stage 0 (launch/bench/measure.py)."""
    with tempfile.TemporaryDirectory() as out:
        argv = argv + ["--train.out_dir", out]
        got = next(
            g
            for g in run_ranks(measure_rank, world, argv, threads=1, timeout_s=600)
            if g["tp_rank"] == 0 and g["stage"] == 0
        )
    return got["activations"], stage_memory(load(argv), world, 0).activations


def print_sequence_parallel(args: argparse.Namespace) -> None:
    base = ["--config", args.memory_config, "--log.progress", "false"]
    cfg = load(base)
    t = cfg.train
    print(
        f"\nc) saved activations per rank (peak, MB), tp without and with sequence parallelism, measured / planned; "
        f"{Path(args.memory_config).name}, {t.micro_batch_size} x {t.seq_len} tokens per micro-batch, "
        f"{cfg.model.num_layers} layers, {t.dtype}, activation_checkpointing {t.activation_checkpointing}"
    )
    print(
        f"{'tp':>3} {'tp MB':>8} {'planned':>8} {'ratio':>6} {'tp+sp MB':>9} {'planned':>8} {'ratio':>6} {'sp / tp':>7}"
    )
    for tp in args.sp_tp:
        layout = base + ["--parallel.tp", str(tp), "--train.global_batch_size", str(t.micro_batch_size)]
        plain = saved_activations(layout, tp)
        sp = saved_activations(layout + ["--parallel.sequence_parallel", "true"], tp)
        print(
            f"{tp:>3} {plain[0] / 1e6:>8.2f} {plain[1] / 1e6:>8.2f} {plain[0] / plain[1]:>6.3f} "
            f"{sp[0] / 1e6:>9.2f} {sp[1] / 1e6:>8.2f} {sp[0] / sp[1]:>6.3f} {sp[0] / plain[0]:>7.3f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.pop("MASTER_ADDR", None)
    torch.set_num_threads(1)  # the parent forks ranks: keep it single-threaded (tests/conftest.py says why)
    start = time.perf_counter()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores")
    if "a" in args.tables:
        print_tp(args, run_ranks(compare_tp, args.tp, args, threads=1, timeout_s=600)[0])
    if args.memory_layouts and "b" in args.tables:
        print_memory(args)
    if args.sp_tp and "c" in args.tables:
        print_sequence_parallel(args)
    if args.sp_tp and "d" in args.tables:
        print_collectives(args.memory_config, args.sp_tp, micro_batch_size=2, seq_len=16)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
