"""One part of a ring-attention block (ring_plan.py says which) by explicit math: its exact attention, forward with
its log-sum-exp, and backward from the final log-sum-exp.

Forward, for a block of keys: S = q k^T * scale (masked to -inf), lse_blk = logsumexp_j S, o_blk = softmax(S) v.
Blocks are merged by the online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
Liu et al. 2023, "Ring Attention with Blockwise Transformers"): lse = log(e^lse + e^lse_blk),
out = out * e^(lse_old - lse) + o_blk * e^(lse_blk - lse). Backward is FlashAttention-2's per block (Dao 2023,
Alg. 2) from the final lse and D = rowsum(dO * O): P = e^(S - lse), dV = P^T dO, dS = P * (dO V^T - D),
dQ = dS K * scale, dK = dS^T Q * scale. Explicit math: the (c, c) scores of a part are materialised, in fp32.

Grouped-query attention without repeating k/v: q (b, nh, L, hd) is viewed as (b, nkv, g, L, hd) with
g = nh / nkv (head h reads kv head h // g, as repeat_interleave and SDPA's enable_gqa do) and k/v as
(b, nkv, 1, L, hd), so the matmuls broadcast over g; dK/dV sum over g.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _scores(q5: torch.Tensor, k4: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q5 (b, nkv, g, cq, hd), k4 (b, nkv, ck, hd) fp32 -> S (b, nkv, g, cq, ck), -inf where masked."""
    s = torch.matmul(q5, k4.unsqueeze(2).transpose(-1, -2)) * scale
    return s.masked_fill(~mask, NEG_INF)


def forward_part(
    q5: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one part: (o (b, nkv, g, cq, hd), lse (b, nkv, g, cq)), fp32; a query row with no key left in
    this part has lse -inf and o 0."""
    s = _scores(q5, k4, mask, scale)
    lse = torch.logsumexp(s, dim=-1)  # (b, nkv, g, cq)
    p = torch.exp(s - lse.masked_fill(lse == NEG_INF, 0.0).unsqueeze(-1))  # masked (and empty) rows: exp(-inf) = 0
    return torch.matmul(p, v4.unsqueeze(2)), lse


def merge(out: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """Online-softmax merge, in place: out (.., cq, hd) and lse (.., cq) take in one more block's o_blk / lse_blk.
    Rows still -inf on both sides (no key seen yet) stay out = 0, lse = -inf."""
    new = torch.logaddexp(lse, lse_blk)
    safe = new.masked_fill(new == NEG_INF, 0.0)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(o_blk * torch.exp(lse_blk - safe).unsqueeze(-1))
    lse.copy_(new)


def backward_part(
    q5: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    do5: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    """FlashAttention-2 backward of one part from the final lse (b, nkv, g, cq) and delta = rowsum(dO * O):
    (dq (b, nkv, g, cq, hd), dk (b, nkv, ck, hd), dv (b, nkv, ck, hd)), fp32. Every query sees at least itself,
    so the final lse is finite."""
    p = torch.exp(_scores(q5, k4, mask, scale) - lse.unsqueeze(-1))  # (b, nkv, g, cq, ck)
    dv = torch.matmul(p.transpose(-1, -2), do5).sum(2)
    ds = p * (torch.matmul(do5, v4.unsqueeze(2).transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k4.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2) * scale
    return dq, dk, dv
