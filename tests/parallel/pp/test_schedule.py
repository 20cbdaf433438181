"""Pipeline schedules as data (engine/parallel/pp/schedule.py and its schedule_*.py): pure Python, no processes.

Every property is checked from the action lists or the simulated timeline against the papers' formulas, over
pp in (1, 2, 3, 4, 8) and micro_batches in pp..2pp+1 plus 16 for 1F1B, GPipe and ZB-H1, and pp in 1..8,
v in 2..4, m in (pp, 2pp, 3pp) for interleaved; two small tables are written out by hand.
"""

from __future__ import annotations

import re

import pytest

from engine.parallel.pp.actions import steps
from engine.parallel.pp.schedule import (
    Action,
    Op,
    bubble_fraction,
    build,
    main,
    max_in_flight,
    render,
    simulate,
    simulate_actions,
)
from tests.parallel.pp.tables import computes, render_steps

CLASSIC = ("1f1b", "gpipe")

CASES = sorted({(pp, m) for pp in (1, 2, 3, 4, 8) for m in [*range(pp, 2 * pp + 2), 16]})
ALL = [pytest.param(name, pp, m, id=f"{name}-pp{pp}-m{m}") for name in CLASSIC for pp, m in CASES]


def mbs(actions: list[Action], op: Op) -> list[int]:
    return [a.mb for a in actions if a.op is op]


def test_action_str():
    assert [str(Action(op, 3)) for op in Op] == ["recvF3", "F3", "sendF3", "recvB3", "B3", "sendB3", "B3", "W3"]
    assert [str(Action(Op.FWD, 3, c)) for c in range(3)] == ["F3", "F3.1", "F3.2"]
    assert str(Action(Op.RECV_BWD, 0, 1)) == "recvB0.1"


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
        wrap = {
            Op.FWD: (Op.RECV_FWD if s > 0 else None, Op.SEND_FWD if s < pp - 1 else None),
            Op.BWD: (Op.RECV_BWD if s < pp - 1 else None, Op.SEND_BWD if s > 0 else None),
        }
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


@pytest.mark.parametrize("name", CLASSIC)
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
    stages = [
        [Action(Op.RECV_BWD, 0), Action(Op.FWD, 0), Action(Op.SEND_FWD, 0), Action(Op.BWD, 0)],
        [Action(Op.RECV_FWD, 0), Action(Op.FWD, 0), Action(Op.BWD, 0), Action(Op.SEND_BWD, 0)],
    ]
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "deadlock: stage 0 in [recvB0]: recvB0 waits for stage 1's sendB0 in its batch [sendB0]; "
            "stage 1 in [recvF0]: recvF0 waits for stage 0's sendF0 in its batch [sendF0]"
        ),
    ):
        simulate_actions(stages)


def test_steps_group_consecutive_comm_actions_into_one_batch():
    actions = build("1f1b", 2, 2, 1)
    assert render_steps(actions) == "[recvF0] F0 B0 [sendB0 recvF1] F1 B1 [sendB1]"
    assert [a for s in steps(actions) for a in (s if isinstance(s, tuple) else (s,))] == actions
    assert steps([]) == []


_TOKENS = {
    "recvF": Op.RECV_FWD,
    "sendF": Op.SEND_FWD,
    "recvB": Op.RECV_BWD,
    "sendB": Op.SEND_BWD,
    "F": Op.FWD,
    "Bi": Op.BWD_INPUT,
    "B": Op.BWD,
    "W": Op.BWD_WEIGHT,
}


def parse(table: str) -> list[Action]:
    """ "F0 sendF0 Bi0 W0" -> Actions (one chunk; Bi: zero bubble's input-gradient B)."""
    out = []
    for tok in table.split():
        name, mb = re.fullmatch(r"([a-zA-Z]+)(\d+)", tok).groups()
        out.append(Action(_TOKENS[name], int(mb)))
    return out


