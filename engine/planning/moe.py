"""Parameter and width counts of the MLP slot of each decoder layer, dense or mixture of experts (engine/model/moe.py),
for the planner (weights, gradients, optimizer state, activations). The ACTIVE weights a token passes through
(the FLOPs of MFU) are counted with the FLOP formulas, engine/model/flops.py.

A dense layer's MLP is SwiGLU, 3 h f weights. An MoE layer holds the router (E h), E experts (3 h f_e each) and
Qwen2-MoE's shared expert (3 h f_s) with its gate (h); a token passes through the router, k experts and the shared
expert, so its ACTIVE matmul weights are E h + k 3 h f_e + 3 h f_s + h (Mixtral 8x7B: 12.9B of 46.7B; the 6N of
MFU counts these, as Mixtral's and DeepSeek's reports do).
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.model.flops import expert_width, shared_expert_params
from engine.model.moe import is_moe_layer

# Expert parallelism's load-imbalance margin: the busiest ep rank receives this many times the mean token copies,
# so it holds that many more expert activations and sets the all-to-all's time (engine/planning/ep.py).
# launch/bench/moe.py's "rows/rank max/mean" (the tiny MoE, world 4, 6 steps from initialisation, aux loss 0.01):
# 1.07 at ep 2, 1.27 at ep 4; the larger is the default. A trained router is usually more even; measure and set.
EP_IMBALANCE = 1.27


def mlp_params(m: ModelConfig, index: int) -> int:
    """Weights of layer ``index``'s MLP slot: SwiGLU, or router + all experts + shared expert."""
    h = m.hidden_size
    if not is_moe_layer(m, index):
        return 3 * h * m.intermediate_size
    return m.num_experts * h + m.num_experts * 3 * h * expert_width(m) + shared_expert_params(m)


def expert_params(m: ModelConfig, index: int) -> int:
    """The routed experts' weights of layer ``index`` (E stacked SwiGLUs, 3 h f_e each; 0 for a dense layer): what
    expert parallelism splits over ep ranks."""
    return m.num_experts * 3 * m.hidden_size * expert_width(m) if is_moe_layer(m, index) else 0


def expert_rows(ep: int) -> float:
    """Token copies the experts of the busiest rank compute, per copy its tokens route: 1 at ep = 1 (a rank's
    experts take its own copies), EP_IMBALANCE under expert parallelism (engine/planning/ep.py)."""
    return EP_IMBALANCE if ep > 1 else 1.0


def token_ffn_width(m: ModelConfig, index: int, ep: int = 1) -> float:
    """The SwiGLU width one token's activations have in layer ``index``: f, or k f_e + f_s, the k f_e of the
    experts' rows on the busiest of ``ep`` ranks (expert_rows)."""
    if not is_moe_layer(m, index):
        return m.intermediate_size
    return m.experts_per_token * expert_width(m) * expert_rows(ep) + m.moe_shared_expert_size


def routing_bytes_per_token(m: ModelConfig, index: int, width: int, ep: int = 1) -> float:
    """What an MoE layer saves per token beyond its SwiGLU activations: the k gathered input copies (the experts'
    input: the rows that reach the busiest of ``ep`` ranks), the k expert outputs before and after weighting (h
    each, in the compute dtype ``width``), the router logits and the fp32 softmax of the aux loss (E each), the gate
    weights and the sort's int64 indices (about 3 k); under expert parallelism the int64 orders that regroup the
    arriving rows by expert and send the outputs back (2 per row, engine/parallel/ep/dispatch.py)."""
    if not is_moe_layer(m, index):
        return 0.0
    k, h, rows = m.experts_per_token, m.hidden_size, expert_rows(ep)
    regroup = 2 * 8 * k * rows if ep > 1 else 0.0
    return (2 + rows) * k * h * width + m.num_experts * (width + 4) + k * (4 + 8 + 8) + regroup


def mean_over_layers(m: ModelConfig, count) -> float:
    """``count(m, index)`` averaged over the decoder layers (the planner's per-layer figures are uniform)."""
    return sum(count(m, i) for i in range(m.num_layers)) / m.num_layers


def expert_grad_buffer_bytes(m: ModelConfig, ep: int = 1) -> float:
    """The backward's gradient of one MoE layer's expert weights before it reaches .grad: unbind's backward
    (Experts.forward) stacks the per-expert gradients of this rank's E/ep experts into one (E/ep, ...) tensor,
    4 (E/ep) 3 h f_e bytes in fp32 (measured on the tiny MoE at ep 1 and 2, one and two stages:
    tests/planning/test_planner.py, tests/planning/test_plan_ep.py); 0 for a dense model."""
    if not m.num_experts:
        return 0.0
    return 4.0 * m.num_experts // ep * 3 * m.hidden_size * expert_width(m)
