"""Benchmark of the pipeline schedules side by side: 1F1B, interleaved 1F1B, zero bubble (ZB-H1) and ZB-V,
measured against theory.

    nice -n 5 python launch/bench/schedules.py [--pp 2 4] [--micro-batches 4 8 16] [--steps 4] [--virtual-stages 2]

For each pp, pp ranks are forked (gloo, one torch thread each, fp32, random tokens, 8 layers so that pp=4 with v=2
has one layer per chunk). Each rank builds one stage per schedule (interleaved holds other layers); for each m the
three schedules alternate step by step, in a rotating order, so machine noise hits them alike. The first
(--warmup) step of each also measures memory; medians are over the --steps after it. With the defaults: 3.5 to 6
minutes wall, 1.5 minutes of CPU, on 2 cores shared with other jobs (load average 12 to 30). Printed:

a) per stage: ``closed``, the bubble fraction of the papers' closed forms (1F1B (p-1)/(m+p-1), Narayanan et al.
   2021 Sec. 2.2.1; interleaved (p-1)/(v*m+p-1), their Sec. 2.2.2; ZB-H1 (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)),
   Qi et al. 2023 Sec. 3.1, with the measured F, B, W); ``sim``, engine/parallel/pp/schedule.py's event simulator
   fed with the measured compute times (the mean over ranks of each op's median; communication free); measured
   ``idle`` = (step - busy) / step, busy = the stage's run time minus executor.wait_s, and ``wait`` =
   executor.wait_s / step (as launch/bench/pipeline.py); ``cpu`` = thread CPU seconds of the stage's computes /
   step. Memory: peak bytes saved for backward (launch/bench/pipeline.py's SavedActivations) plus, for
   zero_bubble, the x and g its WeightGradStore holds until W (sampled at every save and use; a storage held by
   both is counted twice); ``in flight`` = actions.max_in_flight of the stage's action list ((micro-batch, chunk)
   pairs, each 1/v of a stage's activations), ``exp`` = in_flight / v over 1F1B's, ``meas`` = the measured peak
   over 1F1B's.
b) step time (makespan, barrier to barrier): medians, the median per step of the ratio to 1F1B's step next to
   it, and theory: the ratio (1 - bubble_1F1B) / (1 - bubble) of the closed forms, and the simulator's makespan.
c) the measured compute times (thread CPU ms, mean over ranks of each op's median) fed to theory.
d) zero bubble under ddp at the first --pp and dp = --dp (--dp 1 skips it): the dp reduction overlapped with the
   W's (each bucket all-reduced as the chunk's last W completes it) vs exposed after the last W, the dp_comm phase
   and the step time side by side (launch/bench/zb_dp.py, which runs it alone).
e) parallel.pp_layers auto against the even split under 1F1B at each --pp and the largest m: the slowest stage's
   compute and the step time side by side (launch/bench/stage_balance.py, which runs it alone; tiny.yaml's
   vocabulary of 4096, so that the LM head weighs what it does in tiny; --no-balance skips it).

With more ranks than free cores (pp=4 on 2 cores) the ranks take turns: wall-clock idle/wait then include time a
neighbour was descheduled (it looks busy, its receiver idle), a stage descheduled mid-compute looks busy, and
``cpu`` sums to at most the cores over the stages. Thread CPU times (the simulator's inputs) are not inflated.
The simulator has one cost per op for all stages, so with uniform costs its bubble equals the closed form; its
makespan (communication and per-action overhead free) is the figure to compare step times with.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine.kinds.schedules import SCHEDULES  # noqa: E402
from engine.metrics.memory import SavedActivations  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.layout.spawn import run_ranks  # noqa: E402
from engine.parallel.pp.executor import PipelineExecutor, backward_from  # noqa: E402
from engine.parallel.pp.schedule import bubble_fraction, max_in_flight, simulate, theory  # noqa: E402
from engine.parallel.pp.virtual import model_chunks  # noqa: E402
from engine.parallel.tp.layers import vocab_parallel_cross_entropy  # noqa: E402
from engine.trainer import build_model  # noqa: E402
from launch.bench import zb_dp  # noqa: E402
from launch.bench.pipeline import add_model_args, batch, config, model_line, timed  # noqa: E402

NAMES = ("1f1b", "interleaved", "zero_bubble", "zbv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (one rank per stage)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16], help="m per step")
    p.add_argument("--steps", type=int, default=4, help="measured steps of each schedule per (pp, m)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (the first measures memory)")
    p.add_argument("--virtual-stages", type=int, default=2, help="v of the interleaved schedule")
    add_model_args(p)
    zb_dp.add_args(p)  # section d): zero bubble x ddp, the dp reduction overlapped vs exposed (--dp 1: skipped)
    p.add_argument("--no-balance", action="store_true", help="skip section e) (pp_layers auto vs even)")
    args = p.parse_args(argv)
    for pp in args.pp:
        bad = [m for m in args.micro_batches if m < pp or m % pp]
        if pp < 2 or bad:
            p.error(
                f"--pp {pp} with --micro-batches {bad}: need pp >= 2 and each m a multiple of pp (interleaved "
                f"runs groups of pp micro-batches); valid m: {pp}, {2 * pp}, ..."
            )
        if args.layers % (pp * args.virtual_stages):
            p.error(
                f"--layers {args.layers} does not split into pp*v = {pp * args.virtual_stages} equal chunks; "
                f"choose --layers a multiple of {pp * args.virtual_stages}"
            )
    if args.virtual_stages < 2 or args.steps < 1 or args.warmup < 1:
        p.error(
            f"need --virtual-stages >= 2, --steps >= 1, --warmup >= 1 (got {args.virtual_stages}, "
            f"{args.steps}, {args.warmup})"
        )
    return args


def chunks_of(name: str, args: argparse.Namespace) -> int:
    return SCHEDULES[name].per_rank(args.virtual_stages)  # zbv: 2, in a V


def rotated(names, i: int) -> list:
    """The order of step i: the names rotated by i, so each runs first, second, ... equally often."""
    names = list(names)
    return names[i % len(names) :] + names[: i % len(names)]


class Run:
    """One schedule on this rank at one m: its executor, its computes timed in thread CPU seconds (F per chunk,
    loss L, whole backward B or zero bubble's B and W), and the rows of its measured steps."""

    def __init__(self, name: str, v: int, cfg, ctx, stage: torch.nn.Module, m: int):
        self.name, self.cfg, self.ctx, self.stage, self.m = name, cfg, ctx, stage, m
        shape = (cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.hidden_size)
        self.executor = PipelineExecutor(ctx, name, m, shape, torch.float32, virtual_stages=v, stage=stage)
        self.cpu: dict[str, list[float]] = {op: [] for op in ("F", "L", "B", "Bi", "W")}
        self.step_cpu, self.recording = 0.0, False
        chunks = model_chunks(stage, ctx.pp, ctx.pp_rank, v, SCHEDULES[name].vshape)
        self.forwards = [self._timed("F", c) for c in chunks]
        store = self.executor.weight_grads
        if store is not None:  # W: the executor calls store.flush((mb, chunk))
            store.flush = self._timed("W", store.flush)
        self.backward = self._timed("Bi" if store is not None else "B", backward_from)
        self.rows: list[dict] = []
        self.memory = (0, 0)

    def _timed(self, op: str, fn):
        def run(*a, **kw):
            start = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                spent = time.thread_time() - start
                self.step_cpu += spent
                if self.recording:
                    self.cpu[op].append(spent)

        return run

    def _run(self, i: int) -> None:
        inputs, labels = batch(self.cfg, self.m, i)
        ys = labels.split(self.cfg.train.micro_batch_size)
        loss = self._timed("L", lambda out, mb: vocab_parallel_cross_entropy(out, ys[mb], self.ctx.tp_group) / self.m)
        self.executor.run(
            self.forwards, loss, list(inputs.split(self.cfg.train.micro_batch_size)), backward=self.backward
        )
        self.stage.zero_grad(set_to_none=True)

    def _tracked(self, i: int) -> tuple[int, int]:
        """Run step i under SavedActivations; (peak saved bytes, peak saved + W-queue bytes)."""
        store, peak = self.executor.weight_grads, [0]

        def sample() -> None:  # at every save and use in backward: the W queue is alive alongside
            peak[0] = max(peak[0], tracker.live + (store.bytes_pending() if store is not None else 0))

        tracker = SavedActivations(self.stage, on_event=sample)
        with tracker.hooks():
            self._run(i)
        return tracker.peak, max(peak[0], tracker.peak)

    def step(self, i: int, warmup: int) -> None:
        """Step i, started together on every stage; the first measures memory, those after warmup are kept."""
        self.recording, self.step_cpu = i >= warmup, 0.0
        own, step, mem = timed(self.ctx, lambda: self._tracked(i) if i == 0 else self._run(i))
        if i == 0:
            self.memory = mem
        if self.recording:
            busy = own - self.executor.wait_s
            self.rows.append(
                {
                    "wait": self.executor.wait_s / step,
                    "idle": (step - busy) / step,
                    "cpu": self.step_cpu / step,
                    "step": step,
                }
            )

    def summary(self) -> dict:
        med = {k: statistics.median(r[k] for r in self.rows) for k in self.rows[0]}
        return {
            **med,
            "steps": [r["step"] for r in self.rows],
            "memory": self.memory,
            "in_flight": max_in_flight(self.executor.actions),
            "ops": {op: statistics.median(t) for op, t in self.cpu.items() if t},
        }


def rank_main(args: argparse.Namespace) -> dict:
    """One forked rank: for each m, the three schedules alternating step by step; {m: {name: summary}}."""
    pp = dist.get_world_size()
    cfgs = {
        n: config(args, pp, "--parallel.schedule", n, "--parallel.virtual_stages", str(chunks_of(n, args)))
        for n in NAMES
    }
    ctx = ParallelContext.from_config(cfgs["1f1b"])
    stages = {n: build_model(cfg, ctx) for n, cfg in cfgs.items()}
    out = {}
    for m in args.micro_batches:
        runs = {n: Run(n, chunks_of(n, args), cfgs[n], ctx, stages[n], m) for n in NAMES}
        for i in range(args.warmup + args.steps):
            for n in rotated(NAMES, i):
                runs[n].step(i, args.warmup)
        out[m] = {n: r.summary() for n, r in runs.items()}
    return out


def op_times(ranks: list[dict]) -> dict[str, float]:
    """Mean over ranks of each op's median CPU seconds (one schedule, one m)."""
    ops = {op for r in ranks for op in r["ops"]}
    return {op: statistics.mean(r["ops"][op] for r in ranks if op in r["ops"]) for op in ops}


def expected(name: str, pp: int, m: int, v: int, ops: dict[str, float]) -> dict:
    """Theory for one schedule with compute times ops (F, and B or Bi and W; seconds per chunk): the closed-form
    bubble, the simulator's bubble per stage and makespan, and activations in flight per stage."""
    f, b = ops["F"], ops.get("B", ops.get("Bi", 0.0) + ops.get("W", 0.0))
    bi, w = ops.get("Bi", b / 2), ops.get("W", b / 2)
    formula, closed = theory(name, pp, m, v, f, b, bi, w)
    timeline = simulate(name, pp, m, f, b, v, bi, w)
    return {
        "formula": formula,
        "closed": closed,
        "sim": bubble_fraction(timeline),
        "makespan": timeline.makespan,
        "in_flight": timeline.peak_in_flight,
    }


def analyse(pp: int, m: int, ranks: list[dict], args: argparse.Namespace) -> dict:
    """{name: theory (expected) with the measured op times}, for one (pp, m); ranks[stage][name] = summary."""
    return {n: expected(n, pp, m, chunks_of(n, args), op_times([r[n] for r in ranks])) for n in NAMES}


def settings(results: dict[int, list[dict]], args: argparse.Namespace):
    """(pp, m, [stage's {name: summary}], {name: theory}) for every measured setting, in order."""
    for pp, ranks in results.items():
        for m in args.micro_batches:
            at_m = [r[m] for r in ranks]
            yield pp, m, at_m, analyse(pp, m, at_m, args)


def print_stages(results: dict[int, list[dict]], args: argparse.Namespace) -> None:
    mib = 2**20
    print(
        "\na) per stage: bubble fraction (closed form, simulator with measured op times; measured idle, wait, "
        "cpu) and peak activations (MiB; exp/meas relative to 1F1B's)"
    )
    print(
        f"{'pp':>2} {'m':>3} {'schedule':>11} {'st':>2} {'closed':>6} {'sim':>6} {'idle':>6} {'wait':>6} "
        f"{'cpu':>6} {'saved':>6} {'+Wq':>6} {'flight':>6} {'exp':>5} {'meas':>5}"
    )
    for pp, m, ranks, theory_ in settings(results, args):
        for n in NAMES:
            for s, r in enumerate(ranks):
                got, base, t = r[n], r["1f1b"], theory_[n]
                exp = got["in_flight"] / chunks_of(n, args) / base["in_flight"]
                print(
                    f"{pp:>2} {m:>3} {n:>11} {s:>2} {t['closed']:>6.3f} {t['sim'][s]:>6.3f} "
                    f"{got['idle']:>6.3f} {got['wait']:>6.3f} {got['cpu']:>6.3f} {got['memory'][0] / mib:>6.2f} "
                    f"{got['memory'][1] / mib:>6.2f} {got['in_flight']:>6} {exp:>5.2f} "
                    f"{got['memory'][1] / base['memory'][1]:>5.2f}"
                )


def print_steps(results: dict[int, list[dict]], args: argparse.Namespace) -> None:
    print(
        "\nb) step time (medians; /1F1B: measured = median per step of the ratio, closed = (1-bubble_1F1B)/"
        "(1-bubble), sim = simulated makespans)"
    )
    print(
        f"{'pp':>2} {'m':>3} {'schedule':>11} {'step ms':>8} {'sim ms':>7} {'meas/1F1B':>9} {'closed/1F1B':>11} "
        f"{'sim/1F1B':>8}"
    )
    for pp, m, ranks, t in settings(results, args):
        row = ranks[0]
        for n in NAMES:
            ratio = statistics.median(a / b for a, b in zip(row[n]["steps"], row["1f1b"]["steps"]))
            print(
                f"{pp:>2} {m:>3} {n:>11} {row[n]['step'] * 1e3:>8.1f} {t[n]['makespan'] * 1e3:>7.1f} "
                f"{ratio:>9.3f} {(1 - t['1f1b']['closed']) / (1 - t[n]['closed']):>11.3f} "
                f"{t[n]['makespan'] / t['1f1b']['makespan']:>8.3f}"
            )


def print_ops(results: dict[int, list[dict]], args: argparse.Namespace) -> None:
    print("\nc) compute per chunk fed to theory (thread CPU ms, mean over ranks of medians; L = loss, not simulated)")
    print(f"{'pp':>2} {'m':>3} {'schedule':>11} {'F':>6} {'B':>6} {'Bi':>6} {'W':>6} {'L':>6}")
    for pp, m, ranks, _ in settings(results, args):
        for n in NAMES:
            ops = op_times([r[n] for r in ranks])
            print(
                f"{pp:>2} {m:>3} {n:>11} "
                + " ".join(f"{ops[op] * 1e3:>6.2f}" if op in ops else f"{'-':>6}" for op in ("F", "B", "Bi", "W", "L"))
            )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        f"{model_line(args)}; interleaved v={args.virtual_stages}; {args.steps} measured steps of each schedule "
        f"per (pp, m)"
    )
    start = time.perf_counter()
    results = {pp: run_ranks(rank_main, pp, args, timeout_s=900, threads=1) for pp in args.pp}
    print_stages(results, args)
    print_steps(results, args)
    print_ops(results, args)
    if args.dp > 1:  # the model's sizes, the first pp, the largest m; tiny.yaml's vocabulary (the corpus's)
        zb = argparse.Namespace(
            pp=args.pp[0],
            dp=args.dp,
            micro_batches=max(args.micro_batches),
            steps=args.steps,
            layers=args.layers,
            hidden=args.hidden,
            seq_len=args.seq_len,
            bucket_mb=args.bucket_mb,
        )
        zb_dp.print_table(zb_dp.measure(zb), zb)
    if not args.no_balance:
        from launch.bench import stage_balance  # imported here: it builds on this module's Run

        print("\ne) parallel.pp_layers auto vs even (1F1B; launch/bench/stage_balance.py):")
        stage_balance.main(
            [
                "--pp",
                *map(str, args.pp),
                "--micro-batches",
                str(max(args.micro_batches)),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--layers",
                str(args.layers),
                "--hidden",
                str(args.hidden),
                "--ffn",
                str(args.ffn),
                "--seq-len",
                str(args.seq_len),
                "--micro-batch-size",
                str(args.micro_batch_size),
            ]
        )
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
