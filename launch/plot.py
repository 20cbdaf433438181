"""Plot the training curves of one or several runs from their metrics.jsonl, side by side.

    python launch/plot.py runs/tiny runs/tiny-tp2 -o curves.png [--names tiny tp2]
    python launch/plot.py runs/tiny --tensorboard    # event files in runs/tiny/tensorboard, for tensorboard --logdir

Panels against the optimizer step: loss (solid: train, dashed with markers: eval), learning rate, gradient norm
(log scale), throughput (tokens/s, all ranks together) and peak memory per rank (MiB; engine/metrics/stepstats.py says
what it counts on CPU and on CUDA); for a mixture of experts also its load-balancing loss, the CV of tokens per
expert and the router z-loss. One colour per run, named in the legend by its directory (or --names).
A step logged twice (an old run's records before the rolled-back ones were moved aside) counts once, the last.
--tensorboard writes the same records as TensorBoard event files instead (engine/metrics/tensorboard.py, what
log.tensorboard writes during a run), so a run trained without it can be viewed in TensorBoard.
Needs matplotlib (the plot extra: pip install -e ".[plot]"; also in dev), --tensorboard the tensorboard package.
Without it: one line naming the extra, exit status 2. Bad input exits with status 2 and one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engine.json_input import shown  # noqa: E402
from engine.metrics.tensorboard import SCALARS  # noqa: E402

PANELS = [  # (record key, title, y label, log scale)
    ("loss", "Loss", "cross-entropy (nats/token)", False),
    ("lr", "Learning rate", "lr", False),
    ("grad_norm", "Gradient norm (before clipping)", "global L2 norm", True),
    ("tokens_per_s", "Throughput", "tokens/s (all ranks)", False),
    ("peak_mem_bytes", "Peak memory (largest rank)", "MiB", False),
]
MOE_PANELS = [  # added when a run is a mixture of experts (engine/metrics/moe.py)
    ("moe_aux_loss", "MoE load-balancing loss", "E sum_i f_i P_i (k: even)", False),
    ("moe_tokens_per_expert_cv", "Tokens per expert", "CV over experts (0: even)", False),
    ("moe_z_loss", "Router z-loss", "mean logsumexp^2", True),
]


# Every record key drawn here or written by --tensorboard: a number where present (NaN and inf too: a diverged run)
NUMBERS = sorted({key for key, *_ in PANELS + MOE_PANELS} | {"eval_loss", *SCALARS})


class PlotError(ValueError):
    """Bad input to plot.py; ``str(e)`` is one line."""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_record(record: dict, where: str) -> None:
    """PlotError naming the line and key unless the record's step is an integer >= 0, every value drawn is a number
    (or absent) and ``time`` an object of seconds per phase: a step of Infinity, a null loss or a list for time
    were tracebacks, or half-written event files (issue 42)."""
    step = record["step"]
    if not (_is_number(step) and isinstance(step, int) and step >= 0):
        raise PlotError(f"{where}: step is {shown(step)}, not an integer >= 0")
    for key in NUMBERS:
        if key in record and not _is_number(record[key]):
            raise PlotError(f"{where}: {key} is {shown(record[key])}, not a number (metrics.jsonl writes numbers)")
    phases = record.get("time", {})
    if not (isinstance(phases, dict) and all(map(_is_number, phases.values()))):
        raise PlotError(f'{where}: time is {shown(phases)}, not an object of seconds per phase such as {{"data": 0.1}}')


def read_run(run_dir: Path) -> list[dict]:
    """The run's records sorted by step, one per step (the last one written wins)."""
    path = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (give a run's train.out_dir)")
    by_step, skipped = {}, []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not (isinstance(record, dict) and "step" in record):
            skipped.append(number)  # a line cut short by a crash, a damaged byte
            continue
        check_record(record, f"{path} line {number}")
        by_step[record["step"]] = record
    if not by_step:
        raise PlotError(f"{path}: no step records")
    if skipped:
        lines = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        print(
            f"warning: {path}: skipped {len(skipped)} lines that are not a step record (line {lines})",
            file=sys.stderr,
            flush=True,
        )
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    scale = 1 / 2**20 if key == "peak_mem_bytes" else 1.0
    pairs = [(r["step"], r[key] * scale) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError('launch/plot.py needs matplotlib: pip install -e ".[plot]" (or the dev extra)') from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    return plt


def check_format(plt, output: Path) -> None:
    """PlotError unless matplotlib writes ``output``'s suffix (none: PNG), before anything is drawn."""
    formats = sorted(plt.figure().canvas.get_supported_filetypes())
    plt.close("all")
    suffix = output.suffix.lower().lstrip(".")
    if suffix and suffix not in formats:
        raise PlotError(
            f"-o {output}: matplotlib cannot write .{suffix} files; end the name in one of .{', .'.join(formats)}"
        )


def write_tensorboard(run: Path, records: list[dict]) -> Path:
    """The run's records as TensorBoard event files in ``<run dir>/tensorboard``, as log.tensorboard writes them;
    refused where that folder already holds some (the run logged them itself, or an earlier call did)."""
    folder = (run if run.is_dir() else run.parent) / "tensorboard"
    if folder.is_dir() and any(folder.iterdir()):
        raise PlotError(f"{folder} already holds event files; view them with tensorboard --logdir {folder.parent}")
    try:
        from engine.metrics.tensorboard import TensorBoardSink

        sink = TensorBoardSink(str(folder.parent))
    except ImportError:
        raise PlotError(
            '--tensorboard needs the tensorboard package: pip install -e ".[plot]" (or the dev extra)'
        ) from None
    for record in records:
        sink.log(record)
    sink.close()
    return folder


def plot(runs: dict[str, list[dict]], output: Path):
    """Draw every run on the five panels and save the PNG; returns the figure."""
    plt = _pyplot()

    moe = any("moe_aux_loss" in r for records in runs.values() for r in records)
    panels = PANELS + (MOE_PANELS if moe else [])
    rows = -(-(len(panels) + 1) // 3)  # the panels and the legend cell, 3 a row
    fig, axes = plt.subplots(rows, 3, figsize=(16, 4.25 * rows), constrained_layout=True)
    axes = axes.ravel()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, records) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        width = max(1.0, 2.8 - 0.8 * i)  # earlier runs thicker: equal curves (one model at two layouts) both show
        for ax, (key, title, ylabel, log) in zip(axes, panels):
            steps, values = _series(records, key)
            ax.plot(steps, values, color=color, linewidth=width, label=f"{name} (train)" if key == "loss" else name)
            if key == "loss":
                e_steps, e_values = _series(records, "eval_loss")
                if e_steps:
                    ax.plot(e_steps, e_values, "--o", color=color, markersize=3, label=f"{name} (eval)")
            ax.set(title=title, xlabel="step", ylabel=ylabel)
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
    for ax in axes[: len(panels)]:
        ax.legend(fontsize=8)
    for ax in axes[len(panels) + 1 :]:
        ax.axis("off")
    legend = axes[len(panels)]  # the cell after the panels: which run is which, with its final numbers
    legend.axis("off")
    lines = [f"{name}: {len(r)} steps, final loss {r[-1].get('loss', float('nan')):.3f}" for name, r in runs.items()]
    legend.text(0.0, 1.0, "Runs\n" + "\n".join(lines), va="top", family="monospace", fontsize=10)
    fig.savefig(output, dpi=110)
    return fig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (train.out_dir) or metrics.jsonl files")
    parser.add_argument("-o", "--output", default="curves.png", help="PNG to write (default curves.png)")
    parser.add_argument("--names", nargs="*", help="legend names, one per run (default: the directory names)")
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="write each run's records as TensorBoard event files in <run>/tensorboard, no PNG",
    )
    args = parser.parse_args(argv)
    try:
        if args.tensorboard:
            for run in args.runs:
                print(f"wrote {write_tensorboard(Path(run), read_run(Path(run)))}", flush=True)
            return 0
        check_format(
            _pyplot(), Path(args.output)
        )  # before reading anything: a missing matplotlib is the one thing to say
        names = args.names or [Path(r).resolve().name for r in args.runs]
        if len(names) != len(args.runs):
            raise PlotError(f"--names has {len(names)} names for {len(args.runs)} runs; give one per run")
        if len(set(names)) != len(names):  # two runs called alike: tell them apart by their full paths
            names = list(args.runs)
        runs = {name: read_run(Path(run)) for name, run in zip(names, args.runs)}
        plot(runs, Path(args.output))
    except (PlotError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {args.output} ({', '.join(runs)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
