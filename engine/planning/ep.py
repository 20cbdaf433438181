"""Expert parallelism in the planner (parallel.ep; engine/parallel/ep/): which group holds the experts' state, the
token all-to-all's bytes and exposed time, and the load-imbalance margin.

State: an ep group is ep consecutive dp ranks (engine/parallel/layout/mesh.py split_along), each holding E/ep experts of
every MoE layer (and 1/tp of each, as the dense MLP); the ranks holding the same experts form the expert-dp group
of edp = dp cp / ep ranks. The dp modes' planner models price the experts' weights, gradients and AdamW state over
that group as they price the dense part over dp cp (``expert_layout``): ddp replicates them (16 bytes a weight in
fp32, Rajbhandari et al. 2020's stage 0), fsdp shards them over edp (stage 3); zero with ep > 1 is refused by
engine/parallel/layout/checks.py. At ep = 1 the experts are priced with the dense weights, as before.

All-to-all (GShard, Lepikhin et al. 2020; engine/parallel/ep/dispatch.py): per MoE layer and micro-batch a rank
routes its T = b s / cp tokens to k experts and sends each copy whose expert lives on another ep rank: with routing
spread evenly, T k (ep - 1)/ep copies of h values. Four exchanges move that many rows: dispatch (the input, in the
residual dtype) and combine (the experts' output, in their matmul dtype, or the input's on the grouped GEMM) in the
forward, and the reverse of each in the backward, plus the (ep, E/ep) int64 counts before the dispatch. Activation
checkpointing (full or selective: the all-to-all is no GEMM, so it is recomputed) repeats the forward's exchanges
in the backward. The exchanges sit between the router and the experts, so nothing overlaps them: their time is
exposed, on the link the ep group spans.

Imbalance: the router does not spread the copies evenly; the busiest ep rank receives ``EP_IMBALANCE`` times the
mean, and that rank sets the exchange time (it receives the most), holds the most expert activations
(engine/planning/moe.py expert_rows) and computes the most expert FLOPs, which the others wait for at the combine
(``straggler_weights``). The margin is engine/planning/moe.py's EP_IMBALANCE, launch/bench/moe.py's
measured ``rows/rank max/mean``.
"""

from __future__ import annotations

import dataclasses

from engine.config import Config, ModelConfig
from engine.kinds.recompute import RECOMPUTE
from engine.model.moe import is_moe_layer
from engine.parallel.layout.checks import Layout
from engine.planning.activations import device_type, local_tokens, logit_bytes, mode, residual_bytes
from engine.planning.moe import EP_IMBALANCE, expert_rows


def expert_layout(layout: Layout) -> Layout:
    """``layout`` as the dp mode's planner model sees the experts: their state is reduced and sharded over the
    expert-dp group of dp cp / ep ranks, strided by ep (its span: engine/planning/dp.py group_span)."""
    return dataclasses.replace(layout, dp=layout.dp * layout.cp // layout.ep, cp=1)


def moe_layers(m: ModelConfig, indices) -> int:
    return sum(is_moe_layer(m, i) for i in indices)


def a2a_bytes_per_layer(cfg: Config, ep: int) -> tuple[float, float]:
    """(forward, backward) mean bytes one rank sends to other ep ranks in one MoE layer for one micro-batch
    (received: the same on average; module docstring). 0 at ep = 1."""
    if ep == 1:
        return 0.0, 0.0
    m = cfg.model
    rows = local_tokens(cfg) * m.experts_per_token * (ep - 1) / ep  # copies bound for other ranks
    grouped = device_type(cfg) == "cuda" and mode(cfg) != "fp32"  # torch's grouped GEMM returns x's dtype
    dispatch, combine = residual_bytes(cfg), residual_bytes(cfg) if grouped else logit_bytes(cfg)
    counts = 8.0 * m.num_experts * (ep - 1) / ep  # (ep, E/ep) int64, ep - 1 rows sent
    forward = counts + rows * m.hidden_size * (dispatch + combine)
    backward = rows * m.hidden_size * (dispatch + combine)  # the gradients, reversed
    if RECOMPUTE[cfg.train.activation_checkpointing].recomputes:
        backward += forward  # the recomputed forward exchanges again
    return forward, backward


def a2a_time_per_layer(
    cfg: Config, ep: int, bw_gbps: float, latency_us: float, imbalance: float = EP_IMBALANCE
) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one MoE layer's all-to-alls for one micro-batch: the busiest rank
    receives ``imbalance`` times the mean bytes over a ``bw_gbps`` link, ep - 1 peers a latency each per exchange."""
    fwd, bwd = a2a_bytes_per_layer(cfg, ep)
    if not fwd:
        return 0.0, 0.0
    # forward: counts, dispatch, combine (again when recomputed)
    exchanges = 6 if RECOMPUTE[cfg.train.activation_checkpointing].recomputes else 3
    lat = latency_us * 1e-6 * (ep - 1)
    return imbalance * fwd / (bw_gbps * 1e9) + 3 * lat, imbalance * bwd / (bw_gbps * 1e9) + (exchanges - 1) * lat


def straggler_weights(cfg: Config, ep: int) -> float:
    """Expert matmul weights per token and MoE layer that the busiest ep rank passes beyond the mean: its experts
    compute EP_IMBALANCE times the mean copies, k 3 h f_e weights each, and the other ranks wait for them at the
    combine (0 at ep = 1, where each rank computes its own copies)."""
    m = cfg.model
    return (
        (expert_rows(ep) - 1)
        * m.experts_per_token
        * 3
        * m.hidden_size
        * (m.moe_intermediate_size or m.intermediate_size)
    )


def ep_span(layout: Layout) -> int:
    """Consecutive global ranks an ep group spans: ep dp ranks, each tp cp ranks apart (tp fastest, then cp, then
    dp: engine/parallel/layout/mesh.py)."""
    return layout.ep * layout.tp * layout.cp
