"""The decoder block's memory-bound kernels: the bytes its element-wise kernels move through device memory per token,
which the step-time model (engine/planning/search.py stage_cost) prices at the HBM bandwidth (Hardware.hbm_gbps)
beside the matmuls at ``efficiency`` of the peak: a roofline per kernel class (Williams et al. 2009, "Roofline: an
insightful visual performance model"), where a kernel of arithmetic intensity I FLOP/byte runs at min(peak, I x
bandwidth). The matmuls of a block are far right of the ridge (an (m, k) x (k, n) GEMM of this planner's sizes does
thousands of FLOPs a byte; an A100's ridge is 312e12 / 2.04e12 = 153) and the element-wise kernels far left (under
one FLOP a byte), so each class takes one side's time and the sum is the block's. The matmuls' work per token grows
as h^2 / t, these kernels' bytes as h (or h / t), which is why a larger model's step achieves more of the peak
(Narayanan et al. 2021, Sec. 5.1: utilisation improves with the larger matrix multiplications).

What is counted, per token and layer on one tp rank, forward, read once and written once per eager kernel as
engine/model/transformer.py and lean_ops.py run them (r: bytes of the residual stream, 4 under autocast or fp32,
2 in bf16; c: of the matmul outputs, 2 unless fp32; H = h, or h / t under sequence parallelism):
  RMSNorm (x2)  x.float(), pow, mean, x.float(), * rstd, .to(dtype), * weight; the casts are no-ops at r = 4
                                                        -> 42 H bytes at r = 2, 28 H at r = 4
  residual (x2) x + y                                   -> 3 r H
  RoPE          q and k: x cos, -x2, cat, x sin, add   -> 10 c (qd + kvd) / t
  copies        v.contiguous(), the attention output's transpose-reshape -> 2 c (kvd + qd) / t
  SwiGLU        silu(gate), * up                        -> 5 c f / t
The backward is taken as twice the forward's bytes (an element-wise op's backward reads the output gradient and
what it saved, and writes the input gradients: 3 tensors for a unary op's 2 forward, 5 for a product's 3; the
norm's backward of lean_ops.py as written moves 2.1 times its forward; tests/planning/test_kernels.py measures a
layer's at 2.0 times in bf16, 2.1 in fp32, and its forward at 0.97-0.98 times the count above); full recomputation
runs the forward once more. Not counted: the flash attention kernel's q/k/v/o traffic (its FLOPs are matmul
FLOPs), the document mask, the optimizer, the cross-entropy on the logits, autocast's weight casts, the kernel
launches, and torch.compile's fusions (train.compile would move far fewer bytes; this counts the eager kernels).

Attention that materialises its scores (Hardware.materialised_scores; not this engine, whose SDPA kernels keep them
on chip, but a system before FlashAttention, Dao et al. 2022, such as the Megatron-LM of Narayanan et al. 2021)
writes QK^T / sqrt(d) as a (b, a/t, s, s) tensor in the compute dtype and runs two memory-bound kernels over it: its
fused scale-mask-softmax and the attention dropout (MATERIALISED_SCORE_BYTES). Per token that is a/t x s elements,
the whole row (the masked kernels are dense): the term that Korthikanti et al. 2022 count as 5as/h in memory, and
in time the one that does not shrink relative to the matmuls as h grows (its share falls as s/h, not 1/h).
"""

from __future__ import annotations

from engine.config import Config
from engine.kinds.recompute import RECOMPUTE
from engine.planning.activations import ffn_width, mode, residual_bytes, sequence_share

BACKWARD_PER_FORWARD = 2.0  # bytes of an element-wise backward over its forward's (see the module docstring)

# (forward, backward) bytes per attention-score element of a materialising attention, 2-byte scores: the fused
# scale-mask-softmax reads the scores and writes the probabilities (2 + 2), its backward reads the gradient and the
# probabilities and writes the scores' gradient (2 + 2 + 2); the dropout reads 2 and writes 2 and a 1-byte mask, its
# backward reads the gradient and the mask and writes 2 (2 + 1 + 2). tests/planning/test_kernels.py measures both.
MATERIALISED_SCORE_BYTES = (4 + 5, 6 + 5)


def norm_bytes(residual: int) -> int:
    """Bytes per element one eager RMSNorm (engine/model/lean_ops.py) moves forward: x.float() and again (r + 4
    each, none at r = 4), pow (8), mean (4), * rstd (8), .to(dtype) (4 + r, none at r = 4), * weight (2 r)."""
    cast = 0 if residual == 4 else residual + 4
    return 2 * cast + 8 + 4 + 8 + cast + 2 * residual


def forward_bytes_per_token(cfg: Config, tp: int) -> float:
    """Bytes one layer's element-wise kernels move per token on one tp rank, forward (the module docstring)."""
    m = cfg.model
    r, c = residual_bytes(cfg), 4 if mode(cfg) == "fp32" else 2
    width = m.hidden_size / sequence_share(cfg, tp)  # norms and residual stream: s/t tokens under sp
    qd, kvd = m.num_heads * m.head_dim / tp, m.num_kv_heads * m.head_dim / tp
    stream = 2 * norm_bytes(r) * width + 2 * 3 * r * width
    return stream + c * (10 * (qd + kvd) + 2 * (kvd + qd) + 5 * ffn_width(cfg) / tp)


def step_bytes_per_token(cfg: Config, tp: int, materialised_scores: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes per token and layer of one micro-batch's training: the backward
    BACKWARD_PER_FORWARD times the forward, plus the forward again where full recomputation re-runs it; with
    ``materialised_scores`` also the score kernels of an attention that writes its (b, a/t, s, s) scores."""
    fwd = forward_bytes_per_token(cfg, tp)
    bwd = BACKWARD_PER_FORWARD * fwd
    if materialised_scores:
        elements = cfg.model.num_heads / tp * cfg.train.seq_len  # score elements per token: its whole row
        fwd, bwd = fwd + MATERIALISED_SCORE_BYTES[0] * elements, bwd + MATERIALISED_SCORE_BYTES[1] * elements
    again = fwd if RECOMPUTE[cfg.train.activation_checkpointing].matmul_flops else 0.0
    return fwd, bwd + again
