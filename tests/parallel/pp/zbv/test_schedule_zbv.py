"""ZB-V (engine/parallel/pp/schedules/zbv.py; Qi et al. 2023, Sec. 6) as data: its compute order against torch's
ScheduleZBVZeroBubble (the oracle, computed without ranks as tests/parallel/pp/test_pipeline_reference.py does for the
others), its messages along the V, and its run under NCCL's rendezvous rules (engine/parallel/pp/simulator.py).
Pure Python, no processes."""

from __future__ import annotations

import re

import pytest

from engine.parallel.pp import schedule as sched
from engine.parallel.pp.actions import COMPUTE_OPS, Action, Op, locate, max_in_flight, peer, virtual_stage
from engine.parallel.pp.schedule import build, simulate, simulate_actions

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

CASES = [pytest.param(pp, m, id=f"pp{pp}-m{m}") for pp in range(1, 9) for m in range(1, 4 * pp + 1)]
TORCH_OP = {Op.FWD: "F", Op.BWD_INPUT: "I", Op.BWD_WEIGHT: "W"}  # torch's _ComputationType values


def ours(pp: int, m: int, rank: int) -> list[str]:
    """Our compute order of `rank` in torch's notation "<virtual stage><F|I|W><micro-batch>"."""
    return [
        f"{virtual_stage(pp, rank, a.chunk, True)}{TORCH_OP[a.op]}{a.mb}"
        for a in build("zbv", pp, m, rank)
        if a.op in COMPUTE_OPS
    ]


def torch_zbv(pp: int, m: int, rank: int) -> list[str]:
    """torch's ScheduleZBVZeroBubble order of `rank` without stages or a process group: torch 2.13's private
    ``_calculate_single_rank_operations`` on a bare instance with the attributes its constructor sets (a torch
    upgrade that renames them fails here loudly). None entries are torch's idle slots."""
    schedule = object.__new__(torch_schedules.ScheduleZBVZeroBubble)
    schedule.pp_group_size, schedule._n_microbatches, schedule.num_stages, schedule.n_local_stages = pp, m, 2 * pp, 2
    return [
        f"{a.stage_index}{a.computation_type.value}{a.microbatch_index}"
        for a in schedule._calculate_single_rank_operations(rank)
        if a is not None
    ]


@pytest.mark.parametrize("pp,m", CASES)
def test_compute_order_matches_torch_zbv(pp, m):
    for rank in range(pp):
        assert ours(pp, m, rank) == torch_zbv(pp, m, rank), f"rank {rank}"


def test_torch_places_stages_in_a_v():
    """torch's own stage-to-rank map for ZBV ("v" style) is ours: rank r holds virtual stages r and 2pp-1-r."""
    for pp in (2, 3, 4, 8):
        theirs = torch_schedules.generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        assert {g: locate(pp, g, True)[0] for g in range(2 * pp)} == theirs
        assert all(locate(pp, virtual_stage(pp, r, c, True), True) == (r, c) for r in range(pp) for c in (0, 1))


@pytest.mark.parametrize("pp,m", CASES)
def test_messages_follow_the_v(pp, m):
    """Virtual stage g sends its forward to g+1 and its backward to g-1, every micro-batch once, in the order the
    receiver takes them; no message at the turn (pp-1 -> pp on rank pp-1) nor into stage 0 or out of 2pp-1."""
    stages = [build("zbv", pp, m, s) for s in range(pp)]

    def mbs_of(g: int, op: Op) -> list[int]:
        rank, chunk = locate(pp, g, True)
        return [a.mb for a in stages[rank] if a.op is op and a.chunk == chunk]

    for g in range(2 * pp):
        fwd_in = [] if g in (0, pp) else list(range(m))
        bwd_in = [] if g in (2 * pp - 1, pp - 1) else list(range(m))
        assert sorted(mbs_of(g, Op.RECV_FWD)) == fwd_in and sorted(mbs_of(g, Op.RECV_BWD)) == bwd_in, f"stage {g}"
        if g < 2 * pp - 1 and g != pp - 1:
            assert mbs_of(g, Op.SEND_FWD) == mbs_of(g + 1, Op.RECV_FWD), f"virtual stage {g} -> {g + 1}"
        if g > 0 and g != pp:
            assert mbs_of(g, Op.SEND_BWD) == mbs_of(g - 1, Op.RECV_BWD), f"virtual stage {g} -> {g - 1}"
    turn = [a for a in stages[pp - 1] if a.op not in COMPUTE_OPS]
    assert all(peer(pp, 2, pp - 1, a, True)[0] != pp - 1 for a in turn)