def test_a_send_waits_for_its_receiver_and_batches_run_in_order():
    """Rendezvous sends and in-order batches (the NCCL model of pp/simulator.py), bug 2 of issue 24 in two ranks:
    stage 0's sendF1 waits for stage 1's recvF1, queued behind its sendB0, which waits for stage 0's recvB0,
    queued behind sendF1. Buffered sends would let this table finish. With stage 1's W0 moved after recvF1,
    [sendB0 recvF1] is one batch (Megatron's pairing) and meets stage 0's batches in order."""
    s0 = parse("F0 sendF0 F1 sendF1 F2 sendF2 recvB0 Bi0 W0 recvB1 Bi1 W1 recvB2 Bi2 W2")
    split = parse("recvF0 F0 Bi0 sendB0 W0 recvF1 F1 Bi1 sendB1 W1 recvF2 F2 Bi2 sendB2 W2")
    paired = parse("recvF0 F0 Bi0 sendB0 recvF1 W0 F1 Bi1 sendB1 recvF2 W1 F2 Bi2 sendB2 W2")
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "deadlock: stage 0 in [sendF1]: sendF1 waits for stage 1's recvF1 in its batch [recvF1]; "
            "stage 1 in [sendB0]: sendB0 waits for stage 0's recvB0 in its batch [sendF2 recvB0]"
        ),
    ):
        simulate_actions([s0, split])
    t = simulate_actions([s0, paired])
    assert t.makespan > 0


def test_rendezvous_timing_send_only_batches_do_not_hold_computes():
    """Stage 1 does F, B, W (3 units) per micro-batch before taking the next input, stage 0 only F (1 unit): its
    batch [sendF1] completes when stage 1 starts [recvF1] at 4. Meanwhile stage 0 goes on computing (F2 at 2..3:
    a send-only batch does not block computes), and its [sendF2] queues behind [sendF1] (one p2p stream). A
    receive completes at the later of its own start and its sender's batch start: stage 0's recvB0 at 10."""
    s0 = parse("F0 sendF0 F1 sendF1 F2 sendF2 recvB0 Bi0 W0 recvB1 Bi1 W1 recvB2 Bi2 W2")
    s1 = parse("recvF0 F0 Bi0 W0 recvF1 F1 Bi1 W1 recvF2 F2 Bi2 W2 sendB0 sendB1 sendB2")
    t = simulate_actions([s0, s1])
    start = {(s, str(a)): (b, e) for s, iv in enumerate(t.intervals) for b, e, a in iv}
    assert start[(0, "F2")] == (2.0, 3.0)
    assert [start[(1, f"F{k}")][0] for k in range(3)] == [1.0, 4.0, 7.0]
    assert start[(0, "B0")] == (10.0, 11.0) and t.makespan == 16.0


def test_simulate_rejects_mismatched_order():
    stages = [
        [Action(Op.FWD, 0), Action(Op.FWD, 1), Action(Op.SEND_FWD, 1), Action(Op.SEND_FWD, 0)],
        [Action(Op.RECV_FWD, 0), Action(Op.FWD, 0), Action(Op.RECV_FWD, 1), Action(Op.FWD, 1)],
    ]
    with pytest.raises(RuntimeError, match=r"stage 1 recvF0 matched sendF1 of stage 0"):
        simulate_actions(stages)


@pytest.mark.parametrize(
    "args,match",
    [
        (("zb", 4, 8, 0), r"'zb'.*1f1b, gpipe, interleaved, zero_bubble"),
        (("1f1b", 0, 8, 0), r"pp=0"),
        (("gpipe", 4, 8, 4), r"stage=4.*0\.\.3"),
        (("gpipe", 4, 8, -1), r"stage=-1.*0\.\.3"),
        (("gpipe", 4, 0, 0), r"micro_batches=0"),
        (("1f1b", 4, 3, 0), r"1f1b needs micro_batches >= pp.*micro_batches=3.*pp=4"),
    ],
)
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


def test_main_refuses_bad_input_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--pp", "4", "--micro-batches", "6", "--schedule", "interleaved"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "micro_batches=6, pp=4; valid: 4, 8, ..." in err


