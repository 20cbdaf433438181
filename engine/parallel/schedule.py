"""Pipeline schedules as data: for each stage, the ordered list of actions it runs (no processes, no torch).

A schedule is a pure function `(pp, micro_batches, stage) -> list[Action]`. The executor walks the list and
turns each RECV/SEND into a p2p op; here it can be printed, simulated and unit-tested without any processes.

- 1F1B, non-interleaved (PipeDream-Flush): Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", Sec. 2.2.1, Fig. 4 (top).
- GPipe: Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism".

Both have the bubble fraction (p-1)/(m+p-1) of the makespan (Narayanan et al. 2021, Sec. 2.2.1); 1F1B keeps at
most `pp - stage` activations alive instead of GPipe's m. Run `python -m engine.parallel.schedule --pp 4
--micro-batches 8` to print both.
"""
from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass


class Op(str, enum.Enum):
    """What a stage does, in order."""
    RECV_FWD = "recv_fwd"  # receive the activation of micro-batch mb from stage-1   (not on the first stage)
    FWD = "fwd"            # forward micro-batch mb
    SEND_FWD = "send_fwd"  # send the output of mb to stage+1                         (not on the last stage)
    RECV_BWD = "recv_bwd"  # receive d(loss)/d(output) of mb from stage+1            (not on the last stage)
    BWD = "bwd"            # backward micro-batch mb
    SEND_BWD = "send_bwd"  # send d(loss)/d(input) of mb to stage-1                   (not on the first stage)


_SHORT = {Op.RECV_FWD: "recvF", Op.FWD: "F", Op.SEND_FWD: "sendF",
          Op.RECV_BWD: "recvB", Op.BWD: "B", Op.SEND_BWD: "sendB"}


@dataclass(frozen=True)
class Action:
    op: Op
    mb: int

    def __str__(self) -> str:  # "F3", "B0", "recvF3", "sendB0"
        return f"{_SHORT[self.op]}{self.mb}"


def _forward(pp: int, stage: int, mb: int) -> list[Action]:
    """FWD of mb wrapped in its receive (not on the first stage) and send (not on the last stage)."""
    return ([Action(Op.RECV_FWD, mb)] if stage > 0 else []) + [Action(Op.FWD, mb)] \
        + ([Action(Op.SEND_FWD, mb)] if stage < pp - 1 else [])


def _backward(pp: int, stage: int, mb: int) -> list[Action]:
    """BWD of mb wrapped in its receive (not on the last stage) and send (not on the first stage)."""
    return ([Action(Op.RECV_BWD, mb)] if stage < pp - 1 else []) + [Action(Op.BWD, mb)] \
        + ([Action(Op.SEND_BWD, mb)] if stage > 0 else [])


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


def forward_only(pp: int, micro_batches: int, stage: int) -> list[Action]:
    """Evaluation: every micro-batch forwarded (received from stage-1, sent to stage+1), nothing backwarded."""
    return [a for mb in range(micro_batches) for a in _forward(pp, stage, mb)]


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def build(schedule: str, pp: int, micro_batches: int, stage: int) -> list[Action]:
    """The action list of `stage`, after checking every argument (the error names the bad value)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got pp={pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} out of range for pp={pp}; valid: 0..{pp - 1}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got micro_batches={micro_batches}")
    if schedule == "1f1b" and micro_batches < pp:
        raise ValueError(f"1f1b needs micro_batches >= pp, got micro_batches={micro_batches} < pp={pp}")
    return SCHEDULES[schedule](pp, micro_batches, stage)


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches forwarded and not yet backwarded at any point (= activations held)."""
    alive = peak = 0
    for a in actions:
        alive += (a.op is Op.FWD) - (a.op is Op.BWD)
        peak = max(peak, alive)
    return peak


@dataclass
class Timeline:
    """Simulated run: intervals[s] = [(start, end, action)] of stage s's FWD/BWD; idle[s] = makespan - busy."""
    schedule: str
    pp: int
    micro_batches: int
    intervals: list[list[tuple[float, float, Action]]]
    makespan: float
    idle: list[float]


_CHANNEL = {Op.RECV_FWD: (-1, "fwd"), Op.SEND_FWD: (+1, "fwd"), Op.RECV_BWD: (+1, "bwd"), Op.SEND_BWD: (-1, "bwd")}


