"""Pipeline schedules as data (engine/parallel/schedule.py): pure Python, no processes.

Every property is checked from the action lists or the simulated timeline, never from hand-computed values,
over pp in (1, 2, 3, 4, 8) and micro_batches in pp..2pp+1 plus 16, for both schedules.
"""
from __future__ import annotations

import re

import pytest

from engine.parallel.schedule import (
    SCHEDULES, Action, Op, build, bubble_fraction, main, max_in_flight, render, simulate, simulate_actions,
)

CASES = sorted({(pp, m) for pp in (1, 2, 3, 4, 8) for m in [*range(pp, 2 * pp + 2), 16]})
ALL = [pytest.param(name, pp, m, id=f"{name}-pp{pp}-m{m}") for name in SCHEDULES for pp, m in CASES]


def mbs(actions: list[Action], op: Op) -> list[int]:
    return [a.mb for a in actions if a.op is op]


def test_action_str():
    assert [str(Action(op, 3)) for op in Op] == ["recvF3", "F3", "sendF3", "recvB3", "B3", "sendB3"]


@pytest.mark.parametrize("name,pp,m", ALL)
def test_each_micro_batch_forward_then_backward_once(name, pp, m):
    for stage in range(pp):
        actions = build(name, pp, m, stage)
        assert mbs(actions, Op.FWD) == list(range(m)), f"stage {stage}: forwards in order 0..m-1"
        assert mbs(actions, Op.BWD) == list(range(m)), f"stage {stage}: backwards in order 0..m-1 (both schedules)"
        for mb in range(m):
            assert actions.index(Action(Op.FWD, mb)) < actions.index(Action(Op.BWD, mb)), f"stage {stage} mb {mb}"


@pytest.mark.parametrize("name,pp,m", ALL)
def test_sends_and_receives_pair_up(name, pp, m):
    stages = [build(name, pp, m, s) for s in range(pp)]
    assert mbs(stages[0], Op.RECV_FWD) == [] and mbs(stages[0], Op.SEND_BWD) == []
    assert mbs(stages[-1], Op.SEND_FWD) == [] and mbs(stages[-1], Op.RECV_BWD) == []
    for s in range(pp - 1):
        assert mbs(stages[s], Op.SEND_FWD) == mbs(stages[s + 1], Op.RECV_FWD) == list(range(m))
        assert mbs(stages[s + 1], Op.SEND_BWD) == mbs(stages[s], Op.RECV_BWD) == list(range(m))
    # Each receive sits right before its compute and each send right after it, on the stages that have them.
    for s, actions in enumerate(stages):
        wrap = {Op.FWD: (Op.RECV_FWD if s > 0 else None, Op.SEND_FWD if s < pp - 1 else None),
                Op.BWD: (Op.RECV_BWD if s < pp - 1 else None, Op.SEND_BWD if s > 0 else None)}
        computes = [i for i, a in enumerate(actions) if a.op in wrap]
        assert len(computes) == 2 * m
        for i in computes:
            a, (recv, send) = actions[i], wrap[actions[i].op]
            before = actions[i - 1] if i > 0 else None
            after = actions[i + 1] if i + 1 < len(actions) else None
            if recv:
                assert before == Action(recv, a.mb), f"stage {s}: {a} not preceded by its receive"
            if send:
                assert after == Action(send, a.mb), f"stage {s}: {a} not followed by its send"
        expected = sum(1 + (r is not None) + (t is not None) for r, t in wrap.values()) * m
        assert len(actions) == expected, f"stage {s}: stray communication actions"


@pytest.mark.parametrize("name,pp,m", ALL)
def test_activations_in_flight(name, pp, m):
    for stage in range(pp):
        held = max_in_flight(build(name, pp, m, stage))
        if name == "1f1b":
            assert held <= pp - stage and held == min(pp - stage, m)
        else:
            assert held == m


@pytest.mark.parametrize("name,pp,m", ALL)
def test_simulated_bubble_matches_theory(name, pp, m):
    f, b = 1.0, 2.0
    timeline = simulate(name, pp, m, fwd_time=f, bwd_time=b)
    assert timeline.makespan == pytest.approx((m + pp - 1) * (f + b), abs=1e-9)
    for s, frac in enumerate(bubble_fraction(timeline)):
        assert abs(frac - (pp - 1) / (m + pp - 1)) < 1e-9, f"stage {s}"


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 3.0), (2.0, 1.0), (0.7, 1.9)])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 5), (4, 4), (4, 9), (8, 16)])
def test_simulated_makespan_other_time_ratios(name, f, b, pp, m):
    timeline = simulate(name, pp, m, fwd_time=f, bwd_time=b)
    assert timeline.makespan == pytest.approx((m + pp - 1) * (f + b), abs=1e-9)


