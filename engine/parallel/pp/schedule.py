"""Pipeline schedules as data: for each stage, the ordered list of actions it runs (no processes, no torch).

A schedule is a pure function `(pp, micro_batches, stage) -> list[Action]` (interleaved also takes the virtual
stage count v). The executor walks the list and turns each RECV/SEND into a p2p op; here it can be printed,
simulated (engine/parallel/pp/simulator.py) and unit-tested without any processes.

- 1F1B, non-interleaved (PipeDream-Flush): Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", Sec. 2.2.1, Fig. 4 (top).
- GPipe: Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism".
- interleaved: 1F1B over v model chunks per rank, Narayanan et al. 2021, Sec. 2.2.2 (schedules/interleaved.py).
- zero_bubble: ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 3.1 (schedules/zero_bubble.py).
- zbv: ZB-V, Qi et al. 2023, Sec. 6: two chunks per rank in a V, F/B/W split (schedules/zbv.py).

1F1B and GPipe have the bubble fraction (p-1)/(m+p-1) of the makespan (Narayanan et al. 2021, Sec. 2.2.1); 1F1B
keeps at most `pp - stage` activations alive instead of GPipe's m. Run `python -m engine.parallel.pp.schedule --pp 4
--micro-batches 8` to print both, and add `--schedule interleaved --virtual-stages 2`, `--schedule zero_bubble` or
`--schedule zbv`.
"""

from __future__ import annotations

import argparse
from typing import Callable

from engine.kinds.schedules import SCHEDULES, ScheduleSpec
from engine.parallel.pp.actions import Action, Op, max_in_flight
from engine.parallel.pp.actions import backward_actions as _backward
from engine.parallel.pp.actions import forward_actions as _forward
from engine.parallel.pp.schedules.interleaved import interleaved_1f1b, interleaved_order
from engine.parallel.pp.schedules.zbv import zbv
from engine.parallel.pp.schedules.zero_bubble import zb_h1
from engine.parallel.pp.simulator import Timeline, bubble_fraction, render, simulate_actions

__all__ = [
    "Action",
    "Op",
    "Timeline",
    "build",
    "bubble_fraction",
    "forward_only",
    "gpipe",
    "max_in_flight",
    "one_f_one_b",
    "render",
    "simulate",
    "simulate_actions",
]


def one_f_one_b(pp: int, micro_batches: int, stage: int) -> list[Action]:
    """Non-interleaved 1F1B (PipeDream-Flush; Narayanan et al. 2021, Sec. 2.2.1, Fig. 4 top).

    Warmup of min(pp - stage - 1, m) forwards, steady state of one forward then one backward, cooldown of the
    remaining backwards. Stage s thus holds at most pp - s activations (the warmup plus the steady state's one).
    Each FWD is preceded by its RECV_FWD (stage > 0) and followed by its SEND_FWD (stage < pp-1); each BWD is
    preceded by RECV_BWD (stage < pp-1) and followed by SEND_BWD (stage > 0). Arguments are checked by build().
    """
    warmup = min(pp - stage - 1, micro_batches)
    steady = micro_batches - warmup
    actions: list[Action] = []
    # Warmup Phase: fill the pipeline.
    for mb in range(warmup):
        actions += _forward(pp, stage, mb)
    # Steady State Phase: one forward, then the backward of the oldest micro-batch in flight.
    for i in range(steady):
        actions += _forward(pp, stage, warmup + i)
        actions += _backward(pp, stage, i)
    # Cooldown Phase: drain the backwards of the warmup's micro-batches.
    for mb in range(steady, micro_batches):
        actions += _backward(pp, stage, mb)
    return actions


def gpipe(pp: int, micro_batches: int, stage: int) -> list[Action]:
    """GPipe (Huang et al. 2019): all forwards, then all backwards, so every stage holds m activations.

    Backwards run in the order mb 0..m-1, as torch.distributed.pipelining's ScheduleGPipe does (so the executor
    can be checked against it op for op). The order is free: gradients are summed over micro-batches, all m
    activations are alive either way, and every stage uses the same order, so the last stage's B0 unblocks
    stage p-2 at once and the makespan is the same (m+p-1)(f+b) as with reverse order.
    """
    actions: list[Action] = []
    for mb in range(micro_batches):
        actions += _forward(pp, stage, mb)
    for mb in range(micro_batches):
        actions += _backward(pp, stage, mb)
    return actions


