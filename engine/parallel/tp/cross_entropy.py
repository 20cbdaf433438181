"""Memory-lean cross-entropy on vocab-sharded logits (Megatron-LM's vocab_parallel_cross_entropy, chunked).

loss_i = log(sum_v exp(z_iv - m_i)) + m_i - z_i,target with m_i the max over the whole vocabulary: three
all-reduces of (n,) values (max, target logit, sum of exps) replace a gather of the (n, V) logits (Shoeybi et al.
2019, Sec. 3). Gradient: dL/dz_iv = softmax_iv - onehot_iv(target) = exp(z_iv - lse_i) - onehot.

Memory: the whole local logits are never copied to fp32. The forward walks over chunks of tokens, each cast to
fp32 on its own, and saves only the logits themselves (in their own dtype: autograd would keep them alive for the
loss anyway) plus lse_i = m_i + log(sum exp) per token, fp32 (n,). The backward recomputes each chunk's softmax
from the logits and lse and writes the gradient, in the logits' dtype, into one (n, V/tp) buffer. Peak beyond the
logits: that gradient and a few fp32 (chunk, V/tp) temporaries, instead of fp32 copies of the whole logits (the
cast, the softmax and its gradient). With tp = 1 the same code runs without collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package

# fp32 values per temporary of one chunk: tokens per chunk = CHUNK_ELEMENTS // (V/tp), at least 1. 2^24 values
# are 64 MiB per fp32 temporary; the forward and backward each hold about three of them at once.
CHUNK_ELEMENTS = 2**24


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        with oplog.logged("all-reduce", group, "loss", x.numel() * x.element_size()):
            dist.all_reduce(x, op=op, group=group)
    return x


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token loss (n,) of logits (n, V/tp) in any dtype against targets (n,) (all valid ids; the caller masks
    ignored ones), computed in fp32 chunks of ``chunk`` tokens."""

    @staticmethod
    def forward(ctx, logits, target, group, chunk: int):
        n, local_v = logits.shape
        if group is None or dist.get_world_size(group) == 1:
            return _forward_whole_vocab(ctx, logits, target, chunk)
        rank = dist.get_rank(group)
        start = rank * local_v
        outside = (target < start) | (target >= start + local_v)  # (n,): the target's logit is on another rank
        local_target = (target - start).masked_fill(outside, 0)
        vmax = torch.empty(n, device=logits.device, dtype=torch.float32)
        for lo in range(0, n, chunk):
            vmax[lo : lo + chunk] = logits[lo : lo + chunk].max(dim=-1).values.float()
        _all_reduce(vmax, group, dist.ReduceOp.MAX)
        # The target logit is read straight from the logits: (n,), zero where another rank holds it.
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float().masked_fill(outside, 0.0)
        _all_reduce(target_logit, group)
        sum_exp = torch.empty_like(vmax)
        for lo in range(0, n, chunk):
            shifted = logits[lo : lo + chunk].float() - vmax[lo : lo + chunk].unsqueeze(-1)  # (chunk, V/tp) fp32
            sum_exp[lo : lo + chunk] = shifted.exp_().sum(dim=-1)
        _all_reduce(sum_exp, group)
        lse = sum_exp.log_().add_(vmax)  # (n,) log-sum-exp over the whole vocabulary
        ctx.chunk = chunk
        ctx.save_for_backward(logits, lse, local_target, outside)
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local_target, outside = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (n, V/tp) in the logits' dtype
        inside = (~outside).float()
        in_place = logits.dtype == torch.float32  # the softmax is computed in the gradient's own rows
        for lo in range(0, logits.shape[0], ctx.chunk):
            hi = min(lo + ctx.chunk, logits.shape[0])
            # never in the logits: .float() of fp32 logits is the saved tensor itself
            out = grad[lo:hi] if in_place else None
            g = torch.sub(logits[lo:hi].float(), lse[lo:hi].unsqueeze(-1), out=out).exp_()  # softmax, fp32
            rows = torch.arange(hi - lo, device=g.device)
            g[rows, local_target[lo:hi]] -= inside[lo:hi]
            g.mul_(grad_loss[lo:hi].unsqueeze(-1))
            if not in_place:
                grad[lo:hi] = g
        return grad, None, None, None


def _forward_whole_vocab(ctx, logits, target, chunk: int) -> torch.Tensor:
    """ChunkedCrossEntropy.forward at tp = 1 (the rank holds the whole vocabulary): one fused log-sum-exp per chunk
    (faster than F.cross_entropy's log-softmax and its backward: launch/bench/loss.py) instead of the max, exp and
    sum passes the tp > 1 path needs between its all-reduces; saves the same logits and lse for the same backward."""
    lse = torch.empty(logits.shape[0], device=logits.device)
    for lo in range(0, logits.shape[0], chunk):
        lse[lo : lo + chunk] = torch.logsumexp(logits[lo : lo + chunk].float(), dim=-1)
    ctx.chunk = chunk
    ctx.save_for_backward(logits, lse, target, torch.zeros_like(target, dtype=torch.bool))
    return lse - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1).float()


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group, ignore_index: int = -100, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """Mean next-token loss over the tokens whose target is not ``ignore_index`` (as F.cross_entropy).
    logits (b, s, V/tp) in any dtype (reduced in fp32), target (b, s); group None or of size 1: no collectives."""
    flat_logits, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    valid = flat_target != ignore_index  # (n,)
    chunk = max(1, chunk_elements // flat_logits.shape[-1])
    per_token = ChunkedCrossEntropy.apply(flat_logits, flat_target.masked_fill(~valid, 0), group, chunk)
    return (per_token * valid).sum() / valid.sum()
