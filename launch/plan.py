"""Plan a run: per-rank memory and step time of every valid layout on N devices, ranked.

    python launch/plan.py --config configs/llama-3.2-1b.yaml --world-size 8 --device-memory 80 [--global-batch 512]
        [--top 15] [--json] [--device "NVIDIA H100 80GB HBM3" | --peak-tflops 989]
        [--efficiency 0.55 | --efficiency-from step.json]
        [--gpus-per-node 8] [--intra-node-gbps 450] [--inter-node-gbps 50] [--hbm-gbps 3350]
        [--set section.key=value ...]
        [--section.key value ...]

Layouts are (tp, pp, dp, cp, cp mode, ep, sp, dp mode, micro-batch size, activation checkpointing, pipeline schedule;
ep: expert parallelism for an MoE model, engine/planning/ep.py, its all-to-all time in "ep s"; sp: sequence
parallelism, tried on and off at tp > 1); the config fixes
the model, sequence length and dtype. The schedule is searched too (1f1b, interleaved with 2-4 virtual stages,
zero_bubble, zbv: engine/planning/schedules.py SEARCHED) unless the config file or the command line sets
parallel.schedule or parallel.virtual_stages, e.g. `--parallel.schedule interleaved --parallel.virtual_stages 2`.
With `--parallel.pp_layers auto` every pp is planned with its balanced split (engine/planning/balance.py; the
--json rows give each layout's pp_layers), else with the even one, or the balanced one where interleaved or zbv cannot
cut pp*v equal chunks (Llama 3 405B's 126 layers at pp 16).
Memory: engine/planning/planner.py (checked against measured memory on CPU in tests/planning/test_planner.py); time:
engine/planning/search.py, the bubble from simulating the schedule. Layouts that fit in --device-memory come
first, fastest first; only the layouts that a lower bound on the step time leaves in reach of the --top fastest are
planned in full (engine/planning/search.py; --json and --top 0 plan every one). Offload (parallel.offload: host
memory for the optimizer, or also the parameters) is tried only when no layout fits without it; "host GB" is what a
rank then keeps in host memory (step time leaves out the host copies and the host Adam step). A bad argument exits
with status 2 and one line `error: ...`.
Efficiency (the fraction of the peak the matmuls achieve; bubbles and exposed communication come on top): the
--device kind's default (engine/planning/devices.py: A100, H100, H200, CPU, each with its source, calibrated on the
published runs of tests/planning/data/published.json), or --efficiency-from the file `launch/bench/step.py --side ours
--json-out F` wrote on one such device.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engine.config import ConfigError, ParallelConfig, load  # noqa: E402
from engine.kinds.schedules import SCHEDULES  # noqa: E402
from engine.model.flops import peak_tflops  # noqa: E402
from engine.planning.devices import KINDS, default_efficiency, device_kind, hbm_gbps  # noqa: E402
from engine.planning.schedules import SEARCHED, label  # noqa: E402
from engine.planning.search import Hardware, search  # noqa: E402

COLUMNS = [
    ("tp", "{}"),
    ("pp", "{}"),
    ("dp", "{}"),
    ("cp", "{}"),
    ("cp_mode", "{}"),
    ("ep", "{}"),
    ("sp", "{}"),
    ("dp_mode", "{}"),
    ("schedule", "{}"),
    ("micro_batch_size", "{}"),
    ("micro_batches", "{}"),
    ("activation_checkpointing", "{}"),
    ("peak_memory_gb", "{:.2f}"),
    ("step_s", "{:.3f}"),
    ("tokens_per_s", "{:,.0f}"),
    ("mfu", "{:.1%}"),
    ("bubble_fraction", "{:.1%}"),
    ("activation_gb_per_stage", "{}"),
    ("tp_comm_s", "{:.3f}"),
    ("pp_comm_s", "{:.3f}"),
    ("dp_comm_s", "{:.3f}"),
    ("cp_comm_s", "{:.3f}"),
    ("ep_comm_s", "{:.3f}"),
    ("host_gb", "{:.2f}"),
]
HEADER = [
    "tp",
    "pp",
    "dp",
    "cp",
    "cp mode",
    "ep",
    "sp",
    "dp mode",
    "schedule",
    "mbs",
    "m",
    "ac",
    "mem GB",
    "step s",
    "tokens/s",
    "MFU",
    "bubble",
    "act GB/stage",
    "tp s",
    "pp s",
    "dp s",
    "cp s",
    "ep s",
    "host GB",
]
SCHEDULE_KEYS = ("parallel.schedule", "parallel.virtual_stages")
# The table's search takes seconds to ~30 s of CPU (8 to 16,384 devices), --json's minutes: say every few seconds
# that it is still going.
PROGRESS_EVERY_S = 5.0


class ArgumentError(ValueError):
    """A bad command-line argument; the message is one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit 2; we want our one-line form
        raise ArgumentError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags below; any ``--section.key value`` (or ``--section.key=value``) left over is a config override,
    as --set section.key=value is."""
    p = _Parser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--world-size", type=int, required=True, help="number of devices (ranks)")
    p.add_argument("--device-memory", type=float, required=True, help="GB (1e9 bytes) per device")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the config's)")
    p.add_argument("--top", type=int, default=15, help="rows to print (0: all)")
    p.add_argument("--json", action="store_true", help="print every planned layout as JSON")
    p.add_argument("--device", default="NVIDIA H100 80GB HBM3", help="device name for the peak-FLOPs table")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="overrides the table (TFLOP/s per device)")
    p.add_argument(
        "--efficiency",
        type=float,
        help="fraction of the peak the matmuls achieve (default: the --device kind's, engine/planning/devices.py)",
    )
    p.add_argument(
        "--efficiency-from",
        metavar="FILE",
        help="the efficiency launch/bench/step.py measured on one device (its --json-out file)",
    )
    p.add_argument("--gpus-per-node", type=int, help="default: the --device kind's node (devices.py)")
    p.add_argument("--intra-node-gbps", type=float, help="GB/s per device inside a node (default: the kind's)")
    p.add_argument("--inter-node-gbps", type=float, help="GB/s per device between nodes (default: the kind's)")
    p.add_argument(
        "--hbm-gbps",
        type=float,
        help="device memory GB/s for the element-wise kernels (default: the --device part's; 0: not modelled)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="config override, e.g. --set train.seq_len=4096 (repeatable)",
    )
    args, rest = p.parse_known_args(argv)
    args.overrides = []
    while rest:
        name, eq, value = rest.pop(0).partition("=")
        if not name.startswith("--") or "." not in name:
            raise ArgumentError(f"unrecognized argument {name!r}; config keys go as --section.key value")
        if not eq and not rest:
            raise ArgumentError(f"argument {name!r} has no value")
        args.overrides += [name, value if eq else rest.pop(0)]
    return args


def measured_efficiency(path: str) -> float:
    """The ``efficiency`` of launch/bench/step.py's --json-out file (hardware FLOP/s over the peak on one device)."""
    try:
        value = json.loads(Path(path).read_text()).get("efficiency")
    except (OSError, ValueError, AttributeError) as e:
        raise ArgumentError(f"--efficiency-from={path!r}: not a launch/bench/step.py --json-out file ({e})") from None
    if not (value is None or isinstance(value, (int, float))):
        raise ArgumentError(f"--efficiency-from={path!r}: efficiency={value!r} is not a number")
    if value is None:
        raise ArgumentError(
            f"--efficiency-from={path!r} has no efficiency (step.py ran where no peak is known: a CPU without "
            f"log.peak_tflops); give --efficiency"
        )
    return value