@pytest.mark.parametrize("pp,m", CASES)
def test_runs_under_nccl_rules_with_the_v_bubble_and_memory(pp, m):
    """Every table finishes under rendezvous sends and in-order batches. With F = B = W = 1 per chunk and m >= 2p-1
    each rank idles p-1 (torch's order: rank r starts r late): makespan 6m + p-1, half ZB-H1's (p-1)(F+B-W) at
    the same per-stage costs (2 each); every rank holds 2p chunk micro-batches, each half a stage: 1F1B's peak
    of p stage activations on its first stage."""
    t = simulate("zbv", pp, m)
    assert t.peak_in_flight == [max_in_flight(build("zbv", pp, m, s)) for s in range(pp)]
    assert max(t.peak_in_flight) <= 2 * pp
    if m >= 2 * pp - 1:
        assert t.makespan == pytest.approx(6 * m + pp - 1, abs=1e-9)
        assert t.peak_in_flight == [2 * pp] * pp
        # the bubble the schedule printout quotes (engine/kinds/schedules.py zbv_theory) is this one, at any F = B = W
        twice = simulate("zbv", pp, m, fwd_time=2.0, bwd_time=4.0, bwd_input_time=2.0, bwd_weight_time=2.0)
        _, theory = sched.theory("zbv", pp, m, 2, 2.0, 4.0, 2.0, 2.0)
        assert sched.bubble_fraction(twice) == sched.bubble_fraction(t) == pytest.approx([theory] * pp, abs=1e-12)
        zb = simulate("zero_bubble", pp, m, bwd_input_time=2.0, bwd_weight_time=2.0, fwd_time=2.0)
        assert zb.makespan - 6 * m == pytest.approx(2 * (pp - 1), abs=1e-9)


@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 2.0), (0.7, 1.3, 0.6)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 9), (8, 16)])
def test_other_time_ratios_finish_near_half_of_1f1b_idle(f, b, w, pp, m):
    """Other chunk costs: the table still finishes, idling at most 0.55 of 1F1B on stages of twice the chunk
    (measured worst 13/24 = 0.542 at pp 4, m 9, F = 2B = 2W; half at F = B = W). torch: zero bubble "only if time
    forward == time backward input == time backward weights". Not always below ZB-H1 either: with W = 2F it idles
    one W more at pp 4 and 8 (7 vs 6, 15 vs 14)."""
    t = simulate("zbv", pp, m, fwd_time=f, bwd_input_time=b, bwd_weight_time=w)
    ofob = simulate("1f1b", pp, m, fwd_time=2 * f, bwd_time=2 * (b + w))
    assert t.makespan >= 2 * m * (f + b + w) - 1e-9
    assert max(t.idle) <= 0.55 * max(ofob.idle)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_forward_only_runs_down_and_back_up(pp, m):
    tables = [sched.forward_only(pp, m, s, 2, vshape=True) for s in range(pp)]
    t = simulate_actions(tables, vshape=True)
    assert [len([a for a in x if a.op is Op.FWD]) for x in tables] == [2 * m] * pp and t.makespan > 0


def test_hand_checked_table_pp2_m4():
    """pp=2, m=4 worked out from torch's rules: rank 0 runs 3 forwards of chunk 0 (2(p-r)-1), rank 1 one pair of
    (F chunk 1, F chunk 0) after its first; rank 1's chunk 0 feeds its chunk 1 with no message."""
    assert " ".join(ours(2, 4, 0)) == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3"
    )
    assert " ".join(ours(2, 4, 1)) == (
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3"
    )
    rank1 = [str(a) for a in build("zbv", 2, 4, 1)]
    assert rank1[:6] == ["recvF0", "F0", "recvF1", "F0.1", "sendF0.1", "recvF2"]  # F0 -> F0.1 is local


