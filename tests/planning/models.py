"""What the planner tests share: the hardware of the hand-computed step times (HW; FREE_COMM: communication for
free), the tiny model at a layout (tiny), a tiny-shaped model of any depth (_model), and what a schedule's tables
hold at their peak (table_peak, w_state)."""

from __future__ import annotations

import functools

from engine.config import load
from engine.kinds.schedules import SCHEDULES
from engine.parallel.pp import schedule as sched
from engine.parallel.pp.actions import Op, virtual_stage
from engine.parallel.pp.split import stage_layer_ranges
from engine.planning import activations as acts
from engine.planning import schedules
from engine.planning.planner import with_layout
from engine.planning.search import Hardware

HW = Hardware(peak_tflops=100.0, efficiency=0.5, intra_node_gbps=100.0, latency_us=0.0)


def tiny(**layout):
    return with_layout(load(["--config", "configs/tiny.yaml"]), **layout)  # gbs 16, mbs 4, seq 128, fp32


# Free transfers and all-reduces: every virtual stage then costs exactly 1/v of a stage.
FREE_COMM = Hardware(peak_tflops=100.0, efficiency=0.5, intra_node_gbps=1e12, latency_us=0.0)


@functools.lru_cache(maxsize=None)
def _model(layers: int):
    return load(
        [
            "--config",
            "configs/tiny.yaml",
            "--model.hidden_size",
            "128",
            "--model.intermediate_size",
            "344",
            "--model.num_layers",
            str(layers),
            "--train.seq_len",
            "32",
            "--train.micro_batch_size",
            "1",
        ]
    )


def w_state(cfg, layers: int) -> float:
    """One micro-batch's W state, from the zero-bubble design (engine/parallel/autograd/weight_grad.py): per linear of a
    block (q, k, v, o, gate, up, down; not the LM head) its output gradient, and its input (one norm output shared
    by q/k/v and one by gate/up, the attention output, the SwiGLU product), fp32."""
    mc = cfg.model
    g = mc.num_heads * mc.head_dim + 2 * mc.num_kv_heads * mc.head_dim + 2 * mc.hidden_size + 2 * mc.intermediate_size
    x = 2 * mc.hidden_size + mc.num_heads * mc.head_dim + mc.intermediate_size
    return 4.0 * cfg.train.seq_len * layers * (g + x)


def table_peak(cfg, pp: int, m: int, stage: int) -> float:
    """The most bytes the rank's action table keeps alive: the set of (micro-batch, chunk) pairs forwarded and not
    yet backwarded (BWD, or B under zero bubble), each at its own chunk's size, plus W states from B to W."""
    v, vshape = schedules.virtual_stages(cfg), SCHEDULES[cfg.parallel.schedule].vshape
    layers = cfg.model.num_layers // (pp * v) if v > 1 else len(stage_layer_ranges(cfg.model.num_layers, pp)[stage])

    def size(chunk):  # the activations ledger of the chunk's layers, as its virtual stage (chunk*pp + stage of
        # pp*v; zbv: stage or 2pp-1-stage)
        return acts.micro_batch_bytes(cfg, 1, pp * v, virtual_stage(pp, stage, chunk, vshape), layers)

    alive, waiting, peak = set(), set(), 0.0
    for a in sched.build(cfg.parallel.schedule, pp, m, stage, cfg.parallel.virtual_stages):
        pair = (a.mb, a.chunk)
        if a.op is Op.FWD:
            alive.add(pair)
        elif a.op is Op.BWD_INPUT:
            alive.remove(pair)
            waiting.add(pair)
        elif a.op is Op.BWD:
            alive.remove(pair)
        elif a.op is Op.BWD_WEIGHT:
            waiting.remove(pair)
        else:
            continue
        peak = max(peak, sum(size(c) for _, c in alive) + len(waiting) * w_state(cfg, layers))
    return peak
