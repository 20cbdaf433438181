"""All-to-all context parallelism (DeepSpeed Ulysses: Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations
for Enabling Training of Extreme Long Sequence Transformer Models", Sec. 3).

Each cp rank holds L = s/cp tokens (the head/tail split, engine/parallel/cp/layout.py) of every local head. Around
attention an all-to-all over the cp group trades the sequence split for a head split: q/k/v (b, H, L, hd) ->
(b, H/cp, s, hd), every token of H/cp heads, so attention itself is the one-process computation (causal, or the
whole-sequence document mask) on whole heads; a second all-to-all brings the output back to (b, H, L, hd). The
backward of each all-to-all is the other one (an all-to-all is a permutation of blocks: its transpose is its
inverse). H = heads / tp, so num_heads and num_kv_heads must divide by cp tp (engine/parallel/layout/checks.py).
Per layer 4 all-to-alls forward (q, k, v, o) and 4 backward, each moving (cp-1)/cp of its tensor; every cp rank
issues them in the same order (NCCL's rule).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.model.attention import AttentionCore, attend
from engine.parallel.cp import layout


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """x (cp, ...) contiguous: block j goes to cp rank j; returns (cp, ...) whose block j came from rank j."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(b, H, L, hd), this rank's L tokens of H heads -> (b, H/cp, cp L, hd): head group r (this rank's index r)
    of every rank's tokens, rank 0's L first (gathered order)."""
    b, heads, length, hd = x.shape
    blocks = x.reshape(b, cp, heads // cp, length, hd).transpose(0, 1).contiguous()  # (cp, b, H/cp, L, hd)
    got = _exchange(blocks, group)  # (cp, b, H/cp, L, hd): block j = rank j's tokens of my head group
    return got.permute(1, 2, 0, 3, 4).reshape(b, heads // cp, cp * length, hd)


def heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: (b, H/cp, cp L, hd) in gathered order -> (b, H, L, hd)."""
    b, part, s, hd = x.shape
    blocks = x.reshape(b, part, cp, s // cp, hd).permute(2, 0, 1, 3, 4).contiguous()  # (cp, b, H/cp, L, hd)
    got = _exchange(blocks, group)  # block j = my tokens of head group j
    return got.transpose(0, 1).reshape(b, cp * part, s // cp, hd)


class _Relayout(torch.autograd.Function):
    """seq_to_heads (``to_heads``) or heads_to_seq forward; the gradient goes back by the other, the inverse
    permutation."""

    @staticmethod
    def forward(ctx, x, to_heads: bool, cp, group):
        ctx.to_heads, ctx.cp, ctx.group = to_heads, cp, group
        return (seq_to_heads if to_heads else heads_to_seq)(x, cp, group)

    @staticmethod
    def backward(ctx, grad):
        return (heads_to_seq if ctx.to_heads else seq_to_heads)(grad, ctx.cp, ctx.group), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, cp: int, group) -> torch.Tensor:
    """q (b, nh, L, hd), k/v (b, nkv, L, hd): this cp rank's L = s/cp tokens in layout order; mask None (causal)
    or the whole sequence's (b, 1, s, s) -> (b, nh, L, hd)."""
    seq_len = q.shape[2] * cp
    q, k, v = (layout.to_natural_order(_Relayout.apply(t, True, cp, group), seq_len, cp, dim=2) for t in (q, k, v))
    o = attend(q, k, v, mask)  # (b, nh/cp, s, hd): whole heads, the one-process attention
    return _Relayout.apply(layout.to_gathered_order(o, seq_len, cp, dim=2), False, cp, group)


class UlyssesCore(AttentionCore):
    """The attention core (engine/model/attention.py) of cp_mode all_to_all: the mask is the default's, built from
    the whole sequence's document ids (the trainer passes them whole), in token order as attention sees it."""

    def __init__(self, group, cp: int):
        self.group, self.cp = group, cp

    def __call__(self, q, k, v, mask):
        return ulysses_attention(q, k, v, mask, self.cp, self.group)