@pytest.mark.parametrize("name,pp,m", ALL)
def test_simulated_intervals_respect_dependencies(name, pp, m):
    """The simulator's own output obeys the data flow: no overlap on a stage, F after the previous stage's F,
    B after the next stage's B (and after this stage's F)."""
    timeline = simulate(name, pp, m, fwd_time=1.0, bwd_time=2.0)
    end = {(s, a): e for s, iv in enumerate(timeline.intervals) for _, e, a in iv}
    for s, iv in enumerate(timeline.intervals):
        assert len(iv) == 2 * m
        assert all(e0 <= s1 for (_, e0, _), (s1, _, _) in zip(iv, iv[1:])), f"stage {s} overlaps"
        for start, stop, a in iv:
            assert stop - start == (1.0 if a.op is Op.FWD else 2.0)
            if a.op is Op.FWD and s > 0:
                assert start >= end[(s - 1, a)]
            if a.op is Op.BWD:
                assert start >= end[(s, Action(Op.FWD, a.mb))]
                if s < pp - 1:
                    assert start >= end[(s + 1, a)]


def test_simulate_reports_deadlock_naming_each_stage():
    stages = [[Action(Op.RECV_BWD, 0), Action(Op.FWD, 0), Action(Op.SEND_FWD, 0), Action(Op.BWD, 0)],
              [Action(Op.RECV_FWD, 0), Action(Op.FWD, 0), Action(Op.BWD, 0), Action(Op.SEND_BWD, 0)]]
    with pytest.raises(RuntimeError, match=r"deadlock: stage 0 at recvB0, stage 1 at recvF0"):
        simulate_actions(stages)


def test_simulate_rejects_mismatched_order():
    stages = [[Action(Op.FWD, 0), Action(Op.FWD, 1), Action(Op.SEND_FWD, 1), Action(Op.SEND_FWD, 0)],
              [Action(Op.RECV_FWD, 0), Action(Op.FWD, 0), Action(Op.RECV_FWD, 1), Action(Op.FWD, 1)]]
    with pytest.raises(RuntimeError, match=r"stage 1 recvF0 matched sendF1 of stage 0"):
        simulate_actions(stages)


@pytest.mark.parametrize("args,match", [
    (("zb", 4, 8, 0), r"'zb'.*1f1b, gpipe"),
    (("1f1b", 0, 8, 0), r"pp=0"),
    (("gpipe", 4, 8, 4), r"stage=4.*0\.\.3"),
    (("gpipe", 4, 8, -1), r"stage=-1.*0\.\.3"),
    (("gpipe", 4, 0, 0), r"micro_batches=0"),
    (("1f1b", 4, 3, 0), r"1f1b needs micro_batches >= pp.*micro_batches=3.*pp=4"),
])
def test_build_errors_name_the_bad_value(args, match):
    with pytest.raises(ValueError, match=match):
        build(*args)


def test_gpipe_allows_fewer_micro_batches_than_stages():
    assert bubble_fraction(simulate("gpipe", 4, 2)) == pytest.approx([3 / 5] * 4)


@pytest.mark.parametrize("width", [20, 40, 100])
def test_render_fits_width(width):
    timeline = simulate("1f1b", 8, 16)
    rows = render(timeline, width).splitlines()[1:]
    assert len(rows) == 8
    t = timeline.makespan  # 69: squeezed below 69 columns, a whole number of columns per unit above
    cols = width if t > width else int(width // t * t)
    assert {len(r) for r in rows} == {len("stage 0 |") + cols + 1}
    assert all(r.startswith(f"stage {s} |") for s, r in enumerate(rows))


def test_main_prints_timeline(capsys):
    main(["--pp", "4", "--micro-batches", "8"])
    out = capsys.readouterr().out
    sections = out.split("== ")[1:]
    assert [s.split(":")[0] for s in sections] == ["1f1b", "gpipe"]
    for section in sections:
        rows = re.findall(r"^stage (\d+) \|", section, flags=re.M)
        assert rows == ["0", "1", "2", "3"]
        assert "(theory (p-1)/(m+p-1) = 0.2727)" in section
        assert "bubble fraction per stage: 0.2727 0.2727 0.2727 0.2727" in section
    assert "max activations in flight per stage: 4 3 2 1" in sections[0]
    assert "max activations in flight per stage: 8 8 8 8" in sections[1]