def test_main_prints_new_schedules(capsys):
    main(["--pp", "4", "--micro-batches", "8", "--schedule", "interleaved", "--virtual-stages", "2"])
    main(["--pp", "4", "--micro-batches", "8", "--schedule", "zero_bubble"])
    inter, zb = capsys.readouterr().out.split("== ")[1:]
    assert inter.startswith("interleaved: pp=4 virtual_stages=2 micro_batches=8 fwd=1 bwd=2")
    assert "bubble fraction per stage: 0.1579 0.1579 0.1579 0.1579  (theory (p-1)/(v*m+p-1) = 0.1579)" in inter
    assert "max activations in flight per stage: 11 9 7 5  (chunk micro-batches, each 1/2 of a stage's)" in inter
    assert zb.startswith("zero_bubble: pp=4 micro_batches=8 fwd=1 bwd_input=1 bwd_weight=1")
    assert "bubble fraction per stage: 0.1111 0.1111 0.1111 0.1111  (theory" in zb
    assert "max activations in flight per stage: 4 4 4 4  (held until W)" in zb


# ---- Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2.2; Megatron-LM's order) ----

INTERLEAVED = [
    pytest.param(pp, v, m, id=f"pp{pp}-v{v}-m{m}")
    for pp in range(1, 9)
    for v in (2, 3, 4)
    for m in (pp, 2 * pp, 3 * pp)
]


def megatron_warmup(pp: int, v: int, m: int, stage: int) -> int:
    """num_warmup_microbatches of Megatron's forward_backward_pipelining_with_interleaving."""
    return min((pp - stage - 1) * 2 + (v - 1) * pp, m * v)


@pytest.mark.parametrize("pp,v,m", INTERLEAVED)
def test_interleaved_follows_megatron_order(pp, v, m):
    """The k-th forward is chunk (k // pp) % v of micro-batch (k // (pp*v))*pp + k % pp; the k-th backward the
    same micro-batch in chunk v-1-(k // pp) % v; the first backward follows Megatron's warmup and one forward."""
    expected = [((k // (pp * v)) * pp + k % pp, (k // pp) % v) for k in range(m * v)]
    for stage in range(pp):
        actions = build("interleaved", pp, m, stage, v)
        fwds = [(a.mb, a.chunk) for a in actions if a.op is Op.FWD]
        bwds = [(a.mb, a.chunk) for a in actions if a.op is Op.BWD]
        assert fwds == expected and bwds == [(mb, v - 1 - c) for mb, c in expected], f"stage {stage}"
        order = [a.op for a in actions if a.op in (Op.FWD, Op.BWD)]
        first_backward = min(megatron_warmup(pp, v, m, stage) + 1, m * v)  # the steady state opens with an F
        assert order.index(Op.BWD) == first_backward, f"stage {stage}: warmup count"


@pytest.mark.parametrize("pp,v,m", INTERLEAVED)
def test_interleaved_sends_go_to_the_next_virtual_stage(pp, v, m):
    """Virtual stage g = chunk*pp + rank sends its forward to g+1 (chunk c of the last rank feeds chunk c+1 of
    rank 0) and its backward to g-1, every micro-batch once, in the same order as the receiver takes them."""
    stages = [build("interleaved", pp, m, s, v) for s in range(pp)]

    def mbs_of(g: int, op: Op) -> list[int]:
        return [a.mb for a in stages[g % pp] if a.op is op and a.chunk == g // pp]

    last = pp * v - 1
    assert mbs_of(0, Op.RECV_FWD) == mbs_of(0, Op.SEND_BWD) == []
    assert mbs_of(last, Op.SEND_FWD) == mbs_of(last, Op.RECV_BWD) == []
    for g in range(last):
        assert mbs_of(g, Op.SEND_FWD) == mbs_of(g + 1, Op.RECV_FWD) == list(range(m)), f"virtual stage {g}"
        assert mbs_of(g + 1, Op.SEND_BWD) == mbs_of(g, Op.RECV_BWD) == list(range(m)), f"virtual stage {g}"


@pytest.mark.parametrize("pp,v,m", INTERLEAVED)
def test_interleaved_bubble_and_memory_match_theory(pp, v, m):
    """Per chunk F=1, B=2 (a stage's work split in v): makespan (v*m + p-1)(F+B), so the bubble is (p-1)/(v*m)
    of the ideal time (Narayanan et al. 2021, Sec. 2.2.2), v times less than 1F1B's; activations held at most
    Megatron's warmup + 1 (its max_outstanding_backprops)."""
    t = simulate("interleaved", pp, m, 1.0, 2.0, virtual_stages=v)
    ideal = m * v * 3.0
    assert t.makespan == pytest.approx((v * m + pp - 1) * 3.0, abs=1e-9)
    assert (t.makespan - ideal) / ideal == pytest.approx((pp - 1) / (v * m), abs=1e-12)
    assert bubble_fraction(t) == pytest.approx([(pp - 1) / (v * m + pp - 1)] * pp, abs=1e-12)
    for s in range(pp):
        bound = min(megatron_warmup(pp, v, m, s) + 1, m * v)
        assert t.peak_in_flight[s] == max_in_flight(build("interleaved", pp, m, s, v)) == bound, f"stage {s}"


@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 3.0), (2.0, 1.0), (0.7, 1.9)])
@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (3, 3, 6), (4, 2, 8), (4, 4, 12), (8, 2, 16)])
def test_interleaved_makespan_other_time_ratios(f, b, pp, v, m):
    assert simulate("interleaved", pp, m, f, b, v).makespan == pytest.approx((v * m + pp - 1) * (f + b), abs=1e-9)


