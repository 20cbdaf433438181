"""Expert parallelism in the planner (engine/planning/ep.py, planner.py state_groups): the experts' state per rank
under ep and each dp mode against the parameters of the engine's own model, the all-to-all's bytes against what the
engine sends, the memory of an ep 2 step against measurement, and the search choosing ep for Mixtral."""

import pytest

from engine.config import load
from engine.model import transformer as model_lib
from engine.model.moe import Experts
from engine.parallel.layout.checks import Layout
from engine.planning import ep as ep_plan
from engine.planning.planner import stage_memory, with_layout
from engine.planning.search import Hardware, search, step_time
from launch.bench.measure import measure_rank
from tests.dist import run_ranks

TINY_MOE = [
    "--config",
    "configs/tiny-moe.yaml",
    "--model.num_layers",
    "2",
    "--train.seq_len",
    "64",
    "--train.micro_batch_size",
    "2",
    "--train.global_batch_size",
    "4",
    "--log.progress",
    "false",
]


def _counts(cfg) -> tuple[int, int]:
    """(dense, expert) parameters of the engine's model of cfg, from the built (meta) modules."""
    model = model_lib.build(cfg.model, device="meta")
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    return model_lib.count_params(model) - experts, experts


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_ddp_holds_e_over_ep_experts_per_rank(ep):
    """ddp replicates every weight over its group: a rank holds the dense weights and E/ep of the experts, fp32
    weights and gradients and two AdamW moments (16 bytes a weight)."""
    cfg = with_layout(load(TINY_MOE), ep=ep, global_batch_size=16)
    dense, experts = _counts(cfg)
    plan = stage_memory(cfg, 8, 0)
    assert plan.weights == plan.grads == 4 * (dense + experts / ep)
    assert plan.optimizer - 4 * (dense + experts / ep) * 2 < 100  # + AdamW's fp32 step counter per tensor


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_fsdp_shards_experts_over_expert_dp(ep):
    """fsdp shards the dense weights over dp x cp (8 here: dp 4 x cp 2) and a rank's E/ep experts over the
    expert-dp group of dp cp / ep ranks: 1/(ep edp) = 1/(dp cp) of the experts, the same bytes at every ep, while
    ddp's experts shrink with ep alone."""
    cfg = with_layout(load(TINY_MOE), dp_mode="fsdp", ep=ep, global_batch_size=8, cp=2, dp=4)
    dense, experts = _counts(cfg)
    edp = 8 // ep
    plan = stage_memory(cfg, 8, 0, layout=Layout(tp=1, pp=1, dp=4, cp=2, ep=ep))  # fsdp + ep: fsdpep's to build
    assert plan.weights == pytest.approx(4 * (dense / 8 + experts / ep / edp))
    assert plan.grads == pytest.approx(4 * (dense / 8 + experts / ep / edp))


def test_all_to_all_bytes_and_time():
    """No all-to-all at ep 1; at ep > 1 a rank sends (T k (ep-1)/ep) h values per exchange (dispatch, combine, and
    their gradients) plus the (ep, E/ep) int64 counts, and recomputation repeats the forward's; the step's ep time
    is those bytes at the busiest rank's margin over the link, per MoE layer and micro-batch, and its compute the
    busiest rank's extra expert rows."""
    cfg = with_layout(load(TINY_MOE), global_batch_size=16)
    assert ep_plan.a2a_bytes_per_layer(cfg, 1) == (0.0, 0.0)
    m, t = cfg.model, cfg.train
    for ep in (2, 4):
        copies = t.micro_batch_size * t.seq_len * m.experts_per_token * (ep - 1) / ep
        fwd, bwd = ep_plan.a2a_bytes_per_layer(cfg, ep)
        assert bwd == 2 * copies * m.hidden_size * 4  # fp32 on the CPU: dispatch and combine gradients
        assert fwd == bwd + 8 * m.num_experts * (ep - 1) / ep
        recomputed = ep_plan.a2a_bytes_per_layer(with_layout(cfg, activation_checkpointing="full"), ep)
        assert recomputed == (fwd, bwd + fwd)
    hw = Hardware(peak_tflops=100.0, intra_node_gbps=100.0, latency_us=0.0)
    assert step_time(cfg, 8, hw).ep_comm == 0
    st = step_time(with_layout(cfg, ep=2), 8, hw)
    fwd, bwd = ep_plan.a2a_bytes_per_layer(cfg, 2)
    micro_batches = 16 // (2 * 8)
    assert st.ep_comm == pytest.approx(2 * micro_batches * ep_plan.EP_IMBALANCE * (fwd + bwd) / 100e9)
    # the busiest rank's experts compute EP_IMBALANCE x the mean copies: 6 FLOPs a weight, k 3 h f of them a copy
    extra = (
        (ep_plan.EP_IMBALANCE - 1)
        * t.micro_batch_size
        * t.seq_len
        * m.experts_per_token
        * 3
        * m.hidden_size
        * m.intermediate_size
        * 6
        * 2
        * micro_batches
    )
    assert st.compute - step_time(cfg, 8, hw).compute == pytest.approx(extra / (100e12 * 0.5))


def _bench_rank(argv):
    from engine.parallel.ep import dispatch
    from launch.bench.moe import Counter

    counter = Counter()
    dispatch.dist.all_to_all_single = counter
    try:
        got = measure_rank(argv)  # two steps, then the measured third: 3 steps of all-to-alls
    finally:
        dispatch.dist.all_to_all_single = counter.inner
    return {**got, "sent": counter.sent / 3}


