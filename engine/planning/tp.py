"""Tensor parallelism's communication in the step-time model (engine/planning/search.py stage_cost): what the tp
linears' collectives leave exposed, per micro-batch on one stage, forward and backward.

Blocking (engine/parallel/tp/layers.py), in rings (an all-reduce, or a reduce-scatter + an all-gather of the same
bytes; engine/planning/links.py ring_time, Thakur et al. 2005), every one exposed: forward, a sub-layer (attention,
MLP) meets once after its row-parallel linear, and the embedding once; backward, once in front of each column-
parallel linear and the LM head, and under sequence parallelism each of them also re-gathers its (b, s/tp, h) input
for its weight gradient (half a ring). Recomputation meets again where torch's checkpoint re-runs a collective: not
the down projection's (its output feeds only the residual add, which the early-stopping recomputation never needs),
so without sequence parallelism one all-reduce a layer (o's), with it three halves under full (q/k/v's all-gather,
o's reduce-scatter, gate/up's all-gather) and two under selective (the all-gathers: the row linears' operator output
is kept). Counted in the model at tp 2 against these figures by tests/parallel/tp/test_collective_matmul.py.

Overlapped (parallel.tp_comm_overlap, sequence parallelism; engine/parallel/autograd/collective_matmul.py): each of
those all-gathers and reduce-scatters, and a column linear's backward re-gather of its input, is a ring of tp - 1
point-to-point steps, each moving one (b, s/tp, h) chunk while the matmul of one chunk runs, so a ring leaves
exposed (tp - 1) max(0, t_step - t_chunk) (Wang et al. 2023), t_chunk being 1/tp of the matmul it feeds: forward
the column linear's (its all-gather) and the row linear's (its reduce-scatter); backward the row linear's input and
weight gradients (the all-gather of its output gradient), the column linear's input gradient (its reduce-scatter)
and its weight gradient (the re-gather). Recomputation repeats the forward rings: under full recomputation behind
the recomputed matmuls; under selective, which keeps the matmul outputs and the row linears' reduce-scattered
ones, the column linears' all-gathers run again with no matmul behind them (measured: tests/parallel/tp/
test_collective_matmul.py counts the rings). An MoE layer's MLP slot (engine/parallel/tp/moe.py: gathered to a
replicated block) and the embedding's reduce-scatter stay blocking.
"""

from __future__ import annotations

from engine.config import Config
from engine.kinds.recompute import RECOMPUTE
from engine.planning.links import link_bandwidth, ring_time


def overlapped(cfg: Config, tp: int) -> bool:
    """Whether the tp collectives run as collective matmuls (parallel.tp_comm_overlap under sequence parallelism)."""
    p = cfg.parallel
    return tp > 1 and p.sequence_parallel and p.tp_comm_overlap


def linear_flops(cfg: Config, tokens: int, tp: int) -> dict[str, float]:
    """Forward FLOPs of each tp linear of a dense decoder layer on one tp rank for ``tokens`` tokens: 2 T in out / tp
    (q/k/v and gate/up fused: engine/model/fused.py)."""
    m = cfg.model
    h, hd, f = m.hidden_size, m.head_dim, m.intermediate_size
    shapes = {
        "qkv": (h, (m.num_heads + 2 * m.num_kv_heads) * hd),
        "o": (m.num_heads * hd, h),
        "gate_up": (h, 2 * f),
        "down": (f, h),
    }
    return {name: 2.0 * tokens * i * o / tp for name, (i, o) in shapes.items()}


def blocking_rings(cfg: Config, layers: int, moe: int, ends: tuple[bool, bool]) -> tuple[float, float]:
    """(forward, backward) rings of the blocking collectives of one micro-batch (module docstring); an MoE layer's
    MLP slot meets once each way (its sequence gathers: engine/parallel/tp/moe.py)."""
    first, last = ends
    recompute = RECOMPUTE[cfg.train.activation_checkpointing]
    sp, dense = cfg.parallel.sequence_parallel, layers - moe
    bwd = 2 * layers + last + (0.5 * (layers + dense + last) if sp else 0.0)  # sp: the column linears' re-gathers
    if recompute.recomputes and sp:
        bwd += (1.0 if recompute.keeps_matmul_outputs else 1.5) * layers
    elif recompute.recomputes:
        bwd += layers
    return 2 * layers + first, bwd


def comm_time(cfg: Config, tp: int, hw, tokens: int, layers: int, moe: int, ends: tuple[bool, bool]):
    """(forward, backward) exposed seconds of one micro-batch's tp collectives on a stage of ``layers`` decoder
    layers (``moe`` of them MoE) over ``tokens`` tokens; ``ends``: (embedding here, LM head here). ``hw``:
    engine/planning/search.py Hardware."""
    if tp == 1:
        return 0.0, 0.0
    act = tokens * cfg.model.hidden_size * (2 if cfg.train.dtype == "bf16" else 4)  # one (b, s, h) activation
    bw = link_bandwidth(hw, tp)
    ring = ring_time(act, tp, 2, bw, hw.latency_us)  # an all-reduce, or a reduce-scatter + an all-gather
    if not overlapped(cfg, tp):
        fwd, bwd = blocking_rings(cfg, layers, moe, ends)
        return fwd * ring, bwd * ring
    recompute = RECOMPUTE[cfg.train.activation_checkpointing]
    first, last = ends
    rate = hw.peak_tflops * 1e12 * hw.efficiency  # one rank's matmul FLOP/s
    step = act / tp / (bw * 1e9) + hw.latency_us * 1e-6  # one ring step: a (b, s/tp, h) chunk

    def hidden_behind(flops: float) -> float:  # a ring's exposed seconds behind a matmul of ``flops``
        return (tp - 1) * max(0.0, step - flops / tp / rate)

    mm = linear_flops(cfg, tokens, tp)
    attention_fwd = hidden_behind(mm["qkv"]) + hidden_behind(mm["o"])
    attention_bwd = hidden_behind(2 * mm["o"]) + 2 * hidden_behind(mm["qkv"])
    mlp_fwd = hidden_behind(mm["gate_up"]) + hidden_behind(mm["down"])
    mlp_bwd = hidden_behind(2 * mm["down"]) + 2 * hidden_behind(mm["gate_up"])
    dense = layers - moe  # an MoE layer's MLP slot meets blocking, as above
    if recompute.keeps_matmul_outputs:  # selective: the column linears' all-gathers again, nothing behind them
        again = hidden_behind(0.0) * (layers + dense)
    else:
        again = (attention_fwd * layers + mlp_fwd * dense) * recompute.recomputes
    head = 2.0 * tokens * cfg.model.hidden_size * cfg.model.vocab_size / tp  # the LM head's forward FLOPs
    fwd = attention_fwd * layers + mlp_fwd * dense + ring * moe + first * ring + last * hidden_behind(head)
    bwd = attention_bwd * layers + mlp_bwd * dense + ring * moe * (1 + recompute.recomputes) + again
    return fwd, bwd + last * 2 * hidden_behind(head)
