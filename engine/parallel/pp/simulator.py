"""Event simulation of pipeline schedules (per-rank action lists, engine/parallel/pp/actions.py): the proof that a
schedule is deadlock-free and complete under NCCL's point-to-point rules, its timeline, bubble and activation
memory, without processes or torch.

The model of NCCL (issue 24; the NCCL shim over gloo in the tests implements the same rules):
- A rank walks its actions in order; each maximal run of consecutive comm actions is ONE batch (one
  dist.batch_isend_irecv, actions.steps), as PipelineExecutor.run posts them.
- A rank's batches start in issue order, each only once the rank's previous batch has completed (one p2p stream)
  and the computes issued before it have ended.
- Messages between two ranks are matched in posting order per direction (one FIFO channel per (sender, receiver),
  no tags). With virtual stages (Narayanan et al. 2021, Sec. 2.2.2) the receiver of chunk c's forward on rank r
  is rank r+1, or chunk c+1 of rank 0 when r is the last rank; at pp=2 the next and the previous rank coincide,
  so forwards and backwards share a channel and must be posted in the order the peer takes them.
- Rendezvous: an op completes when the batch holding its partner op (on the peer) has STARTED; a send alone never
  completes (no buffering). A batch completes when all its ops have, at the latest of its own start and its
  partners' batch starts (communication is free), so bubble and makespan are those NCCL gives.
- After a batch holding a receive the rank waits for it (the data is needed); after a send-only batch it goes on
  computing, but its next batch still queues behind it.
Computes take their cost. A schedule that passes here cannot deadlock under NCCL; a buffered-send model (a send
never waits) passes tables that hang on NCCL (today's interleaved order at m >= 2pp before issue 24), so none is
kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.parallel.pp.actions import DIRECTION, Action, Op, Step, locate, max_in_flight, peer, steps, virtual_stage

# The computes each (micro-batch, chunk) must have run on a rank before the next one; complete runs.
_BEFORE = {Op.FWD: (), Op.BWD: (Op.FWD,), Op.BWD_INPUT: (Op.FWD,), Op.BWD_WEIGHT: (Op.FWD, Op.BWD_INPUT)}
_COMPLETE = ((Op.FWD, Op.BWD), (Op.FWD, Op.BWD_INPUT, Op.BWD_WEIGHT))
_SENDER = {Op.RECV_FWD: Op.SEND_FWD, Op.RECV_BWD: Op.SEND_BWD}
_SENDS = (Op.SEND_FWD, Op.SEND_BWD)


def _names(ops: tuple[Op, ...]) -> str:
    return " ".join(o.value for o in ops) or "nothing"


def _batch(actions: tuple[Action, ...]) -> str:
    return "[" + " ".join(map(str, actions)) + "]"


@dataclass
class Timeline:
    """Simulated run: intervals[s] = [(start, end, action)] of rank s's computes; idle[s] = makespan - busy;
    peak_in_flight[s] = most (micro-batch, chunk) activations held at once (until BWD, or until W;
    engine.parallel.pp.actions.max_in_flight)."""

    schedule: str
    pp: int
    micro_batches: int
    intervals: list[list[tuple[float, float, Action]]]
    makespan: float
    idle: list[float]
    virtual_stages: int = 1
    peak_in_flight: list[int] = field(default_factory=list)


@dataclass
class _Batch:
    """A started batch: its rank, actions, start time, and per op its (channel, side, position in the channel)."""

    rank: int
    actions: tuple[Action, ...]
    start: float
    slots: list[tuple[tuple[int, int], str, int]]

    @property
    def receives(self) -> bool:
        return any(a.op not in _SENDS for a in self.actions)


class _Run:
    """The state of one simulated step: each rank's position, compute clock and open batch, the channels."""

    def __init__(self, stages: list[list[Action]], cost: dict[Op, float], vshape: bool = False):
        self.steps: list[list[Step]] = [steps(actions) for actions in stages]
        self.cost, self.pp, self.vshape = cost, len(stages), vshape
        self.v = 1 + max((a.chunk for actions in stages for a in actions), default=0)
        self.pos, self.clock, self.comm_free = [0] * self.pp, [0.0] * self.pp, [0.0] * self.pp
        self.open: list[_Batch | None] = [None] * self.pp  # started, not yet completed
        # (sender, receiver) -> {"send": [(action, batch)], "recv": [...]}, in posting (= matching) order
        self.channels: dict[tuple[int, int], dict[str, list[tuple[Action, _Batch]]]] = {}
        self.received: set[tuple[int, str, int, int]] = set()  # (rank, direction, chunk, mb)
        self.ran: dict[tuple[int, int, int], tuple[Op, ...]] = {}  # (rank, chunk, mb) -> computes so far
        self.intervals: list[list[tuple[float, float, Action]]] = [[] for _ in stages]

    def advance(self, s: int) -> bool:
        """Run rank s until it blocks (on its open batch) or ends; True if it moved."""
        moved = False
        while True:
            b = self.open[s]
            if b is not None and self._try_complete(b):
                moved = True
                continue
            if self.pos[s] == len(self.steps[s]):
                return moved
            step = self.steps[s][self.pos[s]]
            if b is not None and (b.receives or isinstance(step, tuple)):
                return moved  # waiting for the data, or the p2p stream is busy with the open batch
            if isinstance(step, tuple):
                self._start(s, step)
            else:
                self._compute(s, step)
            self.pos[s] += 1
            moved = True

    def _peer(self, s: int, a: Action) -> tuple[int, int] | None:
        return peer(self.pp, self.v, s, a, self.vshape)

    def _local_input(self, s: int, a: Action) -> bool | None:
        """In a V, the turn's input is handed over on the rank: chunk 1's F of rank pp-1 reads chunk 0's output
        and chunk 0's B reads chunk 1's input gradient. True if that compute has run, None off the turn."""
        if not self.vshape or a.op is Op.BWD_WEIGHT:
            g = -1
        else:
            g = virtual_stage(self.pp, s, a.chunk, True) + (-1 if a.op is Op.FWD else 1)
        if not 0 <= g < 2 * self.pp or locate(self.pp, g, True)[0] != s:
            return None
        return a.op in self.ran.get((s, locate(self.pp, g, True)[1], a.mb), ())

    def _compute(self, s: int, a: Action) -> None:
        key = (s, a.chunk, a.mb)
        done = self.ran.get(key, ())
        if done != _BEFORE[a.op]:
            raise RuntimeError(
                f"stage {s} runs {a} after {_names(done)} of micro-batch {a.mb} chunk {a.chunk}; "
                f"it must follow exactly {_names(_BEFORE[a.op])}"
            )
        if a.op is not Op.BWD_WEIGHT:  # W reads only what F and B left on this rank
            recv = Action(Op.RECV_FWD if a.op is Op.FWD else Op.RECV_BWD, a.mb, a.chunk)
            if self._peer(s, recv) and (s, DIRECTION[recv.op][1], a.chunk, a.mb) not in self.received:
                raise RuntimeError(f"stage {s} runs {a} before receiving its input")
            if self._local_input(s, a) is False:
                raise RuntimeError(f"stage {s} runs {a} before the other chunk at the V's turn computed its input")
        self.ran[key] = done + (a.op,)
        end = self.clock[s] + self.cost[a.op]
        self.intervals[s].append((self.clock[s], end, a))
        self.clock[s] = end

    def _start(self, s: int, actions: tuple[Action, ...]) -> None:
        """Start a batch on rank s (its previous batch has completed): claim each op's place in its channel."""
        b = _Batch(s, actions, max(self.clock[s], self.comm_free[s]), [])
        for a in actions:
            if self._peer(s, a) is None:
                target = virtual_stage(self.pp, s, a.chunk, self.vshape) + DIRECTION[a.op][0]
                raise RuntimeError(f"stage {s} {a}: no virtual stage {target} (valid: 0..{self.pp * self.v - 1})")
            other = self._peer(s, a)[0]
            if a.op in _SENDS:
                source = (Op.FWD,) if a.op is Op.SEND_FWD else (Op.BWD, Op.BWD_INPUT)
                if not any(op in self.ran.get((s, a.chunk, a.mb), ()) for op in source):
                    raise RuntimeError(f"stage {s} runs {a} before computing what it sends")
            key, side = ((s, other), "send") if a.op in _SENDS else ((other, s), "recv")
            channel = self.channels.setdefault(key, {"send": [], "recv": []})
            n = len(channel[side])
            channel[side].append((a, b))
            b.slots.append((key, side, n))
            self._check_match(key, n)
        self.open[s] = b

    def _check_match(self, key: tuple[int, int], n: int) -> None:
        """The n-th send and the n-th receive of a channel meet: they must be the same (micro-batch, chunk)."""
        channel = self.channels[key]
        if n >= len(channel["send"]) or n >= len(channel["recv"]):
            return
        (sent, _), (got, _) = channel["send"][n], channel["recv"][n]
        src, dst = key
        if (sent.op, sent.mb, sent.chunk) != (_SENDER[got.op], got.mb, self._peer(dst, got)[1]):
            raise RuntimeError(f"stage {dst} {got} matched {sent} of stage {src}: the two post in different orders")

    def _partner(self, key: tuple[int, int], side: str, n: int) -> _Batch | None:
        other = self.channels[key]["recv" if side == "send" else "send"]
        return other[n][1] if n < len(other) else None

    def _try_complete(self, b: _Batch) -> bool:
        """Complete rank b.rank's open batch if every partner batch has started (rendezvous)."""
        partners = [self._partner(*slot) for slot in b.slots]
        if any(p is None for p in partners):
            return False
        end = max([b.start] + [p.start for p in partners])
        s = b.rank
        for a in b.actions:
            if a.op not in _SENDS:
                self.received.add((s, DIRECTION[a.op][1], a.chunk, a.mb))
        if b.receives:
            self.clock[s] = max(self.clock[s], end)
        self.comm_free[s], self.open[s] = end, None
        return True

    def _queued(self, rank: int, key: tuple[int, int], side: str, n: int) -> tuple[Action, tuple] | None:
        """The op of `rank` (not yet started) that will take place n on `side` of channel `key`, and its batch."""
        have = len(self.channels[key][side])
        for step in self.steps[rank][self.pos[rank] :]:
            for a in step if isinstance(step, tuple) else ():
                there = self._peer(rank, a)
                on = ((rank, there[0]) if a.op in _SENDS else (there[0], rank)) if there else None
                if on == key and (a.op in _SENDS) == (side == "send"):
                    if have == n:
                        return a, step
                    have += 1
        return None

    def _waits_for(self, b: _Batch) -> str:
        """What the open batch b waits for: each unmatched op and the peer's queued batch that would match it."""
        waits = []
        for a, (key, side, n) in zip(b.actions, b.slots):
            if self._partner(key, side, n) is not None:
                continue
            other, their = (key[1], "recv") if side == "send" else (key[0], "send")
            queued = self._queued(other, key, their, n)
            if queued is None and a.op in _SENDS:
                raise RuntimeError(f"stage {b.rank} {a} to stage {other} is never received")
            waits.append(
                f"{a} waits for stage {other}, which never sends it"
                if queued is None
                else f"{a} waits for stage {other}'s {queued[0]} in its batch {_batch(queued[1])}"
            )
        return f"stage {b.rank} in {_batch(b.actions)}: " + ", ".join(waits)

    def check_complete(self) -> None:
        """No rank blocked, every (micro-batch, chunk) ran F then BWD, or F, B, W, once."""
        blocked = [self._waits_for(b) for b in self.open if b is not None]
        if blocked:
            raise RuntimeError("deadlock: " + "; ".join(blocked))
        m = 1 + max((mb for _, _, mb in self.ran), default=-1)
        complete = ((Op.FWD,),) if all(len(r) == 1 for r in self.ran.values()) else _COMPLETE  # forward only
        for s in range(self.pp):
            for chunk in range(self.v):
                for mb in range(m):
                    ran = self.ran.get((s, chunk, mb), ())
                    if ran not in complete:
                        raise RuntimeError(
                            f"stage {s} micro-batch {mb} chunk {chunk} ran {_names(ran)} "
                            f"(expected {' or '.join(map(_names, complete))})"
                        )


