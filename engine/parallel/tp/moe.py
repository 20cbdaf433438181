"""Tensor parallelism for the mixture-of-experts block and OLMoE's q/k norms (issue 26), as Megatron-core runs MoE
with expert-tensor-parallel size = tp (Shoeybi et al. 2019, Sec. 3, applied to each expert's SwiGLU).

- **Experts are tp-sharded**: each expert's gate and up rows split over tp like the dense MLP's column-parallel
  gate_up, its down columns like the row-parallel down_proj. The stacked gate_up_proj (E, 2 ffn, h) becomes
  (E, 2 ffn/tp, h) holding [gate_r; up_r] of each expert, down_proj (E, h, ffn) becomes (E, h, ffn/tp). Expert
  parallelism (engine/parallel/ep/) then keeps a slice of dim 0 of those: tp first, ep second, both on the meta
  model. ``tp_dims`` of the experts names the split dim of each per-expert Hugging Face tensor ``hf_blocks`` gives
  (gate/up (ffn, h): 0; down (h, ffn): 1), the terms initialisation and checkpoints cut in.
- The expert input copies (N, h) pass ``copy_to_parallel`` (identity forward, all-reduce backward: each rank's
  input gradient covers only its ffn/tp), and the expert outputs (N, h), partial sums over the ffn shards, are
  all-reduced BEFORE the gate weights multiply them, so the router's gradient through the weights sees the whole
  outputs and is complete and equal on every tp rank, like every other replicated weight (no extra sync).
- **Router** and the shared expert's sigmoid gate: replicated. **Qwen2-MoE's shared expert** (a dense SwiGLU) is
  split column/row like the dense MLP, with its own row-parallel all-reduce (engine/parallel/tp/layers.py): the layers
  and the checkpoint names are the dense ones unchanged; folding its partial output into the experts' all-reduce
  would save one (T, h) all-reduce per layer but needs the block's forward rebuilt around it.
- **Sequence parallelism**: the block's input is (b, s/tp, h). It is gathered over tp at the entry and every rank
  routes the whole sequence, so routing and the aux/z-loss statistics are tp = 1's exactly; this rank's s/tp slice is
  given back at the exit (backward: all-gather). Inside, every gradient is complete and equal on every tp rank, so
  the entry's backward keeps this rank's chunk (a reduce-scatter would sum tp equal copies).
- **OLMoE's q/k norms** normalise the whole projection (nh hd), of which a rank holds nh/tp heads: the sum of
  squares is all-reduced over tp (forward and backward, ``all_reduce_sum``); the weight is split like q/k.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.model.moe import MoE
from engine.model.transformer import Attention, RMSNorm
from engine.parallel.autograd.comm import (
    all_reduce_sum,
    copy_to_parallel,
    gather_sequence_for_replicated,
    reduce_from_parallel,
    split_sequence,
)


class TensorParallelMoE(MoE):
    """The MoE block with tp-sharded experts (module docstring). ``tp_group``, ``sequence_parallel``: set by
    ``shard_moe``."""

    tp_group = None
    sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return super().forward(x)
        whole = gather_sequence_for_replicated(x, self.tp_group)  # (b, s/tp, h) -> (b, s, h)
        return split_sequence(super().forward(whole), self.tp_group)  # (b, s, h) -> (b, s/tp, h)

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        partial = self.experts(copy_to_parallel(x, self.tp_group), counts)  # (N, h): this rank's ffn/tp only
        return reduce_from_parallel(partial, self.tp_group)  # (N, h) whole, before the gate weights


def shard_moe(block: MoE, group, sequence_parallel: bool) -> None:
    """Split ``block``'s experts over tp (on the meta device) and make it a ``TensorParallelMoE``. The shared expert
    is split by engine/parallel/tp/layers.py with the dense layers."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    experts = block.experts
    e, rows, h = experts.gate_up_proj.shape  # (E, 2 ffn, h)
    ffn = rows // 2
    if ffn % size:
        raise ValueError(f"the expert width {ffn} is not divisible by the tensor-parallel size {size}")
    with torch.device(experts.gate_up_proj.device):
        experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * ffn // size, h))  # [gate_r; up_r] per expert
        experts.down_proj = nn.Parameter(torch.empty(e, h, ffn // size))
    experts.tp_rank, experts.tp_size = rank, size
    experts.tp_dims = {"gate_up_proj": 0, "down_proj": 1}  # of each per-expert HF tensor (hf_blocks)
    block.__class__ = TensorParallelMoE
    block.tp_group, block.sequence_parallel = group, sequence_parallel


class TensorParallelProjectionNorm(RMSNorm):
    """RMSNorm over a whole projection (OLMoE's q_norm over nh hd) of which this rank holds 1/tp (b, s, nh hd/tp):
    y = x / sqrt(sum over tp of sum(x^2) / (nh hd) + eps) * w_r, as engine/model/transformer.py rms_norm in fp32."""

    def __init__(self, dim: int, eps: float, group):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if dim % size:
            raise ValueError(f"the q/k norm width {dim} is not divisible by the tensor-parallel size {size}")
        super().__init__(dim // size, eps)
        self.group, self.full_dim, self.tp_rank, self.tp_size = group, dim, rank, size
        self.tp_dims = {"weight": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        squares = all_reduce_sum(x.pow(2).sum(-1, keepdim=True), self.group)  # (b, s, 1) over the whole projection
        x = x * torch.rsqrt(squares / self.full_dim + self.eps)
        return self.weight * x.to(dtype)


def shard_qk_norms(attn: Attention, group) -> None:
    """Replace OLMoE's whole-projection q/k norms of ``attn`` (meta device) by their tp-split versions."""
    for name in ("q_norm", "k_norm"):
        old = getattr(attn, name)
        with torch.device(old.weight.device):
            setattr(attn, name, TensorParallelProjectionNorm(old.weight.shape[0], old.eps, group))
