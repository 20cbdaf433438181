"""Schedule tables as text, shared by the schedule tests: a rank's computations in order (computes), and its actions
with each batch of communication in brackets (render_steps)."""

from __future__ import annotations

from engine.parallel.pp.actions import steps
from engine.parallel.pp.schedule import (
    Action,
    Op,
)


def render_steps(actions: list[Action]) -> str:
    """F0 [sendF0 recvB0] B0: computes alone, each batch (actions.steps) in brackets."""
    return " ".join(str(s) if isinstance(s, Action) else "[" + " ".join(map(str, s)) + "]" for s in steps(actions))


def computes(actions: list[Action]) -> list[str]:
    return [str(a) for a in actions if a.op in (Op.FWD, Op.BWD, Op.BWD_INPUT, Op.BWD_WEIGHT)]
