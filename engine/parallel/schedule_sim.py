"""Event simulation of pipeline schedules (per-rank action lists, engine/parallel/actions.py): the proof that a
schedule is deadlock-free and complete, its timeline, bubble and activation memory, without processes or torch.

Semantics are the executor's (engine/parallel/pipeline.py): sends are non-blocking (posted, never waited on); a
receive blocks until the matching send has been posted, and then until the sender's compute producing it ended;
computes take their cost; communication is free. Messages travel on one FIFO channel per (sender rank, receiver
rank), as NCCL matches p2p ops between two ranks in posting order with no tags. With virtual stages (Narayanan
et al. 2021, Sec. 2.2.2) the receiver of chunk c's forward on rank r is rank r+1, or chunk c+1 of rank 0 when r is
the last rank; at pp=2 the next and the previous rank coincide, so forwards and backwards share a channel and
must be posted in the order the peer takes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.parallel.actions import COMM_OPS, DIRECTION, Action, Op, peer

# The computes each (micro-batch, chunk) must have run on a rank before the next one; complete runs.
_BEFORE = {Op.FWD: (), Op.BWD: (Op.FWD,), Op.BWD_INPUT: (Op.FWD,), Op.BWD_WEIGHT: (Op.FWD, Op.BWD_INPUT)}
_COMPLETE = ((Op.FWD, Op.BWD), (Op.FWD, Op.BWD_INPUT, Op.BWD_WEIGHT))
_RELEASES = (Op.BWD, Op.BWD_WEIGHT)  # the computes after which a micro-batch's activations are freed
_SENDER = {Op.RECV_FWD: Op.SEND_FWD, Op.RECV_BWD: Op.SEND_BWD}


def _names(ops: tuple[Op, ...]) -> str:
    return " ".join(o.value for o in ops) or "nothing"


@dataclass
class Timeline:
    """Simulated run: intervals[s] = [(start, end, action)] of rank s's computes; idle[s] = makespan - busy;
    peak_in_flight[s] = most (micro-batch, chunk) activations held at once (until BWD, or until W)."""
    schedule: str
    pp: int
    micro_batches: int
    intervals: list[list[tuple[float, float, Action]]]
    makespan: float
    idle: list[float]
    virtual_stages: int = 1
    peak_in_flight: list[int] = field(default_factory=list)


class _Run:
    """The state of one simulated step: each rank's position and clock, the channels, what each ran."""

    def __init__(self, stages: list[list[Action]], cost: dict[Op, float]):
        self.stages, self.cost, self.pp = stages, cost, len(stages)
        self.v = 1 + max((a.chunk for actions in stages for a in actions), default=0)
        self.pos, self.clock = [0] * self.pp, [0.0] * self.pp
        self.alive, self.peak = [0] * self.pp, [0] * self.pp
        self.posted: dict[tuple[int, int], list[tuple[Action, float]]] = {}  # (sender, receiver) -> sends
        self.taken: dict[tuple[int, int], int] = {}
        self.received: set[tuple[int, str, int, int]] = set()  # (rank, direction, chunk, mb)
        self.ran: dict[tuple[int, int, int], tuple[Op, ...]] = {}  # (rank, chunk, mb) -> computes so far
        self.intervals: list[list[tuple[float, float, Action]]] = [[] for _ in stages]

    def advance(self, s: int) -> bool:
        """Run rank s until it blocks on a receive or ends; True if it moved."""
        moved = False
        while self.pos[s] < len(self.stages[s]):
            a = self.stages[s][self.pos[s]]
            if a.op in COMM_OPS and self._peer(s, a) is None:
                target = a.chunk * self.pp + s + DIRECTION[a.op][0]
                raise RuntimeError(f"stage {s} {a}: no virtual stage {target} (valid: 0..{self.pp * self.v - 1})")
            if a.op in (Op.SEND_FWD, Op.SEND_BWD):
                self._send(s, a)
            elif a.op in (Op.RECV_FWD, Op.RECV_BWD):
                if not self._receive(s, a):
                    return moved  # blocked: the matching send has not been posted yet
            else:
                self._compute(s, a)
            self.pos[s] += 1
            moved = True
        return moved

    def _peer(self, s: int, a: Action) -> tuple[int, int] | None:
        return peer(self.pp, self.v, s, a)

    def _compute(self, s: int, a: Action) -> None:
        key = (s, a.chunk, a.mb)
        done = self.ran.get(key, ())
        if done != _BEFORE[a.op]:
            raise RuntimeError(f"stage {s} runs {a} after {_names(done)} of micro-batch {a.mb} chunk {a.chunk}; "
                               f"it must follow exactly {_names(_BEFORE[a.op])}")
        if a.op is not Op.BWD_WEIGHT:  # W reads only what F and B left on this rank
            recv = Action(Op.RECV_FWD if a.op is Op.FWD else Op.RECV_BWD, a.mb, a.chunk)
            if self._peer(s, recv) and (s, DIRECTION[recv.op][1], a.chunk, a.mb) not in self.received:
                raise RuntimeError(f"stage {s} runs {a} before receiving its input")
        self.ran[key] = done + (a.op,)
        end = self.clock[s] + self.cost[a.op]
        self.intervals[s].append((self.clock[s], end, a))
        self.clock[s] = end
        self.alive[s] += (a.op is Op.FWD) - (a.op in _RELEASES)
        self.peak[s] = max(self.peak[s], self.alive[s])

    def _send(self, s: int, a: Action) -> None:
        source = (Op.FWD,) if a.op is Op.SEND_FWD else (Op.BWD, Op.BWD_INPUT)
        if not any(op in self.ran.get((s, a.chunk, a.mb), ()) for op in source):
            raise RuntimeError(f"stage {s} runs {a} before computing what it sends")
        dst, _ = self._peer(s, a)
        self.posted.setdefault((s, dst), []).append((a, self.clock[s]))

    def _receive(self, s: int, a: Action) -> bool:
        (src, src_chunk), way = self._peer(s, a), DIRECTION[a.op][1]
        key = (src, s)
        n, queue = self.taken.get(key, 0), self.posted.get(key, [])
        if n >= len(queue):
            return False
        sent, at = queue[n]
        if (sent.op, sent.mb, sent.chunk) != (_SENDER[a.op], a.mb, src_chunk):
            raise RuntimeError(f"stage {s} {a} matched {sent} of stage {src}: the two post in different orders")
        self.taken[key] = n + 1
        self.received.add((s, way, a.chunk, a.mb))
        self.clock[s] = max(self.clock[s], at)
        return True

    def check_complete(self) -> None:
        """No rank blocked, no message unreceived, every (micro-batch, chunk) ran F then BWD, or F, B, W, once."""
        blocked = [f"stage {s} at {self.stages[s][self.pos[s]]}" for s in range(self.pp)
                   if self.pos[s] < len(self.stages[s])]
        if blocked:
            raise RuntimeError("deadlock: " + ", ".join(blocked))
        for (src, dst), queue in self.posted.items():
            for sent, _ in queue[self.taken.get((src, dst), 0):]:
                raise RuntimeError(f"stage {src} {sent} to stage {dst} is never received")
        m = 1 + max((mb for _, _, mb in self.ran), default=-1)
        complete = ((Op.FWD,),) if all(len(r) == 1 for r in self.ran.values()) else _COMPLETE  # forward only
        for s in range(self.pp):
            for chunk in range(self.v):
                for mb in range(m):
                    ran = self.ran.get((s, chunk, mb), ())
                    if ran not in complete:
                        raise RuntimeError(f"stage {s} micro-batch {mb} chunk {chunk} ran {_names(ran)} "
                                           f"(expected {' or '.join(map(_names, complete))})")