def _swap_chunks(actions: list[Action]) -> list[Action]:
    return [Action(a.op, a.mb, 1 - a.chunk) for a in actions]


def test_simulator_refuses_a_turn_out_of_order():
    """Rank pp-1 running chunk 1's F of a micro-batch before chunk 0's (the local hand-off) is refused, as a
    receive before its send would be."""
    stages = [build("zbv", 2, 4, s) for s in range(2)]
    i, j = stages[1].index(Action(Op.FWD, 0)), stages[1].index(Action(Op.FWD, 0, 1))
    stages[1][i], stages[1][j] = stages[1][j], stages[1][i]
    with pytest.raises(RuntimeError, match=re.escape("stage 1 runs F0.1 before the other chunk at the V's turn")):
        simulate_actions(stages, vshape=True)
    with pytest.raises(RuntimeError):  # a rank with its chunks swapped (interleaved's order, not the V's)
        simulate_actions([build("zbv", 2, 4, 0), _swap_chunks(build("zbv", 2, 4, 1))], vshape=True)


@pytest.mark.parametrize("v,ok", [(1, True), (2, True), (3, False)])
def test_virtual_stages_are_implied(v, ok):
    if ok:
        assert build("zbv", 4, 8, 0, v) == build("zbv", 4, 8, 0)
    else:
        with pytest.raises(ValueError, match=r"virtual_stages=3: zbv runs 2 chunks per rank, implied"):
            build("zbv", 4, 8, 0, v)


def naive_zbv(pp: int, m: int, stage: int) -> list[Action]:
    """torch's compute order with each receive right before its compute and each send right after it (the
    placement of the other tables): the fixture showing why schedules/zbv.py places messages by a timed run."""
    from engine.parallel.pp.actions import backward_actions, forward_actions
    from engine.parallel.pp.schedules.zbv import zbv_order

    out: list[Action] = []
    for a in zbv_order(pp, m, stage):
        if a.op is Op.FWD:
            out += forward_actions(pp, stage, a.mb, a.chunk, 2, vshape=True)
        elif a.op is Op.BWD_INPUT:
            out += backward_actions(pp, stage, a.mb, a.chunk, 2, Op.BWD_INPUT, vshape=True)
        else:
            out.append(a)
    return out


def test_naive_placement_fails_under_nccl_rules():
    """The same compute order with receives right before and sends right after each compute: at pp = 2, m = 4 the
    channel 0 -> 1 carries chunk 0's forwards and chunk 1's backward gradients, posted in another order than rank
    1 takes them; at m <= pp it deadlocks under rendezvous sends. The placed table finishes both."""
    with pytest.raises(RuntimeError, match=r"stage 1 recvB0.1 matched sendF2 of stage 0: the two post in different"):
        simulate_actions([naive_zbv(2, 4, s) for s in range(2)], vshape=True)
    with pytest.raises(RuntimeError, match=r"^deadlock: "):
        simulate_actions([naive_zbv(4, 4, s) for s in range(4)], vshape=True)
    simulate("zbv", 2, 4)
    simulate("zbv", 4, 4)


# ---- parallel.schedule: zbv in the config: what it needs, refused in one line naming the value ----