def simulate_actions(
    stages: list[list[Action]],
    fwd_time: float = 1.0,
    bwd_time: float = 2.0,
    schedule: str = "custom",
    bwd_input_time: float = 1.0,
    bwd_weight_time: float = 1.0,
    vshape: bool = False,
) -> Timeline:
    """Run per-rank action lists against each other under NCCL's rules (module docstring) and check them.

    Costs: FWD fwd_time, BWD bwd_time (1F1B's F=1, B=2 by default), zero bubble's BWD_INPUT bwd_input_time and
    BWD_WEIGHT bwd_weight_time (F=B=W=1 by default). Raises RuntimeError for a deadlock (naming each blocked rank's
    open batch, each of its ops still unmatched and the peer's batch that would match it), a receive that meets
    another micro-batch's send, a send never received, a compute before its input arrived, and a (micro-batch,
    chunk) whose computes on a rank are not exactly F then BWD, or F, B, W. ``vshape``: the chunks sit in ZB-V's
    V (engine/parallel/pp/actions.py), whose turn is a local hand-off checked for order instead of a message.
    Ranks are advanced in turn until none can move; the times depend only on the dependencies.
    """
    cost = {Op.FWD: fwd_time, Op.BWD: bwd_time, Op.BWD_INPUT: bwd_input_time, Op.BWD_WEIGHT: bwd_weight_time}
    run = _Run(stages, cost, vshape)
    while any([run.advance(s) for s in range(run.pp)]):  # a list: advance every rank each round
        pass
    run.check_complete()
    makespan = max(max(run.clock, default=0.0), max(run.comm_free, default=0.0))
    idle = [makespan - sum(e - b for b, e, _ in iv) for iv in run.intervals]
    m = 1 + max((mb for _, _, mb in run.ran), default=-1)
    # a rank computes in its table's order, so the table's count (actions.max_in_flight, the one count) is the run's
    return Timeline(schedule, run.pp, m, run.intervals, makespan, idle, run.v, [max_in_flight(a) for a in stages])


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
    rows = [
        f"{timeline.schedule} pp={timeline.pp}{v} m={timeline.micro_batches} makespan={timeline.makespan:g} "
        f"({scale:g} columns per time unit)"
    ]
    for s, iv in enumerate(timeline.intervals):
        row = ["."] * cols
        for start, end, a in iv:
            lo, hi = round(start * scale), round(end * scale)
            label = str(a) if len(str(a)) <= hi - lo else str(a)[0] * (hi - lo)
            row[lo:hi] = label.ljust(hi - lo)
        rows.append(f"stage {s} |{''.join(row)}|")
    return "\n".join(rows)