def efficiency(args: argparse.Namespace) -> float:
    """--efficiency, else --efficiency-from's measure, else the --device kind's default (devices.py)."""
    if args.efficiency is not None and args.efficiency_from:
        raise ArgumentError("give --efficiency or --efficiency-from, not both")
    if args.efficiency_from:
        return measured_efficiency(args.efficiency_from)
    if args.efficiency is not None:
        return args.efficiency
    value = default_efficiency(args.device)
    if value is None:
        known = ", ".join(KINDS)
        raise ArgumentError(f"no default efficiency for --device={args.device!r} (kinds: {known}); give --efficiency")
    return value


def hardware(args: argparse.Namespace, dtype: str) -> Hardware:
    """The Hardware of the arguments; every value is checked here so that errors name the flag."""
    args.efficiency = efficiency(args)
    kind = KINDS.get(device_kind(args.device) or "", Hardware())  # an unknown kind: Hardware's (an H100 node)
    for flag in ("gpus_per_node", "intra_node_gbps", "inter_node_gbps"):
        if getattr(args, flag) is None:
            setattr(args, flag, getattr(kind, flag))
    for flag in ("world_size", "device_memory", "efficiency", "gpus_per_node", "intra_node_gbps", "inter_node_gbps"):
        value = getattr(args, flag)
        if not (value > 0 and math.isfinite(value)):  # nan is not > 0
            raise ArgumentError(f"--{flag.replace('_', '-')}={value} must be > 0 and finite")
    if args.hbm_gbps is None:
        args.hbm_gbps = hbm_gbps(args.device)
    if not (args.hbm_gbps >= 0 and math.isfinite(args.hbm_gbps)):
        raise ArgumentError(f"--hbm-gbps={args.hbm_gbps} must be >= 0 and finite (GB/s per device; 0: not modelled)")
    if args.efficiency > 1:
        raise ArgumentError(f"--efficiency={args.efficiency} must be in (0, 1]")
    if not (args.peak_tflops >= 0 and math.isfinite(args.peak_tflops)):  # -5 divided the step time by zero
        raise ArgumentError(
            f"--peak-tflops={args.peak_tflops} must be > 0 and finite (TFLOP/s per device), or 0 for the --device table"
        )
    peak = args.peak_tflops or peak_tflops(args.device, dtype)
    if not peak:
        raise ArgumentError(f"no {dtype} peak known for --device={args.device!r}; give --peak-tflops")
    return Hardware(
        peak_tflops=peak,
        efficiency=args.efficiency,
        memory_gb=args.device_memory,
        gpus_per_node=args.gpus_per_node,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
        hbm_gbps=args.hbm_gbps,
    )


