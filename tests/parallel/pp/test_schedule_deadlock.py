"""Every table the planner's search can build runs to completion under NCCL's point-to-point rules (issue 24):
engine/parallel/pp/simulator.py's model (one batch per run of comm actions, a rank's batches in order, rendezvous
sends, per-pair FIFO matching). The search (engine/planning/search.py) tries engine.planning.schedules.SEARCHED
(1f1b, interleaved v = 2..4, zero_bubble, zbv) and the config's own schedule (gpipe too) at any pp dividing the world
and any micro-batch count the global batch gives; here pp 2..16 and every valid m up to 4pp, each training table
and its forward-only (evaluation) table. The full sweep is marked slow (152 s in a plain script, 398 s niced
under the shared machine's load: it grows with pp^2 m); the unmarked subset (pp 2..5 in full, pp 8 at m = pp,
2pp, 4pp) takes seconds.
"""

from __future__ import annotations

import pytest

from engine.kinds.schedules import SCHEDULES
from engine.parallel.pp import schedule as sched
from engine.planning.schedules import SEARCHED

BUILT = (*SEARCHED, ("gpipe", 1))  # gpipe: not searched, but a config may name it


def tables(pp: int, ms: list[int] | None = None):
    """(schedule, m, v) of every table build() accepts at this pp with m in ms (default 1..4pp)."""
    for name, v in BUILT:
        for m in ms or range(1, 4 * pp + 1):
            try:
                sched.check(name, pp, m, v)
            except ValueError:
                continue
            yield name, m, v


def check_tables(pp: int, ms: list[int] | None = None) -> int:
    """Simulate each table, training and evaluation; raises the simulator's RuntimeError (naming the deadlocked
    batches) on the first that fails. Returns how many were checked."""
    n = 0
    for name, m, v in tables(pp, ms):
        sched.simulate(name, pp, m, virtual_stages=v)
        vshape = SCHEDULES[name].vshape  # zbv: chunks in a V, the turn a local hand-off
        sched.simulate_actions([sched.forward_only(pp, m, s, v, vshape) for s in range(pp)], vshape=vshape)
        n += 1
    return n


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_every_planner_table_is_deadlock_free_small_pp(pp):
    # 1f1b, zero_bubble: m = pp..4pp; gpipe, zbv: 1..4pp; interleaved v = 2, 3, 4: m = pp, 2pp, 3pp, 4pp
    assert check_tables(pp) == 2 * (3 * pp + 1) + 2 * 4 * pp + 3 * 4


def test_planner_tables_deadlock_free_pp8_subset():
    assert check_tables(8, [8, 16, 32]) == 6 * 3 + 3


@pytest.mark.slow
@pytest.mark.parametrize("pp", range(2, 17))
def test_every_planner_table_is_deadlock_free(pp):
    assert check_tables(pp) == 2 * (3 * pp + 1) + 2 * 4 * pp + 3 * 4
