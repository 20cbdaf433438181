"""The planner's knowledge of the pipeline schedules (engine/planning/schedules.py, planner.py, search.py,
launch/plan.py): activations in flight per stage are what the schedule tables hold, the planned bubble is the
simulator's, and the search offers interleaved and zero-bubble layouts that resolve_layout accepts. The measured
check of the new schedules' memory is tests/planning/test_planner.py's NEW_SCHEDULE_LAYOUTS (waits for the executor)."""

import importlib.util

import pytest

from engine.kinds.schedules import SCHEDULES
from engine.parallel.layout.checks import resolve_layout
from engine.parallel.pp import schedule as sched
from engine.parallel.pp.schedules.interleaved import interleaved_order
from engine.parallel.pp.split import stage_layer_ranges
from engine.planning import activations as acts
from engine.planning import schedules
from engine.planning.planner import stage_memory, with_layout
from engine.planning.search import Hardware, search, stage_cost, step_time
from tests.cli import ROOT, run_script
from tests.planning.models import FREE_COMM, _model, table_peak, w_state


def plan_cfg(schedule: str, pp: int, m: int, v: int = 1, layers: int = 12, **train):
    """tp = dp = 1 on pp ranks, m micro-batches of one 32-token sequence, fp32."""
    return with_layout(_model(layers), pp=pp, dp=1, schedule=schedule, virtual_stages=v, global_batch_size=m, **train)


CASES = (
    [("1f1b", pp, m, 1) for pp in (1, 2, 3, 4) for m in (pp, pp + 1, 3 * pp)]
    + [("gpipe", pp, m, 1) for pp in (2, 4) for m in (1, pp + 1)]
    + [("interleaved", pp, m, v) for pp in (2, 3, 4) for v in (2, 3, 4) for m in (pp, 2 * pp, 3 * pp)]
    + [("zero_bubble", pp, m, 1) for pp in (2, 3, 4) for m in (pp, pp + 1, 3 * pp)]
)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "interleaved", "zero_bubble"])
def test_activations_in_flight_are_the_tables(name):
    for schedule, pp, m, v in (c for c in CASES if c[0] == name):
        cfg = plan_cfg(schedule, pp, m, v, layers=pp * v * 2 if v > 1 else 12)
        for stage in range(pp):
            planned = stage_memory(cfg, pp, stage)
            where = (schedule, pp, m, v, stage)
            assert planned.in_flight == sched.max_in_flight(sched.build(schedule, pp, m, stage, v)), where
            assert planned.activations == pytest.approx(table_peak(cfg, pp, m, stage), rel=1e-12), where


@pytest.mark.parametrize("pp,v", [(2, 2), (4, 2), (4, 4)])
def test_interleaved_stage_0_holds_megatrons_warmup_plus_one_chunks(pp, v):
    for m in (pp, 2 * pp, 4 * pp):
        cfg, plain = plan_cfg("interleaved", pp, m, v, layers=pp * v), plan_cfg("1f1b", pp, m, layers=pp * v)
        warmup = min((pp - 1) * 2 + (v - 1) * pp, m * v)  # Megatron's num_warmup_microbatches on rank 0
        held = warmup + 1 if warmup < m * v else m * v  # max_outstanding_backprops
        planned = stage_memory(cfg, pp, 0)
        assert planned.in_flight == held
        # each held chunk micro-batch is 1/v of stage 0's (up to the RoPE tables, built per chunk forward, and
        # the token ids, kept by chunk 0 only)
        whole = acts.micro_batch_bytes(plain, 1, pp, 0, v)
        assert planned.activations == pytest.approx(held * whole / v, rel=0.03)
        # the warmup plus one forwards, in Megatron's order, at their chunk's size, are one state the table passes
        # through (later states can hold one chunk-0 micro-batch more: its token ids, 8 bytes a token, more)
        order = interleaved_order(pp, m, v)[:held]
        first = sum(acts.micro_batch_bytes(cfg, 1, pp * v, c * pp, 1) for _, c in order)
        assert first <= planned.activations <= first + 8 * cfg.train.seq_len