def simulate_actions(stages: list[list[Action]], fwd_time: float = 1.0, bwd_time: float = 2.0,
                     schedule: str = "custom") -> Timeline:
    """Run per-stage action lists against each other (see simulate()).

    Messages travel on FIFO channels keyed (sender, receiver, direction), as p2p ops match in posting order: the
    n-th RECV on a channel takes its n-th SEND and must name the same micro-batch (RuntimeError otherwise). A
    SEND is posted when the compute before it ends; a RECV waits until then. Stages are advanced in turn until
    none can move; the times depend only on data dependencies, not on the order stages are visited.
    """
    pp = len(stages)
    pos, clock = [0] * pp, [0.0] * pp
    posted: dict[tuple[int, int, str], list[tuple[int, float]]] = {}
    taken: dict[tuple[int, int, str], int] = {}
    intervals: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for s in range(pp):
            while pos[s] < len(stages[s]):
                a = stages[s][pos[s]]
                if a.op in (Op.FWD, Op.BWD):
                    end = clock[s] + (fwd_time if a.op is Op.FWD else bwd_time)
                    intervals[s].append((clock[s], end, a))
                    clock[s] = end
                elif a.op in (Op.SEND_FWD, Op.SEND_BWD):
                    step, way = _CHANNEL[a.op]
                    posted.setdefault((s, s + step, way), []).append((a.mb, clock[s]))
                else:
                    step, way = _CHANNEL[a.op]
                    key = (s + step, s, way)
                    n, queue = taken.get(key, 0), posted.get(key, [])
                    if n >= len(queue):
                        break  # blocked: the matching SEND has not been posted yet
                    if queue[n][0] != a.mb:
                        raise RuntimeError(f"stage {s} {a} matched send{way[0].upper()}{queue[n][0]} "
                                           f"of stage {s + step}: micro-batch order differs")
                    taken[key] = n + 1
                    clock[s] = max(clock[s], queue[n][1])
                pos[s] += 1
                progress = True
    if any(pos[s] < len(stages[s]) for s in range(pp)):
        blocked = [f"stage {s} at {stages[s][pos[s]]}" for s in range(pp) if pos[s] < len(stages[s])]
        raise RuntimeError("deadlock: " + ", ".join(blocked))
    makespan = max(clock, default=0.0)
    idle = [makespan - sum(e - b for b, e, _ in iv) for iv in intervals]
    return Timeline(schedule, pp, sum(a.op is Op.FWD for a in stages[0]) if pp else 0, intervals, makespan, idle)


def simulate(schedule: str, pp: int, micro_batches: int, fwd_time: float = 1.0, bwd_time: float = 2.0) -> Timeline:
    """Event simulation of all stages with the executor's semantics: sends are non-blocking (posted, never
    waited on); a RECV blocks until the matching SEND (same mb, same direction, neighbour stage) has been posted
    and the sender's compute producing it has finished; FWD/BWD take fwd_time/bwd_time; communication is free.
    Raises RuntimeError('deadlock: ...') naming each stage's blocked action if no stage can progress."""
    stages = [build(schedule, pp, micro_batches, s) for s in range(pp)]
    return simulate_actions(stages, fwd_time, bwd_time, schedule)


def bubble_fraction(timeline: Timeline) -> list[float]:
    """Per stage idle / makespan; theory (p-1)/(m+p-1) for both schedules (Narayanan et al. 2021, Sec. 2.2.1)."""
    return [i / timeline.makespan if timeline.makespan else 0.0 for i in timeline.idle]


def render(timeline: Timeline, width: int = 100) -> str:
    """ASCII timeline, one row per stage: "F0"/"B0" cells and "." for idle, time scaled to fit `width` columns
    (a whole number of columns per time unit when the makespan fits)."""
    t = timeline.makespan or 1.0
    scale = width // t if t <= width else width / t  # columns per time unit
    cols = round(t * scale)
    rows = [f"{timeline.schedule} pp={timeline.pp} m={timeline.micro_batches} makespan={timeline.makespan:g} "
            f"({scale:g} columns per time unit)"]
    for s, iv in enumerate(timeline.intervals):
        row = ["."] * cols
        for start, end, a in iv:
            lo, hi = round(start * scale), round(end * scale)
            label = str(a) if len(str(a)) <= hi - lo else str(a)[0] * (hi - lo)
            row[lo:hi] = label.ljust(hi - lo)
        rows.append(f"stage {s} |{''.join(row)}|")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print pipeline schedules, their simulated timelines and bubbles.")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--schedule", choices=[*SCHEDULES, "both"], default="both")
    p.add_argument("--fwd-time", type=float, default=1.0, help="time of one forward on one stage")
    p.add_argument("--bwd-time", type=float, default=2.0, help="time of one backward on one stage")
    p.add_argument("--width", type=int, default=100, help="columns of the rendered timeline")
    args = p.parse_args(argv)
    pp, m = args.pp, args.micro_batches
    for name in SCHEDULES if args.schedule == "both" else [args.schedule]:
        stages = [build(name, pp, m, s) for s in range(pp)]
        timeline = simulate(name, pp, m, args.fwd_time, args.bwd_time)
        print(f"== {name}: pp={pp} micro_batches={m} fwd={args.fwd_time:g} bwd={args.bwd_time:g}")
        for s, actions in enumerate(stages):
            print(f"actions stage {s}: {' '.join(map(str, actions))}")
        print(render(timeline, args.width))
        print("bubble fraction per stage: " + " ".join(f"{b:.4f}" for b in bubble_fraction(timeline))
              + f"  (theory (p-1)/(m+p-1) = {(pp - 1) / (m + pp - 1):.4f})")
        print("max activations in flight per stage: " + " ".join(str(max_in_flight(a)) for a in stages))
        print()


if __name__ == "__main__":
    main()
