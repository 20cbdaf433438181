"""The fused per-part kernel of ring attention on CPU: torch's FlashAttention-2 for CPU (Dao 2023), which returns
the part's log-sum-exp beside its output and whose backward takes the FINAL output and log-sum-exp, so the
online-softmax merge and the ring backward (ring.py) use it exactly as they use the explicit math of ring_block.py.
It never materialises the (c, c) scores and reads grouped-query k/v (nkv heads) natively.

It runs a part whose mask needs no tensor: every key seen (FULL) or causal within one chunk (CAUSAL, the
top-left-aligned triangle of ``is_causal``); a part cut by document borders (MASKED), and every part on other
devices, takes the math path (ring_block.py). CUDA's fused kernels (flash: 16-bit without a mask; efficient: lse
padded to 32 rows) are not wired in: no GPU was at hand to test them.
"""

from __future__ import annotations

import torch

from engine.parallel.cp.ring_plan import CAUSAL, FULL


def fused_kinds(device: torch.device) -> tuple[str, ...]:
    """The part kinds (ring_plan.py) this kernel runs on ``device``."""
    return (FULL, CAUSAL) if device.type == "cpu" else ()


def forward_part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, nh, cq, hd), k and v (b, nkv, ck, hd) in the input dtype -> (o (b, nh, cq, hd) fp32,
    lse (b, nh, cq) fp32)."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, kind == CAUSAL, scale=scale)
    return o.float(), lse.float()


def backward_part(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    kind: str,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    """do, q, o (b, nh, cq, hd) and k, v (b, nkv, ck, hd) in the input dtype, lse (b, nh, cq) fp32 the final
    log-sum-exp -> (dq (b, nh, cq, hd), dk, dv (b, nkv, ck, hd)), fp32: this part's share of the gradients."""
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse.contiguous(), 0.0, kind == CAUSAL, scale=scale
    )
    return tuple(g.float() for g in grads)
