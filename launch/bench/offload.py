"""What offload saves on a GPU, from the planner: device and host bytes per rank with and without offload.

    python launch/bench/offload.py [--config configs/llama-3.1-8b.yaml] [--world-size 8] [--tp 1] [--pp 1]
        [--set section.key=value ...]

For each dp mode that has an offload (fsdp with resharding, ZeRO-1/2/3), the planned peak device bytes of the
worst pipeline stage (engine/planning/planner.py stage_memory: model state, activations, buffers) and the host
bytes (parallel.offload's share: engine/planning/planner.py _offloaded), first without offload, then with it.
On a CPU-only machine host and device are one memory, so these are planned figures, not measured ones.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config import load  # noqa: E402
from engine.planning.planner import plan_memory, with_layout  # noqa: E402

MODES = [("fsdp", 0, "optimizer_and_params"), ("zero", 1, "optimizer"), ("zero", 2, "optimizer"),
         ("zero", 3, "optimizer"), ("zero", 3, "optimizer_and_params")]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/llama-3.1-8b.yaml")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="section.key=value")
    args = ap.parse_args(argv)
    extra = [a for kv in args.set for a in ("--" + kv.partition("=")[0], kv.partition("=")[2])]
    cfg = load(["--config", args.config, "--parallel.backend", "nccl", *extra])
    dp = args.world_size // (args.tp * args.pp)
    print(f"{cfg.model.name}: {args.world_size} GPUs, tp {args.tp} pp {args.pp} dp {dp}, {cfg.train.dtype}, "
          f"seq {cfg.train.seq_len}, micro-batch {cfg.train.micro_batch_size}; GB per rank (worst stage)")
    print(f"{'dp mode':>8} {'offload':>21} {'device':>8} {'host':>8} {'state':>8}")
    for i, (mode, stage, offload) in enumerate(MODES):
        same_mode = i and MODES[i - 1][:2] == (mode, stage)
        for off in (offload,) if same_mode else ("none", offload):
            c = with_layout(cfg, tp=args.tp, pp=args.pp, dp=dp, dp_mode=mode, zero_stage=stage, offload=off,
                            reshard_after_forward="true")
            mem = plan_memory(c, args.world_size)
            worst = max(mem, key=lambda s: s.total)
            name = mode + (f"-{stage}" if stage else "")
            print(f"{name:>8} {off:>21} {worst.total / 1e9:8.2f} {max(s.host for s in mem) / 1e9:8.2f} "
                  f"{worst.state / 1e9:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