def test_interleaved_hand_checked_table():
    """pp=2, v=2, m=4, worked out by hand from Megatron's rules: stage 0 warms up with 4 forwards, stage 1 with 2;
    the backward of a group runs chunk 1 before chunk 0. Each compute step ends in one batch that sends what it
    computed and receives what the rank computes next (Megatron's p2p_communication pairs); batch t of rank 0
    meets batch t of rank 1 (after rank 1's first receive), in both directions. Makespan (2*4 + 1) * 3 = 27."""
    stages = [build("interleaved", 2, 4, s, 2) for s in range(2)]
    assert " ".join(computes(stages[0])) == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    assert " ".join(computes(stages[1])) == "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"
    # Rank 1's chunk 0 feeds rank 0's chunk 1; rank 1's chunk 1 is the last virtual stage (no send, no receive).
    assert render_steps(stages[0]) == (
        "F0 [sendF0] F1 [sendF1 recvF0.1] F0.1 [sendF0.1 recvF1.1] F1.1 [sendF1.1 recvB0.1] "
        "F2 B0.1 [sendF2 sendB0.1 recvB1.1] F3 B1.1 [sendF3 sendB1.1 recvF2.1 recvB0] "
        "F2.1 B0 [sendF2.1 recvF3.1 recvB1] F3.1 B1 [sendF3.1 recvB2.1] B2.1 [sendB2.1 recvB3.1] "
        "B3.1 [sendB3.1 recvB2] B2 [recvB3] B3"
    )
    assert render_steps(stages[1]) == (
        "[recvF0] F0 [sendF0 recvF1] F1 [sendF1 recvF0.1] F0.1 B0.1 [sendB0.1 recvF1.1] "
        "F1.1 B1.1 [sendB1.1 recvF2 recvB0] F2 B0 [sendF2 sendB0 recvF3 recvB1] F3 B1 [sendF3 sendB1 recvF2.1] "
        "F2.1 B2.1 [sendB2.1 recvF3.1] F3.1 B3.1 [sendB3.1 recvB2] B2 [sendB2 recvB3] B3 [sendB3]"
    )
    t = simulate_actions(stages, 1.0, 2.0)
    assert (t.makespan, t.virtual_stages, t.micro_batches, t.peak_in_flight) == (27.0, 2, 4, [5, 3])


# ---- Zero bubble ZB-H1 (Qi et al. 2023, Sec. 3.1) ----

ZB = [pytest.param(pp, m, id=f"pp{pp}-m{m}") for pp, m in CASES]