def forward_only(
    pp: int, micro_batches: int, stage: int, virtual_stages: int = 1, vshape: bool = False
) -> list[Action]:
    """Evaluation: every micro-batch forwarded (received from the previous virtual stage, sent to the next),
    nothing backwarded; with virtual stages in interleaved's order of (micro-batch, chunk). Each send and the
    next receive are consecutive, so they form one batch (actions.steps): Megatron's send_forward_recv_forward,
    which NCCL's rendezvous sends cannot deadlock (simulator). ZB-V (``vshape``): every micro-batch down chunk 0,
    then every one back up chunk 1 (the turn's outputs wait on rank pp-1, no graph is kept under no_grad)."""
    if vshape:
        return [a for c in (0, 1) for mb in range(micro_batches) for a in _forward(pp, stage, mb, c, 2, True)]
    if virtual_stages > 1:
        order = interleaved_order(pp, micro_batches, virtual_stages)
        return [a for mb, c in order for a in _forward(pp, stage, mb, c, virtual_stages)]
    return [a for mb in range(micro_batches) for a in _forward(pp, stage, mb)]


# The table builders a ScheduleSpec.table may name (engine/kinds/schedules.py), each (pp, micro_batches, stage, v):
# a new schedule adds its table function here.
TABLES: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "one_f_one_b": lambda pp, m, stage, v: one_f_one_b(pp, m, stage),
    "gpipe": lambda pp, m, stage, v: gpipe(pp, m, stage),
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": lambda pp, m, stage, v: zb_h1(pp, m, stage),
    "zbv": lambda pp, m, stage, v: zbv(pp, m, stage),
}


def table_builder(spec: ScheduleSpec) -> Callable[[int, int, int, int], list[Action]]:
    """The table builder ``spec.table`` names."""
    if spec.table not in TABLES:
        raise LookupError(f"schedule {spec.name}: no table builder {spec.table!r} (one of {', '.join(TABLES)})")
    return TABLES[spec.table]


def chunking(parallel) -> tuple[int, bool]:
    """(model chunks per rank, placed in a V) of a ParallelConfig: how its stage is split (virtual.py)."""
    spec = SCHEDULES[parallel.schedule]
    return spec.per_rank(parallel.virtual_stages), spec.vshape


def layer_runs(parallel, pp: int) -> int:
    """How many contiguous runs of decoder layers a ParallelConfig's stage split cuts at ``pp`` stages, which is
    what parallel.pp_layers counts: pp stages, or pp*v virtual stages under a chunked schedule (split.py)."""
    return pp * chunking(parallel)[0] if pp > 1 else 1


def _check_chunks(schedule: str, pp: int, micro_batches: int, virtual_stages: int) -> None:
    """Virtual stages belong to the schedules with chunks; those need v >= 2 and Megatron's whole groups of pp.
    A V's 2 chunks are implied (virtual_stages 1 or 2 accepted)."""
    if SCHEDULES[schedule].vshape:
        if virtual_stages not in (1, 2):
            raise ValueError(f"virtual_stages={virtual_stages}: {schedule} runs 2 chunks per rank, implied (1 or 2)")
        return
    if not SCHEDULES[schedule].chunks:
        if virtual_stages != 1:
            chunked = " or ".join(repr(n) for n, s in SCHEDULES.items() if s.chunks)
            raise ValueError(
                f"virtual_stages={virtual_stages} needs schedule {chunked}; {schedule} runs one "
                f"model chunk per stage (virtual_stages=1)"
            )
        return
    if virtual_stages < 2:
        raise ValueError(
            f"{schedule} needs virtual_stages >= 2, got virtual_stages={virtual_stages} (one chunk per stage is 1f1b)"
        )
    if micro_batches % pp:
        raise ValueError(
            f"{schedule} needs micro_batches to be a multiple of pp (Megatron's groups of pp "
            f"micro-batches), got micro_batches={micro_batches}, pp={pp}; valid: {pp}, {2 * pp}, ..."
        )


def build(schedule: str, pp: int, micro_batches: int, stage: int, virtual_stages: int = 1) -> list[Action]:
    """The action list of `stage`, after checking every argument (the error names the bad value)."""
    check(schedule, pp, micro_batches, virtual_stages)
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} out of range for pp={pp}; valid: 0..{pp - 1}")
    return table_builder(SCHEDULES[schedule])(pp, micro_batches, stage, virtual_stages)


