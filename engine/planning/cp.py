"""Context parallelism in the planner: the ring's buffers, the bytes each cp mode moves per layer, and their time.

Per rank of a cp group of size cp, with L = s / cp local tokens of a micro-batch of b sequences and the tp-local
heads a/t (queries) and n_kv/t (keys and values) of hd values each, w bytes in the compute dtype:
- ring (engine/parallel/cp/ring.py; Liu et al. 2023, "Ring Attention"): a K/V block is (2, b, n_kv/t, L, hd), its
  k and v, B = 2 b n_kv L hd w / t bytes. Forward: cp - 1 blocks sent (and received) per layer, each step holding
  the current block and the incoming one (2 B on the wire at once). Backward: the blocks rotate again (cp - 1) and
  the dK/dV accumulators travel beside them in fp32 (cp hops: cp - 1 in the loop and the last one home), so a step
  posts the two K/V blocks, the accumulator it passes on and the one arriving (2 B + 2 B32, B32 = B 4 / w; at cp 2
  no step has both), and fills one more accumulator (B32).
- all_to_all (engine/parallel/cp/ulysses.py; Jacobs et al. 2023, "DeepSpeed Ulysses"): q and the output
  (b, L, a/t, hd) and k, v (b, L, n_kv/t, hd) are exchanged sequence <-> heads, each moving (cp - 1)/cp of itself;
  the backward moves their gradients, the same bytes again.
Time: a ring step's transfer overlaps that step's attention (1/cp of the layer's, Q K^T and A V at 4 a hd s FLOPs a
token forward, twice that backward, halved by the causal mask that the load-balanced layout splits evenly), so
only the excess shows, plus a latency per step; all_to_all is not overlapped (it sits between the projections and
attention). The cp group spans cp tp consecutive ranks (engine/parallel/layout/mesh.py: tp fastest, then cp).
"""

from __future__ import annotations

from engine.config import Config
from engine.kinds.cp_modes import CpModeSpec
from engine.planning.activations import cp_mode, logit_bytes


def _block_bytes(cfg: Config, tp: int, width: int) -> float:
    """One K/V block (2, b, n_kv/t, s/cp, hd) at ``width`` bytes a value."""
    m, t = cfg.model, cfg.train
    return 2.0 * t.micro_batch_size * m.num_kv_heads / tp * t.seq_len / cfg.parallel.cp * m.head_dim * width


class RingModel:
    """cp_mode ring's planner model (CpModeSpec.planner): K/V blocks rotating, overlapped with attention."""

    def wire_bytes(self, cfg: Config, tp: int) -> tuple[float, float]:
        block, fp32 = _block_bytes(cfg, tp, logit_bytes(cfg)), _block_bytes(cfg, tp, 4)
        # backward: from step 1 on the finished accumulator goes out as the next one arrives; K/V rotate until step
        # cp - 2, so both are in one batch only where cp > 2
        return 2 * block, 2 * fp32 + (2 * block if cfg.parallel.cp > 2 else 0)

    def bytes_per_layer(self, cfg: Config, tp: int) -> tuple[float, float]:
        cp = cfg.parallel.cp
        return (cp - 1) * _block_bytes(cfg, tp, logit_bytes(cfg)), (cp - 1) * _block_bytes(
            cfg, tp, logit_bytes(cfg)
        ) + cp * _block_bytes(cfg, tp, 4)

    def exposed(
        self, cfg: Config, tp: int, fwd: float, bwd: float, rate: float, bw_gbps: float, lat: float
    ) -> tuple[float, float]:
        m, t, cp = cfg.model, cfg.train, cfg.parallel.cp
        # per ring step: 1/cp of the layer's causal attention on this rank's s/cp queries
        attn = t.micro_batch_size * t.seq_len / cp * 4 * m.num_heads / tp * m.head_dim * t.seq_len / 2 / rate / cp
        step_f, step_b = fwd / (cp - 1) / (bw_gbps * 1e9), bwd / cp / (bw_gbps * 1e9)
        return (cp - 1) * (max(0.0, step_f - attn) + lat), cp * (max(0.0, step_b - 2 * attn) + lat)


class AllToAllModel:
    """cp_mode all_to_all's planner model (CpModeSpec.planner): q, k, v and the output exchanged, not overlapped."""

    def wire_bytes(self, cfg: Config, tp: int) -> tuple[float, float]:
        return 0.0, 0.0

    def bytes_per_layer(self, cfg: Config, tp: int) -> tuple[float, float]:
        m, t, cp = cfg.model, cfg.train, cfg.parallel.cp
        local = t.micro_batch_size * t.seq_len / cp * m.head_dim * logit_bytes(cfg)
        moved = 2 * (m.num_heads + m.num_kv_heads) / tp * local * (cp - 1) / cp  # q, o; k, v
        return moved, moved

    def exposed(
        self, cfg: Config, tp: int, fwd: float, bwd: float, rate: float, bw_gbps: float, lat: float
    ) -> tuple[float, float]:
        cp = cfg.parallel.cp
        return fwd / (bw_gbps * 1e9) + (cp - 1) * lat, bwd / (bw_gbps * 1e9) + (cp - 1) * lat


# The planner models a CpModeSpec.planner may name (engine/kinds/cp_modes.py): a new cp mode adds its class here.
MODELS = {c.__name__: c for c in (RingModel, AllToAllModel)}


def model_class(spec: CpModeSpec) -> type:
    """The planner model class ``spec.planner`` names."""
    if spec.planner not in MODELS:
        raise LookupError(f"cp mode {spec.name}: no planner model {spec.planner!r} (one of {', '.join(MODELS)})")
    return MODELS[spec.planner]


def planner_model(cfg: Config):
    """The planner model of the run's cp mode (its CpModeSpec.planner); None at cp = 1."""
    spec = cp_mode(cfg)
    return model_class(spec)() if spec else None


def ring_wire_bytes(cfg: Config, tp: int) -> tuple[float, float]:
    """(forward, backward) bytes of the ring's send and receive buffers posted at once in one step of one layer."""
    model = planner_model(cfg)
    return model.wire_bytes(cfg, tp) if model else (0.0, 0.0)


def buffer_bytes(cfg: Config, tp: int) -> float:
    """Short-lived bytes cp adds to a layer's backward: the ring's wire buffers and the accumulator being filled."""
    wire = ring_wire_bytes(cfg, tp)[1]
    return wire + _block_bytes(cfg, tp, 4) if wire else 0.0


def bytes_per_layer(cfg: Config, tp: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per layer and micro-batch (received: the same)."""
    model = planner_model(cfg)
    return model.bytes_per_layer(cfg, tp) if model else (0.0, 0.0)


def comm_time(cfg: Config, tp: int, rate: float, bw_gbps: float, latency_us: float) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's cp communication for one micro-batch; ``rate`` the FLOP/s
    one rank achieves, ``bw_gbps`` the cp group's link."""
    model = planner_model(cfg)
    if model is None:
        return 0.0, 0.0
    fwd, bwd = model.bytes_per_layer(cfg, tp)
    return model.exposed(cfg, tp, fwd, bwd, rate, bw_gbps, latency_us * 1e-6)
