"""Token dispatch and combine for expert parallelism (GShard, Lepikhin et al. 2020; Megatron-core's all-to-all
token dispatcher): each rank routes its tokens, sends every token copy to the ep rank holding its expert, the
experts run on what arrives, and the outputs go back by the reverse exchange.

The all-to-all has variable split sizes (how many copies a rank sends to each peer depends on routing), so the
per-expert counts are exchanged first (one small all-to-all of (ep, E_local) integers) and then the copies
(``all_to_all_single`` with input/output split sizes). Every rank of the ep group runs the same MoE layers in the
same order (same schedule, same micro-batches), so the collectives are issued in the same order on every rank, as
NCCL needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.model.moe import Experts, _grouped_mm_applies


class AllToAll(torch.autograd.Function):
    """Rows of x (N, h) cut into ``in_splits`` (one count per rank of ``group``) are sent, rank r's part to rank r;
    returns (sum(out_splits), h), the part from rank r at block r. Backward is the reverse exchange: the gradient
    of the output, cut by ``out_splits``, goes back where those rows came from (the splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallelExperts(Experts):
    """This rank's E / ep experts (a slice of dim 0 of the stacked weights, ``first_expert`` its global index),
    given the copies of this rank's tokens for all E experts and sending back their outputs.

    ``ep_group``, ``ep_size`` are set by engine/parallel/ep/__init__.py (apply_expert_parallel)."""

    ep_group = None
    ep_size = 1

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, h): this rank's token copies sorted by global expert, counts (E,) -> their outputs (N, h)."""
        local = self.gate_up_proj.shape[0]
        send = counts.reshape(self.ep_size, local).contiguous()  # (ep, E_local): copies for each rank's experts
        recv = torch.empty_like(send)  # recv[r, e]: copies rank r sends to this rank's expert e
        dist.all_to_all_single(recv, send, group=self.ep_group)
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = AllToAll.apply(x, recv_splits, send_splits, self.ep_group)  # (M, h): by source rank, then expert
        # regroup by local expert (stable: within an expert, by source rank, then the source's token order)
        expert_of = torch.repeat_interleave(
            torch.arange(local, device=recv.device).repeat(self.ep_size), recv.reshape(-1)
        )  # (M,)
        order = torch.sort(expert_of, stable=True).indices
        mine = arrived[order]
        # (M, h) in expert order. No copy arrived: the (0, h) input itself in the dtype the experts would give, so
        # that backward still runs both all-to-alls here (the loop's empty output has no graph) and every rank
        # sends one dtype
        y = super().forward(mine, recv.sum(0)) if mine.shape[0] else mine.to(self._out_dtype(mine))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return AllToAll.apply(y[back], send_splits, recv_splits, self.ep_group)  # (N, h) in x's order

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        """What Experts.forward returns: the autocast dtype from the loop's linears, x's from the grouped GEMM."""
        device = x.device.type
        if torch.is_autocast_enabled(device) and not _grouped_mm_applies(x, self.gate_up_proj):
            return torch.get_autocast_dtype(device)
        return x.dtype