def _cfg(**parallel):
    from engine.config import Config

    cfg = Config()  # 4 layers
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize(
    "parallel,world,needle",
    [
        ({"pp": 1, "schedule": "zbv"}, 1, "parallel.schedule=zbv needs parallel.pp >= 2"),
        ({"pp": 4, "schedule": "zbv"}, 4, "parallel.schedule=zbv splits model.num_layers=4 into 2*pp=8 equal chunks"),
        (
            {"pp": 2, "schedule": "zbv", "pp_layers": [1, 3]},
            2,
            "parallel.pp_layers=[1, 3] must list 4 positive layer counts (one per virtual stage, pp*2, in "
            "virtual-stage order)",
        ),
        (
            {"pp": 2, "schedule": "zbv", "virtual_stages": 3},
            2,
            "parallel.virtual_stages=3 with schedule=zbv: its 2 chunks per rank are implied",
        ),
        (
            {"pp": 2, "schedule": "zbv", "dp_mode": "zero", "zero_stage": 1},
            4,
            "parallel.schedule=zbv with "
            "parallel.dp_mode=zero is not supported (the gradient sync would have to follow each of its 2 chunks' "
            "last W); use dp_mode=ddp or fsdp",
        ),
    ],
)
def test_config_refusals_name_the_value(parallel, world, needle):
    from engine.config import ConfigError
    from engine.parallel.layout.checks import resolve_layout

    with pytest.raises(ConfigError) as e:
        resolve_layout(_cfg(**parallel), world)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_fsdp_runs_zbv_untied_and_refuses_a_tied_embedding():
    """FSDP follows zbv's sync point (each chunk reduce-scattered after its last W; parity measured equal untied),
    but rank 0's two chunks, each an FSDP root unit, cannot both hold a tied embedding: one line, naming it."""
    from engine.config import ConfigError
    from engine.parallel.layout.checks import resolve_layout

    assert resolve_layout(_cfg(pp=2, schedule="zbv", dp_mode="fsdp"), 4).dp == 2
    cfg = _cfg(pp=2, schedule="zbv", dp_mode="fsdp")
    cfg.model.tie_embeddings = True
    with pytest.raises(ConfigError) as e:
        resolve_layout(cfg, 4)
    assert "parallel.dp_mode=fsdp with parallel.schedule=zbv and model.tie_embeddings=true is not supported" in str(
        e.value
    ) and "\n" not in str(e.value)


def test_config_accepts_zbv_with_implied_chunks_and_few_micro_batches():
    from engine.parallel.layout.checks import resolve_layout

    for v in (1, 2):
        assert resolve_layout(_cfg(pp=2, schedule="zbv", virtual_stages=v), 2).pp == 2
    cfg = _cfg(pp=2, schedule="zbv")
    cfg.train.global_batch_size = cfg.train.micro_batch_size  # m = 1 < pp: torch runs it, so does the V
    assert resolve_layout(cfg, 2).pp == 2


def test_grad_compression_refused_with_zbv():
    from engine.config import ConfigError, load

    with pytest.raises(ConfigError, match=r"grad_compression=bf16 is not supported with parallel.schedule=zbv"):
        load(["--parallel.schedule", "zbv", "--parallel.grad_compression", "bf16"])


# ---- The V's stage split (engine/parallel/pp/virtual.py, pipeline.split_stage) ----


def test_v_split_keeps_global_names_and_puts_embedding_and_head_on_rank_0():
    """8 layers at pp = 2: rank 0 holds layers 0,1 (chunk 0) and 6,7 (chunk 1) with the embedding, the final norm
    and the LM head (tied: one parameter); rank 1 holds 2,3 and 4,5 and neither."""
    from engine.config import ModelConfig
    from engine.model import transformer
    from engine.parallel.pp.executor import split_stage
    from engine.parallel.pp.split import chunk_layer_ranges
    from engine.parallel.pp.virtual import model_chunks

    assert chunk_layer_ranges(8, 2, 2, vshape=True) == [[range(0, 2), range(6, 8)], [range(2, 4), range(4, 6)]]
    cfg = ModelConfig(
        num_layers=8,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=128,
        tie_embeddings=True,
    )
    stages = [split_stage(transformer.build(cfg, device="meta"), 2, r, None, 2, vshape=True) for r in range(2)]
    assert [sorted(map(int, s.model.layers.keys())) for s in stages] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert stages[0].lm_head.weight is stages[0].model.embed_tokens.weight and stages[0].model.norm is not None
    assert stages[1].lm_head is None and stages[1].model.embed_tokens is None and stages[1].model.norm is None
    first, last = model_chunks(stages[0], 2, 0, 2, vshape=True)
    assert (first.embed_tokens, first.lm_head) == (stages[0].model.embed_tokens, None)
    assert (last.embed_tokens, last.lm_head) == (None, stages[0].lm_head)
    assert all(c.embed_tokens is None and c.lm_head is None for c in model_chunks(stages[1], 2, 1, 2, vshape=True))
