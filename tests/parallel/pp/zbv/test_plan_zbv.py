"""The planner's knowledge of ZB-V (engine/planning/schedules.py, planner.py, search.py): its activations in flight
are its tables' (chunks in a V, W state from B to W), rank 0 holds the embedding and the head (a tied one once),
and its planned bubble is the simulator's."""

import pytest

from engine.parallel.layout.checks import resolve_layout
from engine.parallel.pp import schedule as sched
from engine.planning import schedules
from engine.planning.planner import stage_memory, stage_params, with_layout
from engine.planning.search import stage_cost, step_time
from tests.planning.models import FREE_COMM, _model, table_peak, w_state


def zbv_cfg(pp: int, m: int, layers: int, **kw):
    return with_layout(_model(layers), pp=pp, dp=1, schedule="zbv", virtual_stages=1, global_batch_size=m, **kw)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (2, 7), (3, 6), (4, 4), (4, 8), (4, 12)])
def test_activations_in_flight_are_the_v_tables(pp, m):
    cfg = zbv_cfg(pp, m, 4 * pp)
    for stage in range(pp):
        planned = stage_memory(cfg, pp, stage)
        assert planned.in_flight == sched.max_in_flight(sched.build("zbv", pp, m, stage)), stage
        assert planned.activations == pytest.approx(table_peak(cfg, pp, m, stage), rel=1e-12), stage


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_rank_0_holds_embedding_and_head(pp, tied):
    """The V puts virtual stages 0 and 2pp-1 on rank 0: the embedding, final norm and LM head all there (a tied
    head the embedding itself), none on rank pp-1; the layer counts are the even split's."""
    cfg = zbv_cfg(pp, 2 * pp, 4 * pp)
    cfg.model.tie_embeddings = tied
    plain = with_layout(cfg, schedule="1f1b")
    m = cfg.model
    vocab = m.vocab_size * m.hidden_size
    assert [g for g, _ in schedules.rank_chunks(cfg, pp, 0)] == [0, 2 * pp - 1]
    zbv0, zbv_last = stage_params(cfg, 1, pp, 0), stage_params(cfg, 1, pp, pp - 1)
    assert zbv0["root"] == vocab + m.hidden_size + (0 if tied else vocab) and zbv_last["root"] == 0
    ofob0, ofob_last = stage_params(plain, 1, pp, 0), stage_params(plain, 1, pp, pp - 1)
    assert zbv0["root"] == ofob0["root"] + ofob_last["root"] - (vocab if tied else 0)
    assert zbv0["layers"] == ofob0["layers"] and zbv_last["layers"] == ofob_last["layers"]


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16)])
def test_planned_bubble_is_the_simulators(pp, m):
    cfg = zbv_cfg(pp, m, 16, activation_checkpointing="selective")
    layout = resolve_layout(cfg, pp)
    st = step_time(cfg, pp, FREE_COMM)
    cost = max((stage_cost(cfg, layout, FREE_COMM, s) for s in range(pp)), key=lambda c: c.total)
    assert max(range(pp), key=lambda s: stage_cost(cfg, layout, FREE_COMM, s).total) == 0  # the head's rank
    f, bi, w = cost.fwd / 2, cost.bwd_input / 2, cost.bwd_weight / 2
    timeline = sched.simulate("zbv", pp, m, f, bi + w, 2, bi, w)
    assert st.bubble == pytest.approx(max(timeline.idle), rel=1e-9)
    assert st.total - st.dp_comm == pytest.approx(timeline.makespan, rel=1e-9)
    zb = step_time(with_layout(cfg, schedule="zero_bubble"), pp, FREE_COMM)
    assert st.bubble < zb.bubble  # the V's warmup fills what ZB-H1 leaves


def test_w_state_is_priced_per_chunk():
    """Each chunk micro-batch's W state between B and W (weight_grad.py's x and g of every split linear). It never
    sets these tables' peak (W follows B at once in the steady state, and the cooldown's B's free more than they
    queue), so it is checked here directly."""
    pp = 4
    cfg = zbv_cfg(pp, 8, 16)
    assert schedules.w_state_bytes(cfg, 1, pp, 0) == [pytest.approx(w_state(cfg, 2))] * 2
