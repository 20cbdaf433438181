"""Plan a run: per-rank memory and step time of every valid layout on N devices, ranked.

    python launch/plan.py --config configs/llama-3.2-1b.yaml --world-size 8 --device-memory 80 [--global-batch 512]
        [--top 15] [--json] [--device "NVIDIA H100 80GB HBM3" | --peak-tflops 989] [--efficiency 0.5]
        [--gpus-per-node 8] [--intra-node-gbps 450] [--inter-node-gbps 50] [--set section.key=value ...]

Layouts are (tp, pp, dp, dp mode, micro-batch size, activation checkpointing); the config fixes the model,
sequence length, dtype and schedule. Memory: engine/planning/planner.py (checked against measured memory on CPU in
tests/test_planner.py); time: engine/planning/search.py. Layouts that fit in --device-memory come first, fastest
first. A bad argument exits with status 2 and one line `error: ...`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engine.config import ConfigError, load  # noqa: E402
from engine.planning.flops import peak_tflops  # noqa: E402
from engine.planning.search import Hardware, search  # noqa: E402

COLUMNS = [("tp", "{}"), ("pp", "{}"), ("dp", "{}"), ("dp_mode", "{}"), ("micro_batch_size", "{}"),
           ("micro_batches", "{}"), ("activation_checkpointing", "{}"), ("peak_memory_gb", "{:.2f}"),
           ("step_s", "{:.3f}"), ("tokens_per_s", "{:,.0f}"), ("mfu", "{:.1%}"), ("bubble_s", "{:.3f}"),
           ("tp_comm_s", "{:.3f}"), ("pp_comm_s", "{:.3f}"), ("dp_comm_s", "{:.3f}")]
HEADER = ["tp", "pp", "dp", "dp mode", "mbs", "m", "ac", "mem GB", "step s", "tokens/s", "MFU", "bubble", "tp s",
          "pp s", "dp s"]


class ArgumentError(ValueError):
    """A bad command-line argument; the message is one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit 2; we want our one-line form
        raise ArgumentError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--world-size", type=int, required=True, help="number of devices (ranks)")
    p.add_argument("--device-memory", type=float, required=True, help="GB (1e9 bytes) per device")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the config's)")
    p.add_argument("--top", type=int, default=15, help="rows to print (0: all)")
    p.add_argument("--json", action="store_true", help="print every planned layout as JSON")
    p.add_argument("--device", default="NVIDIA H100 80GB HBM3", help="device name for the peak-FLOPs table")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="overrides the table (TFLOP/s per device)")
    p.add_argument("--efficiency", type=float, default=0.5, help="fraction of the peak the matmuls achieve")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s per device inside a node")
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per device between nodes")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override, e.g. --set train.seq_len=4096 (repeatable)")
    return p.parse_args(argv)


def hardware(args: argparse.Namespace, dtype: str) -> Hardware:
    """The Hardware of the arguments; every value is checked here so that errors name the flag."""
    for flag in ("world_size", "device_memory", "efficiency", "gpus_per_node", "intra_node_gbps",
                 "inter_node_gbps"):
        if getattr(args, flag) <= 0:
            raise ArgumentError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be > 0")
    if args.efficiency > 1:
        raise ArgumentError(f"--efficiency={args.efficiency} must be in (0, 1]")
    peak = args.peak_tflops or peak_tflops(args.device, dtype)
    if not peak:
        raise ArgumentError(f"no {dtype} peak known for --device={args.device!r}; give --peak-tflops")
    return Hardware(peak_tflops=peak, efficiency=args.efficiency, memory_gb=args.device_memory,
                    gpus_per_node=args.gpus_per_node, intra_node_gbps=args.intra_node_gbps,
                    inter_node_gbps=args.inter_node_gbps)


def config_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--config", args.config]
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise ArgumentError(f"--set {item!r} is not SECTION.KEY=VALUE")
        argv += [f"--{key}", value]
    if args.global_batch is not None:
        argv += ["--train.global_batch_size", str(args.global_batch)]
    return argv


def table(rows: list[dict]) -> str:
    """Right-aligned columns, each as wide as its widest cell."""
    cells = [HEADER] + [[fmt.format(("yes" if row[k] else "no") if isinstance(row[k], bool) else row[k]).strip()
                         for k, fmt in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = load(config_argv(args))
    # TF32 is not the default for fp32 matmuls in torch, so an fp32 run is planned at the fp32 peak.
    hw = hardware(args, "bf16" if cfg.train.dtype == "bf16" else "fp32")
    plans = search(cfg, args.world_size, hw)
    if not plans:
        raise ArgumentError(f"no valid layout of {cfg.model.name} on --world-size={args.world_size} with global "
                            f"batch {cfg.train.global_batch_size}; try a world size that divides it")
    fitting = [p for p in plans if p.fits]
    if args.json:
        print(json.dumps([p.describe() for p in plans], indent=1))  # all of them; "fits" says which fit
        return 0
    if not fitting:
        best = min(plans, key=lambda p: p.peak_bytes)
        raise ArgumentError(f"no layout fits in --device-memory={args.device_memory:g} GB; the smallest needs "
                            f"{best.peak_bytes / 1e9:.1f} GB ({best.describe()['dp_mode']}, tp={best.layout.tp}, "
                            f"pp={best.layout.pp}, micro-batch {best.cfg.train.micro_batch_size})")
    print(f"{cfg.model.name}: seq_len {cfg.train.seq_len}, global batch {cfg.train.global_batch_size}, "
          f"{cfg.train.dtype}, {cfg.parallel.schedule}; {args.world_size} devices of {args.device_memory:g} GB, "
          f"{hw.peak_tflops:g} TFLOP/s at {hw.efficiency:.0%}; {len(fitting)} of {len(plans)} valid layouts fit")
    print(table([p.describe() for p in fitting[:args.top or None]]))
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except (ConfigError, ArgumentError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)