def check(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError naming the bad value if `schedule` cannot run pp stages over micro_batches (cheap: no
    table is built; the layout checks and the planner's search call it for every candidate)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got pp={pp}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got micro_batches={micro_batches}")
    if SCHEDULES[schedule].m_at_least_pp and micro_batches < pp:
        raise ValueError(f"{schedule} needs micro_batches >= pp, got micro_batches={micro_batches} < pp={pp}")
    _check_chunks(schedule, pp, micro_batches, virtual_stages)


def simulate(
    schedule: str,
    pp: int,
    micro_batches: int,
    fwd_time: float = 1.0,
    bwd_time: float = 2.0,
    virtual_stages: int = 1,
    bwd_input_time: float = 1.0,
    bwd_weight_time: float = 1.0,
) -> Timeline:
    """Event simulation of all stages under NCCL's rules (simulator.simulate_actions): each run of consecutive
    comm actions is one batch, a rank's batches run in order, a send completes only once the batch holding its
    receive has started (rendezvous); computes take their time (fwd_time, bwd_time, zero bubble's bwd_input_time
    and bwd_weight_time); communication is free. Raises RuntimeError('deadlock: ...') naming each rank's blocked
    batch and what it waits for, and RuntimeError for any send/receive or F/B/W order that does not add up."""
    stages = [build(schedule, pp, micro_batches, s, virtual_stages) for s in range(pp)]
    return simulate_actions(
        stages, fwd_time, bwd_time, schedule, bwd_input_time, bwd_weight_time, SCHEDULES[schedule].vshape
    )


def theory(schedule: str, pp: int, m: int, v: int, f: float, b: float, bi: float, w: float) -> tuple[str, float]:
    """(formula, value) of the bubble fraction of the makespan that the papers predict (the schedule's own)."""
    return SCHEDULES[schedule].theory(pp, m, v, f, b, bi, w)


def _print_schedule(name: str, args: argparse.Namespace, v: int) -> None:
    pp, m = args.pp, args.micro_batches
    stages = [build(name, pp, m, s, v) for s in range(pp)]
    timeline = simulate(name, pp, m, args.fwd_time, args.bwd_time, v, args.bwd_input_time, args.bwd_weight_time)
    costs = (
        f"fwd={args.fwd_time:g} bwd_input={args.bwd_input_time:g} bwd_weight={args.bwd_weight_time:g}"
        if SCHEDULES[name].split_w
        else f"fwd={args.fwd_time:g} bwd={args.bwd_time:g}"
    )
    spec = SCHEDULES[name]
    chunks = f" virtual_stages={v}" if spec.chunks else " (2 chunks in a V)" if spec.vshape else ""
    print(f"== {name}: pp={pp}{chunks} micro_batches={m} {costs}")
    for s, actions in enumerate(stages):
        print(f"actions stage {s}: {' '.join(map(str, actions))}")
    print(render(timeline, args.width))
    formula, value = theory(name, pp, m, v, args.fwd_time, args.bwd_time, args.bwd_input_time, args.bwd_weight_time)
    print(
        "bubble fraction per stage: "
        + " ".join(f"{b:.4f}" for b in bubble_fraction(timeline))
        + f"  (theory {formula} = {value:.4f})"
    )
    unit = SCHEDULES[name].unit.replace("{v}", str(v))
    print("max activations in flight per stage: " + " ".join(map(str, timeline.peak_in_flight)) + unit)
    print()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print pipeline schedules, their simulated timelines and bubbles.")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--schedule", choices=[*SCHEDULES, "both"], default="both", help="both: 1f1b and gpipe")
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="model chunks per stage, chunked schedules only (default: 2 there, else 1)",
    )
    p.add_argument("--fwd-time", type=float, default=1.0, help="time of one forward on one stage (chunk)")
    p.add_argument("--bwd-time", type=float, default=2.0, help="time of one whole backward on one stage (chunk)")
    p.add_argument("--bwd-input-time", type=float, default=1.0, help="zero_bubble, zbv: time of one B (input grad)")
    p.add_argument("--bwd-weight-time", type=float, default=1.0, help="zero_bubble, zbv: time of one W (weight grad)")
    p.add_argument("--width", type=int, default=100, help="columns of the rendered timeline")
    args = p.parse_args(argv)
    names = ["1f1b", "gpipe"] if args.schedule == "both" else [args.schedule]
    for name in names:
        v = args.virtual_stages if args.virtual_stages is not None else (2 if SCHEDULES[name].chunks else 1)
        try:
            build(name, args.pp, args.micro_batches, 0, v)  # check the arguments before printing anything
        except ValueError as e:
            p.error(str(e))  # one line, exit status 2
        _print_schedule(name, args, v)


if __name__ == "__main__":
    main()
