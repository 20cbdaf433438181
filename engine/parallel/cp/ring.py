"""Ring attention over the context-parallel group (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"; the load-balanced causal form of Megatron-Core's context parallelism and Llama 3, Dubey et al.
2024, Sec. 3.3.2).

Each cp rank holds L = s / cp tokens of the sequence (its two layout chunks, engine/parallel/cp/layout.py) of q, k
and v. Forward: the K/V blocks rotate around the ring for cp steps (step t: rank r holds the block of rank (r - t)
mod cp, so its global token indices are known without sending them); each step attends this rank's queries to the
block under the mask of global indices, skipping the parts it fully masks, and merges by the online softmax
(ring_block.py; which parts and how: ring_plan.py). Backward rotates K/V again with their dK/dV accumulators
travelling beside them: after cp steps and one last hop every accumulator is back at the rank that owns those keys.

Communication follows NCCL's point-to-point rules (tests/nccl_shim.py checks them): every step is ONE
``batch_isend_irecv`` holding the step's sends to the next rank and receives from the previous one, in the same
order on every rank (K/V, then dK/dV), posted before the step's compute so the transfer overlaps it, and every
returned Work is waited on; every rank of the group takes part in every batch (under NCCL torch requires it of a
group's first). Peers are the cp group's global ranks. K/V travel as one (2, b, nkv, L, hd) buffer in
their own dtype with the nkv heads only (grouped-query attention is never repeated for the wire); dK/dV travel in
fp32, and the output, lse and gradients accumulate in fp32 whatever the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.parallel.cp import ring_block as rb
from engine.parallel.cp import ring_fused as rf
from engine.parallel.cp.ring_plan import MASKED, Plan, plan

KERNELS = ("auto", "math")  # auto: the fused kernel where it applies (ring_fused.py), else math; math: always math


def _ring(group) -> tuple[int, int, int, int]:
    """(cp, this rank's cp index, global rank of the next cp rank, of the previous one). group None: cp = 1."""
    if group is None or dist.get_world_size(group) == 1:
        return 1, 0, 0, 0
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    return cp, r, dist.get_global_rank(group, (r + 1) % cp), dist.get_global_rank(group, (r - 1) % cp)


def _exchange(sends: list[torch.Tensor], recvs: list[torch.Tensor], nxt: int, prv: int, group) -> list:
    """One batch: every send to the next rank, then every receive from the previous one, in list order (the same
    on every rank, so the per-pair message order matches). Returns the Works (NCCL: one for the whole batch)."""
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for w in works:
        w.wait()


@dataclass
class _Queries:
    """This rank's side of every part: q (b, nh, L, hd) in its dtype and q5 (b, nkv, g, L, hd) fp32; backward adds
    do / do5 (the same shapes), o (b, nh, L, hd) the output, lse (b, nkv, g, L) and delta = rowsum(dO * O)."""

    q: torch.Tensor
    q5: torch.Tensor
    scale: float
    do: torch.Tensor | None = None
    do5: torch.Tensor | None = None
    o: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    delta: torch.Tensor | None = None


def attend_part(
    side: _Queries, kv: torch.Tensor, qs: slice, ks: slice, mask: torch.Tensor | None, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One part's (o (b, nkv, g, cq, hd), lse (b, nkv, g, cq)) fp32, by the fused kernel or the math."""
    if kind == MASKED:
        return rb.forward_part(side.q5[..., qs, :], kv[0][:, :, ks].float(), kv[1][:, :, ks].float(), mask, side.scale)
    o, lse = rf.forward_part(side.q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], kind, side.scale)
    shape = side.q5[..., qs, :].shape
    return o.reshape(shape), lse.reshape(shape[:-1])


def grad_part(
    side: _Queries, kv: torch.Tensor, qs: slice, ks: slice, mask: torch.Tensor | None, kind: str
) -> tuple[torch.Tensor, ...]:
    """One part's (dq (b, nkv, g, cq, hd), dk, dv (b, nkv, ck, hd)) fp32, by the fused kernel or the math."""
    if kind == MASKED:
        return rb.backward_part(
            side.q5[..., qs, :],
            kv[0][:, :, ks].float(),
            kv[1][:, :, ks].float(),
            side.do5[..., qs, :],
            side.lse[..., qs],
            side.delta[..., qs],
            mask,
            side.scale,
        )
    b, nh = side.q.shape[:2]
    dq, dk, dv = rf.backward_part(
        side.do[:, :, qs],
        side.q[:, :, qs],
        kv[0][:, :, ks],
        kv[1][:, :, ks],
        side.o[:, :, qs],
        side.lse.reshape(b, nh, -1)[..., qs],
        kind,
        side.scale,
    )
    return dq.reshape(side.q5[..., qs, :].shape), dk, dv


class _RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(hd) + M) v for this rank's queries against every rank's keys, M causal (and document)
    by global token index."""

    @staticmethod
    def forward(ctx, q, k, v, group, indices, doc_ids, kernel):
        cp, r, nxt, prv = _ring(group)
        if indices.shape[0] != cp:
            raise ValueError(f"ring_attention: indices for {indices.shape[0]} cp ranks, but the cp group has {cp}")
        b, nh, L, hd = q.shape
        nkv = k.shape[1]
        q5 = q.reshape(b, nkv, nh // nkv, L, hd).float()
        side = _Queries(q, q5, 1.0 / math.sqrt(hd))
        parts = plan(indices, doc_ids, r, rf.fused_kinds(q.device) if kernel == "auto" else ())
        kv = torch.stack((k, v))  # (2, b, nkv, L, hd): the wire buffer, in the input dtype
        out = torch.zeros(q5.shape, dtype=torch.float32, device=q.device)  # (b, nkv, g, L, hd)
        lse = torch.full(q5.shape[:-1], rb.NEG_INF, dtype=torch.float32, device=q.device)  # (b, nkv, g, L)
        for t in range(cp):  # step t: this rank holds the K/V of rank (r - t) mod cp
            incoming = torch.empty_like(kv) if t < cp - 1 else None
            works = _exchange([kv], [incoming], nxt, prv, group) if incoming is not None else []
            for qs, ks, kind in parts.steps[t]:
                mask = parts.mask(t, qs, ks, q.device) if kind == MASKED else None
                o_blk, lse_blk = attend_part(side, kv, qs, ks, mask, kind)
                rb.merge(out[..., qs, :], lse[..., qs], o_blk, lse_blk)
            _wait(works)
            kv = incoming
        o = out.reshape(b, nh, L, hd).to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.plan = group, parts
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(grad, q, k, v, o, lse, ctx.plan, ctx.group)
        return dq, dk, dv, None, None, None, None


def _ring_backward(grad, q, k, v, o, lse, parts: Plan, group) -> tuple[torch.Tensor, ...]:
    """dq for this rank's queries and dk/dv for this rank's keys. Step t: K/V of rank src = (r - t) mod cp arrive
    (sent at step t-1, as in forward) with that rank's dK/dV accumulator (2, b, nkv, L, hd) fp32, which the
    previous rank finished at its step t-1; this rank adds its part and passes it on at step t+1. After step cp-1
    the accumulator this rank holds belongs to rank r+1: one last hop hands it to its owner."""
    cp, r, nxt, prv = _ring(group)
    b, nh, L, hd = q.shape
    nkv = k.shape[1]
    shape5 = (b, nkv, nh // nkv, L, hd)
    grad = grad.to(q.dtype)
    q5, do5 = q.reshape(shape5).float(), grad.reshape(shape5).float()
    delta = (do5 * o.reshape(shape5).float()).sum(-1)  # D = rowsum(dO * O): (b, nkv, g, L)
    side = _Queries(q, q5, 1.0 / math.sqrt(hd), grad, do5, o, lse, delta)
    dq = torch.zeros(shape5, dtype=torch.float32, device=q.device)
    kv, done = torch.stack((k, v)), None  # done: the accumulator finished at the previous step, to pass on
    for t in range(cp):
        sends, recvs = [], []
        incoming = torch.empty_like(kv) if t < cp - 1 else None
        arriving = torch.empty_like(done) if done is not None else None
        if incoming is not None:
            sends, recvs = [kv], [incoming]
        if arriving is not None:
            sends, recvs = sends + [done], recvs + [arriving]
        works = _exchange(sends, recvs, nxt, prv, group)
        acc = torch.zeros((2, b, nkv, L, hd), dtype=torch.float32, device=q.device)  # dK, dV of the keys held at step t
        for qs, ks, kind in parts.steps[t]:
            mask = parts.mask(t, qs, ks, q.device) if kind == MASKED else None
            dq_p, dk_p, dv_p = grad_part(side, kv, qs, ks, mask, kind)
            dq[..., qs, :] += dq_p
            acc[0][:, :, ks] += dk_p
            acc[1][:, :, ks] += dv_p
        _wait(works)
        done = acc if arriving is None else acc.add_(arriving)
        kv = incoming
    if cp > 1:
        mine = torch.empty_like(done)
        _wait(_exchange([done], [mine], nxt, prv, group))
        done = mine
    return dq.reshape(b, nh, L, hd).to(q.dtype), done[0].to(k.dtype), done[1].to(v.dtype)


@torch.compiler.disable
def _ring_eager(q, k, v, group, indices, doc_ids, kernel) -> torch.Tensor:
    # Eager even inside a torch.compile'd block (engine/model/compile.py), which breaks its graph here: traced, the
    # point-to-point batches and the host-side plan (its .cpu() and bool() per part) are graph breaks inside an
    # autograd.Function, and the compiler would reach into the communication layer.
    return _RingAttention.apply(q, k, v, group, indices, doc_ids, kernel)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    indices: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Causal (or document-masked) attention of this cp rank's tokens against the whole sequence, by ring.

    q (b, nh, L, hd), k and v (b, nkv, L, hd) with nh % nkv == 0: this rank's L = s / cp tokens in layout order;
    group: the cp process group (None or size 1: plain local attention, no communication); indices (cp, L) int64:
    ``layout.all_chunk_indices(s, cp)``, the global token index of every rank's tokens; doc_ids None (causal) or
    (b, s) int64, the document of every token of the whole sequence (query i attends key j iff j <= i and both are
    in one document); kernel "auto" (the fused per-part kernel where it applies, ring_fused.py) or "math" (always the
    explicit per-part math, ring_block.py). Returns o (b, nh, L, hd) in q's dtype: full attention's rows for this
    rank's tokens."""
    b, nh, L, hd = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (L, hd) or nh % k.shape[1]:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expected "
            f"q (b, nh, L, hd) and k, v (b, nkv, L, hd) with nh divisible by nkv"
        )
    if indices.dim() != 2 or indices.shape[1] != L:
        raise ValueError(
            f"ring_attention: indices {tuple(indices.shape)}; expected (cp, {L}) from layout.all_chunk_indices"
        )
    if kernel not in KERNELS:
        raise ValueError(f"ring_attention: kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    return _ring_eager(q, k, v, group, indices, doc_ids, kernel)