def test_ep2_step_memory_and_bytes_match_measured(tmp_path):
    """The tiny MoE at ep 2 on 2 forked ranks (dp 2, ddp): weights, gradients, AdamW state exact (1 %); the busiest
    rank's saved activations and step peak within 10 % of the plan (the issue's bound; the plan counts its margin);
    the bytes each rank sends by all-to-all within 15 % of the planned mean (routing decides how many copies stay
    on their own rank: both ranks measured 7.4 % above it from this initialisation)."""
    argv = TINY_MOE + ["--parallel.ep", "2", "--train.out_dir", str(tmp_path)]
    cfg = load(argv)
    got = run_ranks(_bench_rank, 2, argv, threads=1)
    plan = stage_memory(cfg, 2, 0)
    for r in got:
        for key, planned in (("params", plan.weights), ("grads", plan.grads), ("optimizer", plan.optimizer)):
            assert r[key] == pytest.approx(planned, rel=0.01), key
    assert max(r["activations"] for r in got) == pytest.approx(plan.activations, rel=0.10)
    assert max(r["peak"] for r in got) == pytest.approx(plan.total, rel=0.10)
    fwd, bwd = ep_plan.a2a_bytes_per_layer(cfg, 2)
    for r in got:
        assert r["sent"] == pytest.approx(2 * (fwd + bwd), rel=0.15)  # 2 MoE layers, 1 micro-batch


@pytest.mark.parametrize("extra", [["--train.activation_checkpointing", "full"], ["--train.dtype", "bf16"]])
def test_ep2_bytes_under_recomputation_and_autocast(tmp_path, extra):
    """Recomputation repeats the forward's exchanges in the backward; under autocast the dispatch sends the fp32
    residual stream and the combine the experts' bf16 output (and their gradients, each in its dtype): measured
    7.4 % and 7.7 % above the planned mean, as in fp32 without recomputation."""
    argv = TINY_MOE + ["--parallel.ep", "2", "--train.out_dir", str(tmp_path), *extra]
    fwd, bwd = ep_plan.a2a_bytes_per_layer(load(argv), 2)
    for r in run_ranks(_bench_rank, 2, argv, threads=1):
        assert r["sent"] == pytest.approx(2 * (fwd + bwd), rel=0.15)


@pytest.mark.slow  # ~50 s of search; CI: the ep planner tests above
def test_mixtral_on_64_gpus_plans_expert_parallelism():
    """Mixtral 8x7B on 8 nodes of 8 x 80 GB: layouts with ep > 1 fit, pay all-to-all time, and hold less than
    the same layout at ep 1 under ddp (E/ep experts a rank); under fsdp no more."""
    cfg = load(["--config", "configs/mixtral-8x7b.yaml", "--parallel.backend", "nccl"])
    plans = [p for p in search(cfg, 64, Hardware()) if p.fits]
    with_ep = [p for p in plans if p.layout.ep > 1]
    assert with_ep and all(p.time.ep_comm > 0 for p in with_ep)
    assert all(p.time.ep_comm == 0 for p in plans if p.layout.ep == 1)
    ddp = [p for p in with_ep if p.cfg.parallel.dp_mode == "ddp"]
    best = min(ddp, key=lambda p: p.time.total)
    one = with_layout(best.cfg, ep=1)
    assert stage_memory(one, 64, 0).state > stage_memory(best.cfg, 64, 0).state
    # fsdp shards the experts over dp x cp at ep 1 and over expert-dp x ep at ep > 1 (the same shard bytes), but
    # a unit gathered and kept to the backward (reshard_after_forward off at pp > 1) holds E/ep experts, not E
    for p in (p for p in with_ep if p.cfg.parallel.dp_mode == "fsdp"):
        assert stage_memory(with_layout(p.cfg, ep=1), 64, 0).state >= stage_memory(p.cfg, 64, 0).state * (1 - 1e-9)


def test_live_bytes_do_not_count_views_of_a_list_return():
    """The measuring harness (engine/metrics/memory.py LiveTensorBytes): unbind, split and chunk of a tensor made
    before the mode allocate nothing (Experts.forward unbinds the stacked expert weights; counting each view's
    storage added a copy of every MoE layer's experts to the measured peak), while a real allocation counts."""
    import torch

    from engine.metrics.memory import LiveTensorBytes

    weight = torch.zeros(4, 8, 16)
    with LiveTensorBytes() as live:
        views = [*weight.unbind(0), *weight.split(1), *weight.chunk(2)]
        fresh = weight * 2
    assert views and live.peak == fresh.numel() * 4


def test_zero_with_ep_is_refused_by_the_planner_in_one_line():
    """zero does not reduce expert gradients over expert-dp: the planner refuses it (resolve_layout's check) rather
    than pricing its buckets over the wrong group, and the search never offers it."""
    from engine.config import ConfigError

    cfg = with_layout(load(TINY_MOE), dp_mode="zero", zero_stage=1, ep=2, global_batch_size=16)
    with pytest.raises(ConfigError, match="parallel.ep=2 with parallel.dp_mode=zero is not supported") as e:
        stage_memory(cfg, 8, 0)
    assert "\n" not in str(e.value)
    offered = search(with_layout(load(TINY_MOE), global_batch_size=16), 4, Hardware())
    assert {p.layout.ep for p in offered} == {1, 2, 4}
    assert not any(p.layout.ep > 1 and p.cfg.parallel.dp_mode == "zero" for p in offered)
