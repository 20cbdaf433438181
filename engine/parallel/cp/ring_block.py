"""One block of ring attention: which parts of a (query tokens, key tokens) block the mask leaves anything in, and
the exact attention of those parts, forward with its log-sum-exp and backward from the final log-sum-exp.

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


def part_mask(q_idx: torch.Tensor, k_idx: torch.Tensor, q_doc: torch.Tensor | None,
              k_doc: torch.Tensor | None) -> torch.Tensor:
    """q_idx (cq,), k_idx (ck,) global token indices, q_doc (b, cq) / k_doc (b, ck) their documents or None ->
    (b or 1, 1, 1, cq, ck) bool, True: attend (query i sees key j iff j <= i, and both are in one document)."""
    mask = k_idx.unsqueeze(0) <= q_idx.unsqueeze(1)  # (cq, ck)
    if q_doc is not None:
        return (mask & (q_doc.unsqueeze(2) == k_doc.unsqueeze(1)))[:, None, None]  # (b, 1, 1, cq, ck)
    return mask[None, None, None]


def block_parts(q_idx: torch.Tensor, k_idx: torch.Tensor, q_doc: torch.Tensor | None,
                k_doc: torch.Tensor | None) -> list[tuple[slice, slice, torch.Tensor]]:
    """The parts of one block that the mask leaves anything in, as (query slice, key slice, ``part_mask``).

    q_idx, k_idx (L,) int64: global token index of the block's query / key tokens (engine/parallel/cp/layout.py);
    q_doc, k_doc (b, L) document index of those tokens, or None (plain causal). A rank's L tokens are its two
    layout chunks, so each side is cut in two halves: under the head/tail split a key chunk lying wholly after a
    query chunk makes its part fully masked, and it is skipped (half of every off-diagonal block under causal
    attention)."""
    halves = 2 if len(q_idx) % 2 == 0 and len(k_idx) % 2 == 0 else 1
    cq, ck = len(q_idx) // halves, len(k_idx) // halves
    parts = []
    for a in range(halves):
        qs = slice(a * cq, (a + 1) * cq)
        for c in range(halves):
            ks = slice(c * ck, (c + 1) * ck)
            mask = part_mask(q_idx[qs], k_idx[ks], None if q_doc is None else q_doc[:, qs],
                             None if k_doc is None else k_doc[:, ks])
            if bool(mask.any()):
                parts.append((qs, ks, mask))
    return parts


def _scores(q5: torch.Tensor, k4: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q5 (b, nkv, g, cq, hd), k4 (b, nkv, ck, hd) fp32 -> S (b, nkv, g, cq, ck), -inf where masked."""
    s = torch.matmul(q5, k4.unsqueeze(2).transpose(-1, -2)) * scale
    return s.masked_fill(~mask, NEG_INF)


def forward_part(q5: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
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


def backward_part(q5: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, do5: torch.Tensor, lse: torch.Tensor,
                  delta: torch.Tensor, mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """FlashAttention-2 backward of one part from the final lse (b, nkv, g, cq) and delta = rowsum(dO * O):
    (dq (b, nkv, g, cq, hd), dk (b, nkv, ck, hd), dv (b, nkv, ck, hd)), fp32. Every query sees at least itself,
    so the final lse is finite."""
    p = torch.exp(_scores(q5, k4, mask, scale) - lse.unsqueeze(-1))  # (b, nkv, g, cq, ck)
    dv = torch.matmul(p.transpose(-1, -2), do5).sum(2)
    ds = p * (torch.matmul(do5, v4.unsqueeze(2).transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k4.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2) * scale
    return dq, dk, dv
