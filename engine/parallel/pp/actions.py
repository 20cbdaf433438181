"""The vocabulary of pipeline schedules: operations, actions, their sends and receives, and who talks to whom.

A schedule (engine/parallel/pp/schedule.py; what each declares: engine/kinds/schedules.py) is, per pipeline
rank, an ordered list of Actions. Two extensions of
plain 1F1B live in this vocabulary:

- Virtual stages (interleaved 1F1B; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", Sec. 2.2.2): the layers are split into pp*v chunks and rank r holds chunks
  r, r+pp, r+2pp, ...; an Action's `chunk` is the rank-local index c, so its global (virtual) stage is c*pp + r.
  Activations go from virtual stage g to g+1: from chunk c of rank pp-1 on to chunk c+1 of rank 0.
- Split backward (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 2): BWD_INPUT (B) computes
  d(loss)/d(input), which the previous stage waits for; BWD_WEIGHT (W) computes d(loss)/d(weights), which nothing
  waits for, so it can be deferred into bubbles. A micro-batch's activations are held until its W.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(str, enum.Enum):
    """What a stage does, in order."""

    RECV_FWD = "recv_fwd"  # receive the activation of micro-batch mb from the previous virtual stage (not the first)
    FWD = "fwd"  # forward micro-batch mb
    SEND_FWD = "send_fwd"  # send the output of mb to the next virtual stage                   (not from the last)
    RECV_BWD = "recv_bwd"  # receive d(loss)/d(output) of mb from the next virtual stage       (not on the last)
    BWD = "bwd"  # whole backward of micro-batch mb (1F1B, GPipe, interleaved)
    SEND_BWD = "send_bwd"  # send d(loss)/d(input) of mb to the previous virtual stage         (not from the first)
    BWD_INPUT = "bwd_input"  # zero-bubble B: d(loss)/d(input) only; SEND_BWD follows it
    BWD_WEIGHT = "bwd_weight"  # zero-bubble W: d(loss)/d(weights); frees mb's activations


_SHORT = {
    Op.RECV_FWD: "recvF",
    Op.FWD: "F",
    Op.SEND_FWD: "sendF",
    Op.RECV_BWD: "recvB",
    Op.BWD: "B",
    Op.SEND_BWD: "sendB",
    Op.BWD_INPUT: "B",
    Op.BWD_WEIGHT: "W",
}  # B: the zero-bubble papers' letters
COMPUTE_OPS = (Op.FWD, Op.BWD, Op.BWD_INPUT, Op.BWD_WEIGHT)
COMM_OPS = (Op.RECV_FWD, Op.SEND_FWD, Op.RECV_BWD, Op.SEND_BWD)
# Which way a message of each comm op travels along the virtual stages, and which pass it belongs to.
DIRECTION = {Op.RECV_FWD: (-1, "fwd"), Op.SEND_FWD: (+1, "fwd"), Op.RECV_BWD: (+1, "bwd"), Op.SEND_BWD: (-1, "bwd")}


@dataclass(frozen=True)
class Action:
    op: Op
    mb: int
    chunk: int = 0  # rank-local model chunk (virtual stage chunk * pp + rank); 0 without virtual stages

    def __str__(self) -> str:  # "F3", "B0", "recvF3", "sendB0"; chunk 1: "F3.1"
        return f"{_SHORT[self.op]}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def virtual_stage(pp: int, rank: int, chunk: int, vshape: bool = False) -> int:
    """Global (virtual) stage of rank-local chunk `chunk`: chunk*pp + rank (interleaved), or in a V (ZB-V,
    2 chunks) rank for chunk 0 and 2pp-1-rank for chunk 1."""
    return (2 * pp - 1 - rank if chunk else rank) if vshape else chunk * pp + rank


def locate(pp: int, g: int, vshape: bool = False) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage g: the inverse of virtual_stage."""
    if vshape:
        return (g, 0) if g < pp else (2 * pp - 1 - g, 1)
    return g % pp, g // pp


def peer(pp: int, v: int, rank: int, a: Action, vshape: bool = False) -> tuple[int, int] | None:
    """(rank, chunk) at the other end of comm action `a` run by `rank`, or None if there is none (a receive of
    the forward on virtual stage 0, a send of the forward from the last virtual stage pp*v - 1, and in a V the
    turn pp-1 -> pp, which stays on rank pp-1: a local hand-off, not a message)."""
    step, _ = DIRECTION[a.op]
    g = virtual_stage(pp, rank, a.chunk, vshape) + step
    if not 0 <= g < pp * v:
        return None
    other = locate(pp, g, vshape)
    return None if vshape and other[0] == rank else other


def forward_actions(pp: int, stage: int, mb: int, chunk: int = 0, v: int = 1, vshape: bool = False) -> list[Action]:
    """FWD of (mb, chunk) wrapped in its receive (not on virtual stage 0) and send (not on the last one; in a V,
    none at the turn, where the next virtual stage is on this rank)."""
    fwd = Action(Op.FWD, mb, chunk)
    recv, send = Action(Op.RECV_FWD, mb, chunk), Action(Op.SEND_FWD, mb, chunk)
    return [a for a in (recv, fwd, send) if a is fwd or peer(pp, v, stage, a, vshape) is not None]


def backward_actions(
    pp: int, stage: int, mb: int, chunk: int = 0, v: int = 1, op: Op = Op.BWD, vshape: bool = False
) -> list[Action]:
    """BWD (or zero-bubble BWD_INPUT) of (mb, chunk) wrapped in its receive (not on the last virtual stage) and
    send (not on virtual stage 0; in a V, neither at the turn). A BWD_WEIGHT needs neither: nothing waits for it."""
    bwd = Action(op, mb, chunk)
    recv, send = Action(Op.RECV_BWD, mb, chunk), Action(Op.SEND_BWD, mb, chunk)
    return [a for a in (recv, bwd, send) if a is bwd or peer(pp, v, stage, a, vshape) is not None]


RELEASES = (Op.BWD, Op.BWD_WEIGHT)  # the computes after which a micro-batch's activations are freed


def max_in_flight(actions: list[Action]) -> int:
    """The most (micro-batch, chunk) pairs forwarded and not yet released (= activations held): released by BWD,
    or by W under zero bubble (B keeps what W reads). With v chunks, each counts 1/v of a stage's activations.
    The one count of activations in flight: the simulator (simulator.Timeline.peak_in_flight) and the planner
    (engine/planning/schedules.py InFlight.count) both report this (tests/parallel/pp/test_schedule.py checks they
    agree)."""
    alive = peak = 0
    for a in actions:
        alive += (a.op is Op.FWD) - (a.op in RELEASES)
        peak = max(peak, alive)
    return peak


Step = Action | tuple[Action, ...]


def steps(actions: list[Action]) -> list[Step]:
    """A rank's action list as the executor issues it: each compute Action alone, each maximal run of consecutive
    comm actions as one tuple, posted as ONE batch (one dist.batch_isend_irecv call; under NCCL one Work, run in
    issue order on the rank's p2p stream). Example: F0 sendF0 recvB0 B0 -> F0, (sendF0, recvB0), B0."""
    out: list[Step] = []
    for a in actions:
        if a.op in COMM_OPS and out and isinstance(out[-1], tuple):
            out[-1] = out[-1] + (a,)
        elif a.op in COMM_OPS:
            out.append((a,))
        else:
            out.append(a)
    return out