def config_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--config", args.config]
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise ArgumentError(f"--set {item!r} is not SECTION.KEY=VALUE")
        argv += [f"--{key}", value]
    argv += args.overrides
    if args.global_batch is not None:
        argv += ["--train.global_batch_size", str(args.global_batch)]
    return argv


def searched_schedules(args: argparse.Namespace, cfg) -> tuple | None:
    """None (plan the config's schedule) when the config file or the command line sets one, else SEARCHED."""
    given = [a.split("=")[0].lstrip("-") for a in config_argv(args)]
    if any(key in given for key in SCHEDULE_KEYS) or (cfg.parallel.schedule, cfg.parallel.virtual_stages) != (
        ParallelConfig.schedule,
        ParallelConfig.virtual_stages,
    ):  # not the defaults
        return None
    return SEARCHED


def cell(row: dict, key: str, fmt: str) -> str:
    value = row[key]
    if key == "cp_mode":  # no mode at cp 1: a dash keeps the columns split-able
        return value or "-"
    if key == "schedule":
        return label(value, row["virtual_stages"])
    if key == "activation_gb_per_stage":  # stage 0 first
        return "/".join(f"{gb:.2f}" for gb in value)
    return fmt.format(("yes" if value else "no") if isinstance(value, bool) else value).strip()