def simulate_actions(stages: list[list[Action]], fwd_time: float = 1.0, bwd_time: float = 2.0,
                     schedule: str = "custom", bwd_input_time: float = 1.0, bwd_weight_time: float = 1.0) -> Timeline:
    """Run per-rank action lists against each other (the semantics are in the module docstring) and check them.

    Costs: FWD fwd_time, BWD bwd_time (1F1B's F=1, B=2 by default), zero bubble's BWD_INPUT bwd_input_time and
    BWD_WEIGHT bwd_weight_time (F=B=W=1 by default). Raises RuntimeError for a deadlock (naming each rank's
    blocked action), a receive that meets another micro-batch's send, a send never received, a compute before
    its input arrived, and a (micro-batch, chunk) whose computes on a rank are not exactly F then BWD, or F, B, W.
    Ranks are advanced in turn until none can move; the times depend only on data dependencies.
    """
    cost = {Op.FWD: fwd_time, Op.BWD: bwd_time, Op.BWD_INPUT: bwd_input_time, Op.BWD_WEIGHT: bwd_weight_time}
    run = _Run(stages, cost)
    while any([run.advance(s) for s in range(run.pp)]):  # a list: advance every rank each round
        pass
    run.check_complete()
    makespan = max(run.clock, default=0.0)
    idle = [makespan - sum(e - b for b, e, _ in iv) for iv in run.intervals]
    m = 1 + max((mb for _, _, mb in run.ran), default=-1)
    return Timeline(schedule, run.pp, m, run.intervals, makespan, idle, run.v, run.peak)


def bubble_fraction(timeline: Timeline) -> list[float]:
    """Per rank idle / makespan. Theory: (p-1)/(m+p-1) for 1F1B and GPipe (Narayanan et al. 2021, Sec. 2.2.1),
    (p-1)/(v*m+p-1) for interleaved 1F1B (their Sec. 2.2.2: (p-1)/(v*m) of the ideal time), and
    (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)) for ZB-H1 (Qi et al. 2023, Sec. 3.1)."""
    return [i / timeline.makespan if timeline.makespan else 0.0 for i in timeline.idle]


def render(timeline: Timeline, width: int = 100) -> str:
    """ASCII timeline, one row per rank: "F0"/"B0"/"W0" (chunk c > 0: "F0.c") cells and "." for idle, time
    scaled to fit `width` columns (a whole number of columns per time unit when the makespan fits)."""
    t = timeline.makespan or 1.0
    scale = width // t if t <= width else width / t  # columns per time unit
    cols = round(t * scale)
    v = f" v={timeline.virtual_stages}" if timeline.virtual_stages > 1 else ""
    rows = [f"{timeline.schedule} pp={timeline.pp}{v} m={timeline.micro_batches} makespan={timeline.makespan:g} "
            f"({scale:g} columns per time unit)"]
    for s, iv in enumerate(timeline.intervals):
        row = ["."] * cols
        for start, end, a in iv:
            lo, hi = round(start * scale), round(end * scale)
            label = str(a) if len(str(a)) <= hi - lo else str(a)[0] * (hi - lo)
            row[lo:hi] = label.ljust(hi - lo)
        rows.append(f"stage {s} |{''.join(row)}|")
    return "\n".join(rows)