@pytest.mark.parametrize("pp,m", ZB)
def test_zero_bubble_f_b_w_once_and_w_deferred_by_stage(pp, m):
    """Every micro-batch: F, then B (input grad, its send right after), then W, once. Stage s runs W(k) right
    after B(k+s) (ZB-H1's W shifted by the warmup it lacks: torch's ZB1P num_1f1b_microbatches = rank); the W's
    left over close the list."""
    for s in range(pp):
        actions = build("zero_bubble", pp, m, s)
        assert not any(a.op is Op.BWD for a in actions)
        for op in (Op.FWD, Op.BWD_INPUT, Op.BWD_WEIGHT):
            assert mbs(actions, op) == list(range(m)), f"stage {s} {op}"
        order = computes(actions)
        for k in range(m):
            assert order.index(f"F{k}") < order.index(f"B{k}") < order.index(f"W{k}")
            expected = order.index(f"B{k + s}") + 1 if k + s < m else len(order) - (m - k)
            assert order.index(f"W{k}") == expected, f"stage {s} W{k}: {' '.join(order)}"


@pytest.mark.parametrize("pp,m", ZB)
def test_zero_bubble_is_a_third_of_1f1b_with_the_same_peak_memory(pp, m):
    """F = B = W = 1 (1F1B: F=1, BWD=2): ZB-H1's bubble (p-1)(F+B-W) is a third of 1F1B's (p-1)(F+B+W) on every
    stage, and every stage holds p micro-batches until their W: 1F1B's peak (its first stage's)."""
    zb, ofob = simulate("zero_bubble", pp, m), simulate("1f1b", pp, m, 1.0, 2.0)
    assert zb.makespan == pytest.approx(3 * m + (pp - 1), abs=1e-9)
    for s in range(pp):
        assert zb.idle[s] == pytest.approx(ofob.idle[s] / 3, abs=1e-9), f"stage {s}"
    assert zb.peak_in_flight == [max_in_flight(build("zero_bubble", pp, m, s)) for s in range(pp)] == [pp] * pp
    assert max(zb.peak_in_flight) == max(ofob.peak_in_flight) == pp


@pytest.mark.parametrize(
    "f,b,w", [(1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 2.0), (1.0, 0.5, 1.0), (0.7, 1.3, 0.6)]
)
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 9), (8, 16)])
def test_zero_bubble_other_time_ratios(f, b, w, pp, m):
    """The paper's (p-1)(F+B-W) is exact while W fits the gaps (W <= min(F, B)); longer W's leave a bubble
    between that and 1F1B's (p-1)(F+B+W)."""
    t = simulate("zero_bubble", pp, m, fwd_time=f, bwd_input_time=b, bwd_weight_time=w)
    paper, ofob = m * (f + b + w) + (pp - 1) * (f + b - w), (m + pp - 1) * (f + b + w)
    if w <= min(f, b):
        assert t.makespan == pytest.approx(paper, abs=1e-9)
    else:
        assert paper + 1e-9 < t.makespan < ofob


def test_zero_bubble_hand_checked_table():
    """pp=2, m=4 by hand: stage 0 warms up with F0 then runs F B W; stage 1 defers each W by one B.
    Makespan 3*4 + 1 = 13 against 1F1B's 15."""
    stages = [build("zero_bubble", 2, 4, s) for s in range(2)]
    assert " ".join(map(str, stages[0])) == (
        "F0 sendF0 F1 sendF1 recvB0 B0 W0 F2 sendF2 recvB1 B1 W1 F3 sendF3 recvB2 B2 W2 recvB3 B3 W3"
    )
    assert " ".join(map(str, stages[1])) == (
        "recvF0 F0 B0 sendB0 recvF1 F1 B1 sendB1 W0 recvF2 F2 B2 sendB2 W1 recvF3 F3 B3 sendB3 W2 W3"
    )
    t = simulate_actions(stages)
    assert (t.makespan, t.idle, t.peak_in_flight) == (13.0, [1.0, 1.0], [2, 2])