def table(rows: list[dict]) -> str:
    """Right-aligned columns, each as wide as its widest cell."""
    cells = [HEADER] + [[cell(row, k, fmt) for k, fmt in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


@contextlib.contextmanager
def progress(what: str):
    """While the body runs, a line on stderr every PROGRESS_EVERY_S seconds ('plan: searching ...: 10 s'), and
    how long it took if it said anything; a quicker body prints nothing. stdout (the table, --json) is untouched."""
    done, start, said = threading.Event(), time.monotonic(), []

    def beat():
        while not done.wait(PROGRESS_EVERY_S):
            said.append(True)
            print(f"plan: {what}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if said:
            print(f"plan: {what}: done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = load(config_argv(args))
    if cfg.parallel.backend == "auto":  # the devices planned for are CUDA ones (--device): plan their attention
        # kernel (engine/model/attention.py), not this machine's
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, backend="nccl"))
    # TF32 is not the default for fp32 matmuls in torch, so an fp32 run is planned at the fp32 peak.
    hw = hardware(args, "bf16" if cfg.train.dtype == "bf16" else "fp32")
    schedules, refused, counts = searched_schedules(args, cfg), [], {}
    top = 0 if args.json else args.top  # --top N: only the N best are planned in full (search's lower bound)
    with progress(f"searching the layouts of {cfg.model.name} on {args.world_size} devices"):
        plans = search(cfg, args.world_size, hw, schedules, refused, top, counts)
    if (
        not counts["valid"] and schedules is None and refused
    ):  # the schedule given: say why layout.checks.check_schedule refused
        # (a chunked one, interleaved or zbv: from a pipelined layout; its pp = 1 refusal only says pp must be >= 2)
        spec = SCHEDULES[cfg.parallel.schedule]
        piped = [msg for layout, msg in refused if layout.pp > 1] if spec.chunks or spec.vshape else []
        raise ArgumentError((piped or [msg for _, msg in refused])[0])
    if not counts["valid"]:
        raise ArgumentError(
            f"no valid layout of {cfg.model.name} on --world-size={args.world_size} with global "
            f"batch {cfg.train.global_batch_size}; try a world size that divides it"
        )
    fitting = [p for p in plans if p.fits]
    if args.json:
        print(json.dumps([p.describe() for p in plans], indent=1))  # all of them; "fits" says which fit
        return 0
    if not fitting:  # the smallest of every layout (planned in full: the pruned search drops those over)
        best = min(search(cfg, args.world_size, hw, schedules), key=lambda p: p.peak_bytes)
        raise ArgumentError(
            f"no layout fits in --device-memory={args.device_memory:g} GB; the smallest needs "
            f"{best.peak_bytes / 1e9:.1f} GB ({best.describe()['dp_mode']}, tp={best.layout.tp}, "
            f"pp={best.layout.pp}, micro-batch {best.cfg.train.micro_batch_size})"
        )
    what = (
        "schedules 1f1b, il-v2..4 (interleaved, v virtual stages), zb-h1 (zero_bubble), zbv"
        if schedules
        else "schedule "
        + cfg.parallel.schedule
        + (f" with {cfg.parallel.virtual_stages} virtual stages" if SCHEDULES[cfg.parallel.schedule].chunks else "")
    )
    print(
        f"{cfg.model.name}: seq_len {cfg.train.seq_len}, global batch {cfg.train.global_batch_size}, "
        f"{cfg.train.dtype}, {what}; {args.world_size} devices of {args.device_memory:g} GB, "
        f"{hw.peak_tflops:g} TFLOP/s at {hw.efficiency:.0%}; "
        + (
            f"{counts['valid']} valid layouts, {counts['planned']} planned in full, the fastest that fit below"
            if top
            else f"{len(fitting)} of {len(plans)} valid layouts fit"
        )
    )
    print(table([p.describe() for p in fitting[: args.top or None]]))
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except (ConfigError, ArgumentError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)