def test_interleaving_keeps_each_ranks_parameters():
    # rank r holds chunks r, r+pp, ...: the same number of layers as the even split, embedding on rank 0 (virtual
    # stage 0), final norm and head on rank pp-1 (the last virtual stage)
    for pp, v in ((2, 2), (2, 3), (4, 2), (3, 4)):
        cfg, plain = plan_cfg("interleaved", pp, pp, v, layers=pp * v * 2), plan_cfg("1f1b", pp, pp, layers=pp * v * 2)
        for stage in range(pp):
            chunks = schedules.rank_chunks(cfg, pp, stage)
            assert [g for g, _ in chunks] == [c * pp + stage for c in range(v)]
            assert sum(n for _, n in chunks) == len(stage_layer_ranges(pp * v * 2, pp)[stage])
            a, b = stage_memory(cfg, pp, stage), stage_memory(plain, pp, stage)
            assert (a.weights, a.grads, a.optimizer) == (b.weights, b.grads, b.optimizer)
        assert any(g == 0 for g, _ in schedules.rank_chunks(cfg, pp, 0))
        assert any(g == pp * v - 1 for g, _ in schedules.rank_chunks(cfg, pp, pp - 1))


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_zero_bubble_holds_1f1bs_peak(pp):
    for m in (pp, 2 * pp):
        zb = [stage_memory(plan_cfg("zero_bubble", pp, m), pp, s) for s in range(pp)]
        ofob = [stage_memory(plan_cfg("1f1b", pp, m), pp, s) for s in range(pp)]
        # ZB-H1 keeps every micro-batch until its W: pp on every stage, 1F1B's most (that of its stage 0)
        assert [s.in_flight for s in zb] == [pp] * pp
        assert max(s.in_flight for s in zb) == max(s.in_flight for s in ofob)
        # stage 0 runs each W right after its B, and B frees the graph before the W state (smaller than one
        # micro-batch's activations) exists: 1F1B's peak, the paper's claim for ZB-H1
        cfg = plan_cfg("zero_bubble", pp, m)
        assert w_state(cfg, 12 // pp) < ofob[0].activations / pp
        assert zb[0].activations == pytest.approx(ofob[0].activations, rel=1e-12)


@pytest.mark.parametrize(
    "schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 4), ("zero_bubble", 1)]
)
def test_planned_bubble_is_the_simulators(schedule, v):
    pp, m = 4, 8
    cfg = plan_cfg(schedule, pp, m, v, layers=16, activation_checkpointing="selective")
    layout = resolve_layout(cfg, pp)
    st = step_time(cfg, pp, FREE_COMM)
    cost = max((stage_cost(cfg, layout, FREE_COMM, s) for s in range(pp)), key=lambda c: c.total)
    f, bi, w = cost.fwd / v, cost.bwd_input / v, cost.bwd_weight / v
    timeline = sched.simulate(schedule, pp, m, f, bi + w, v, bi, w)
    assert st.bubble == pytest.approx(max(timeline.idle), rel=1e-9)
    assert st.bubble_fraction == pytest.approx(max(sched.bubble_fraction(timeline)), rel=1e-9)
    assert st.total - st.dp_comm == pytest.approx(timeline.makespan, rel=1e-9)
    # and the papers' bubbles, with the planner's own F, B (input) and W
    _, theory = sched.theory(schedule, pp, m, v, f, bi + w, bi, w)
    assert st.bubble_fraction == pytest.approx(theory, rel=1e-9)
    assert cost.bwd_weight < cost.bwd_input < 2 * cost.bwd_weight  # W about half the backward, B the rest


def test_interleaved_and_zero_bubble_plan_smaller_bubbles_than_1f1b():
    pp, m = 4, 8
    ofob = step_time(plan_cfg("1f1b", pp, m, layers=16), pp, FREE_COMM).bubble_fraction
    assert ofob == pytest.approx(3 / 11)
    assert step_time(plan_cfg("interleaved", pp, m, 2, layers=16), pp, FREE_COMM).bubble_fraction == pytest.approx(
        3 / (2 * 8 + 3)
    )
    assert step_time(plan_cfg("zero_bubble", pp, m, layers=16), pp, FREE_COMM).bubble_fraction < ofob
    # with F = B = W the zero-bubble schedule leaves a third of 1F1B's idle time (Qi et al. 2023, Sec. 3.1)
    _, zb_idle = schedules.makespan_and_idle("zero_bubble", pp, m, 1, 1.0, 2.0, 1.0, 1.0)
    _, idle = schedules.makespan_and_idle("1f1b", pp, m, 1, 1.0, 2.0, 1.0, 1.0)
    assert max(zb_idle) == pytest.approx(max(idle) / 3)


def test_long_steps_extend_the_simulation_exactly():
    costs = [(1.0, 2.0, 1.0, 1.0), (0.7, 1.9, 1.3, 0.6), (1.0, 4.0, 1.0, 3.0)]
    for schedule, v in (
        ("1f1b", 1),
        ("gpipe", 1),
        ("interleaved", 2),
        ("interleaved", 3),
        ("zero_bubble", 1),
        ("zbv", 2),
    ):
        for pp in (2, 3, 4):
            for f, b, bi, w in costs:
                for m in range(pp * 4, pp * 8, pp if schedule == "interleaved" else 3):
                    got = schedules.makespan_and_idle(schedule, pp, m, v, f, b, bi, w)
                    full = sched.simulate(schedule, pp, m, f, b, v, bi, w)
                    assert got[0] == pytest.approx(full.makespan, rel=1e-12), (schedule, pp, m, v)
                    assert got[1] == pytest.approx(full.idle, rel=1e-9, abs=1e-9)


def test_search_offers_the_new_schedules_and_no_refused_combination():
    cfg = with_layout(_model(12), global_batch_size=16, micro_batch_size=2)
    refused = []
    plans = search(cfg, 4, Hardware(), schedules.SEARCHED, refused)
    found = {(p.cfg.parallel.schedule, p.cfg.parallel.virtual_stages) for p in plans}
    # interleaved v 4 cuts 12 layers into 8 unequal chunks at pp 2: searched with the balanced split (balance.py)
    assert found == {
        ("1f1b", 1),
        ("interleaved", 2),
        ("interleaved", 3),
        ("interleaved", 4),
        ("zero_bubble", 1),
        ("zbv", 2),
    }
    assert {p.cfg.parallel.pp_layers for p in plans if p.cfg.parallel.virtual_stages == 4} == {"auto"}
    assert any("virtual_stages" in msg for _, msg in refused)
    for p in plans:
        c, layout = p.cfg, resolve_layout(p.cfg, 4)  # raises on a refused combination
        m, v = p.describe()["micro_batches"], c.parallel.virtual_stages
        for stage in range(layout.pp):
            sched.build(c.parallel.schedule, layout.pp, m, stage, v)
        if layout.pp == 1:
            assert c.parallel.schedule == "1f1b"
        even = c.parallel.pp_layers != "auto"
        if c.parallel.schedule == "interleaved":
            assert (12 % (layout.pp * v) == 0) == even and m % layout.pp == 0
        if c.parallel.schedule == "zbv":  # 2 chunks per rank in a V, ddp or fsdp (CHUNK_LAST_W)
            assert (12 % (2 * layout.pp) == 0) == even and layout.pp >= 2 and c.parallel.dp_mode in ("ddp", "fsdp")
        assert p.describe()["bubble_fraction"] == p.time.bubble_fraction
    # Issue 27: fsdp and zero run under the split schedules too, and the search offers them.
    split = {p.cfg.parallel.dp_mode for p in plans if p.cfg.parallel.schedule != "1f1b"}
    assert split >= {"ddp", "fsdp", "zero"}


def _plan_main():
    spec = importlib.util.spec_from_file_location("plan_cli", ROOT / "launch" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_plan_cli_prints_the_schedule_bubble_and_activations(capsys):
    main = _plan_main()
    base = ["--config", "configs/tiny.yaml", "--world-size", "4", "--device-memory", "1", "--top", "3"]
    assert main(base + ["--parallel.schedule", "interleaved", "--parallel.virtual_stages", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "schedule interleaved with 2 virtual stages" in lines[0]
    assert lines[1].split()[10:11] == ["schedule"] and "bubble" in lines[1] and "act GB/stage" in lines[1]
    for row in lines[2:]:  # tp pp dp cp cp_mode ep sp dp_mode schedule ...
        cells = row.split()
        assert cells[1] == "2" and cells[8] == "il-v2" and cells[16].endswith("%") and cells[17].count("/") == 1
    assert main(base + ["--set", "parallel.schedule=zero_bubble"]) == 0
    assert all(row.split()[8] == "zb-h1" for row in capsys.readouterr().out.splitlines()[2:])
    bad = {
        ("--parallel.virtual_stages", "2"): r"^parallel.virtual_stages=2 needs parallel.schedule=interleaved",
        ("--parallel.schedule", "interleaved"): r"interleaved needs virtual_stages >= 2, got virtual_stages=1",
        (
            "--parallel.virtual_stages",
            "3",
            "--parallel.schedule",
            "interleaved",
        ): r"^parallel.schedule=interleaved splits model.num_layers=4 into pp\*virtual_stages=6",
    }
    for extra, message in bad.items():
        with pytest.raises(ValueError, match=message):
            main(base + list(extra))


def test_plan_cli_bad_virtual_stages_exits_2_with_one_line():
    result = run_script(
        "launch/plan.py",
        "--config",
        "configs/tiny.yaml",
        "--world-size",
        "4",
        "--device-memory",
        "1",
        "--parallel.virtual_stages",
        "2",
    )
    assert result.returncode == 2
    # the refusal comes from the search, which on a busy machine may outlast plan.py's progress interval
    assert [line for line in result.stderr.strip().splitlines() if not line.startswith("plan: searching ")] == [
        "error: parallel.virtual_stages=2 needs parallel.schedule=interleaved and pp >= 2"
    ]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_one_count_of_activations_in_flight(name):
    """The simulator's peak_in_flight, the planner's InFlight.count, the held_states walk the planner prices and
    engine.parallel.pp.actions.max_in_flight are one count, for every registered schedule (issue 25)."""
    spec = SCHEDULES[name]
    for pp in (2, 4):
        for m in (pp, 2 * pp, 3 * pp):
            v = spec.per_rank(2)  # chunks per rank: 2 with virtual stages or in a V, else 1
            cfg = plan_cfg(name, pp, m, v, layers=pp * v * 2)
            timeline = sched.simulate(name, pp, m, virtual_stages=v)
            for stage in range(pp):
                table = sched.build(name, pp, m, stage, v)
                walked = max(sum(c) + sum(w) for c, w, _ in schedules.held_states(name, pp, m, stage, v))
                planned = schedules.activations_in_flight(cfg, 1, pp, m, stage).count
                counts = (sched.max_in_flight(table), timeline.peak_in_flight[stage], planned, walked)
                assert len(set(counts)) == 1, f"{name} pp={pp} m={m} stage {stage}: {counts}"
