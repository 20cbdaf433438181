"""What offload saves on a GPU, from the planner: device and host bytes per rank with and without offload.

    python launch/bench/offload.py [--config configs/llama-3.1-8b.yaml] [--world-size 8] [--tp 1] [--pp 1]
        [--set section.key=value ...]

For each dp mode that has an offload (fsdp with resharding, ZeRO-1/2/3), the planned peak device bytes of the
worst pipeline stage (engine/planning/planner.py stage_memory: model state, activations, buffers) and the host
bytes (parallel.offload's share: engine/planning/planner.py _offloaded), first without offload, then with it.
On a CPU-only machine host and device are one memory, so these are planned figures, not measured ones.

    python launch/bench/offload.py --compare

instead trains a small model 4 steps on 2 forked gloo ranks under zero-2 (offload optimizer), zero-3 (optimizer
and parameters) and fsdp (CPUOffloadPolicy), each with and without offload, ZeRO's with DeepSpeedCPUAdam and with
the torch AdamW fallback, and prints the worst relative error of the losses, grad norms and final parameters
(|got - want| / |want - initial|) against the same mode without offload, and the seconds of each run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config import load  # noqa: E402
from engine.planning.planner import plan_memory, with_layout  # noqa: E402

SMALL = [
    "--config",
    "configs/tiny.yaml",
    "--model.num_layers",
    "4",
    "--model.hidden_size",
    "64",
    "--model.intermediate_size",
    "128",
    "--train.seq_len",
    "16",
    "--train.micro_batch_size",
    "1",
    "--train.global_batch_size",
    "8",
    "--train.steps",
    "4",
    "--train.warmup_steps",
    "2",
    "--train.grad_clip",
    "0.5",
    "--log.progress",
    "false",
    "--log.breakdown",
    "false",
    "--parallel.dp",
    "2",
]

MODES = [
    ("fsdp", 0, "optimizer_and_params"),
    ("zero", 1, "optimizer"),
    ("zero", 2, "optimizer"),
    ("zero", 3, "optimizer"),
    ("zero", 3, "optimizer_and_params"),
]


def _train(argv: list[str], fallback: bool) -> dict:
    """Rank function: train; losses, grad norms, initial and final fp32 parameters, optimizer name, seconds."""
    import time

    from engine.parallel.layout.context import ParallelContext
    from engine.trainer import Trainer

    if fallback:  # what a machine without the C++ op gets
        import deepspeed.ops.adam as ds_adam

        class Unavailable:  # a class still: DeepSpeed checks isinstance(optimizer, DeepSpeedCPUAdam)
            def __init__(self, *args, **kwargs):
                raise RuntimeError("DeepSpeedCPUAdam switched off by --compare")

        ds_adam.DeepSpeedCPUAdam = Unavailable
    start = time.perf_counter()
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    init = trainer.dp.full_parameters()
    history = trainer.fit()
    opt = type(getattr(getattr(trainer.dp, "engine", None), "basic_optimizer", trainer.dp.optimizer)).__name__
    return {
        "loss": [r["loss"] for r in history],
        "grad_norm": [r["grad_norm"] for r in history],
        "init": init,
        "params": trainer.dp.full_parameters(),
        "opt": opt,
        "s": time.perf_counter() - start,
    }


def compare() -> None:
    from engine.parallel.layout.spawn import run_ranks

    for mode, offload in (
        (["--parallel.dp_mode", "zero", "--parallel.zero_stage", "2"], "optimizer"),
        (["--parallel.dp_mode", "zero", "--parallel.zero_stage", "3"], "optimizer_and_params"),
        (["--parallel.dp_mode", "fsdp"], "optimizer_and_params"),
    ):
        want = run_ranks(_train, 2, [*SMALL, *mode], False, timeout_s=900)[0]
        for fallback in (False, True) if "zero" in mode else (False,):
            got = run_ranks(_train, 2, [*SMALL, *mode, "--parallel.offload", offload], fallback, timeout_s=900)[0]
            err = {k: max(abs(g - w) / abs(w) for g, w in zip(got[k], want[k])) for k in ("loss", "grad_norm")}
            err["params"] = max(
                float((got["params"][n] - w).norm() / (w - want["init"][n]).norm()) for n, w in want["params"].items()
            )
            print(
                f"{' '.join(mode[1::2]):>9} offload={offload:<20} {got['opt']:>16}: loss {err['loss']:.1e}, "
                f"grad norm {err['grad_norm']:.1e}, params {err['params']:.1e}; {got['s']:.1f} s "
                f"(without offload {want['s']:.1f} s)",
                flush=True,
            )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/llama-3.1-8b.yaml")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="section.key=value")
    ap.add_argument("--compare", action="store_true", help="train with and without offload on 2 CPU ranks")
    args = ap.parse_args(argv)
    if args.compare:
        compare()
        return 0
    extra = [a for kv in args.set for a in ("--" + kv.partition("=")[0], kv.partition("=")[2])]
    cfg = load(["--config", args.config, "--parallel.backend", "nccl", *extra])
    dp = args.world_size // (args.tp * args.pp)
    print(
        f"{cfg.model.name}: {args.world_size} GPUs, tp {args.tp} pp {args.pp} dp {dp}, {cfg.train.dtype}, "
        f"seq {cfg.train.seq_len}, micro-batch {cfg.train.micro_batch_size}; GB per rank (worst stage)"
    )
    print(f"{'dp mode':>8} {'offload':>21} {'device':>8} {'host':>8} {'state':>8}")
    for i, (mode, stage, offload) in enumerate(MODES):
        same_mode = i and MODES[i - 1][:2] == (mode, stage)
        for off in (offload,) if same_mode else ("none", offload):
            c = with_layout(
                cfg,
                tp=args.tp,
                pp=args.pp,
                dp=dp,
                dp_mode=mode,
                zero_stage=stage,
                offload=off,
                reshard_after_forward="true",
            )
            mem = plan_memory(c, args.world_size)
            worst = max(mem, key=lambda s: s.total)
            name = mode + (f"-{stage}" if stage else "")
            print(
                f"{name:>8} {off:>21} {worst.total / 1e9:8.2f} {max(s.host for s in mem) / 1e9:8.2f} "
                f"{worst.state / 1e9:8.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
