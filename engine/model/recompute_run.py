"""The checkpointed forward of one decoder block under ``train.activation_checkpointing`` (the modes and what they
keep: engine/model/recompute.py): full recomputes the whole block, selective keeps the GEMM outputs and recomputes
the rest (torch.utils.checkpoint with a create_selective_checkpoint_contexts policy, as torchtitan does)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from engine.kinds.recompute import RECOMPUTE

aten = torch.ops.aten
# Outputs kept under selective: the GEMMs (F.linear lowers to mm on 2-D views, addmm with a bias), and operators
# registered by ``save_under_selective``.
SAVED_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


def save_under_selective(op) -> None:
    """Keep ``op``'s output under selective recomputation: an operator that ends in a GEMM's output made smaller (the
    sequence-parallel row-parallel linear, engine/parallel/autograd/comm.py sequence_reduced_linear: its (b, s/tp, h)
    shard, not the (b, s, h) partial sums) and whose body recomputation should then skip."""
    SAVED_OPS.add(op)


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def run_block(block: nn.Module, mode: str, *args) -> torch.Tensor:
    """``block._block(*args)`` with the recomputation ``mode`` in force while gradients are recorded: what its
    RecomputeSpec (engine/kinds/recompute.py) says it keeps, the block's input or also the matmul outputs."""
    spec = RECOMPUTE[mode]
    if not spec.recomputes or not torch.is_grad_enabled():
        return block._block(*args)
    if not spec.keeps_matmul_outputs:
        return checkpoint(block._block, *args, use_reentrant=False)
    return checkpoint(block._block, *args, use_reentrant=False, context_fn=_selective_context)
