"""Data parallelism over the dp axis of the mesh: gradient all-reduce (ddp) or FSDP2 sharding (fsdp).

- ``ddp``: ``allreduce_gradients`` averages every gradient across dp replicas once per global batch (after the
  last micro-batch), through one flat buffer per dtype so that a step issues few collectives. gloo has no AVG op,
  so it is a SUM followed by a division.
- ``fsdp``: torch FSDP2 ``fully_shard`` on each decoder layer, then the root (as torchtitan's apply_fsdp), over
  the dp sub-mesh (Rajbhandari et al. 2020, "ZeRO"; Zhao et al. 2023, "PyTorch FSDP"). Parameters, gradients and
  optimizer state are sharded over dp; ``reshard_after_forward=True`` frees the gathered weights after each
  forward (ZeRO-3), ``False`` keeps them to the backward (ZeRO-2-like: one all-gather per step instead of two).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from engine.optim import unique_params


@torch.no_grad()
def allreduce_gradients(model: nn.Module, dp_group) -> None:
    """grad <- mean over dp ranks of grad, for every parameter that has one."""
    size = dist.get_world_size(dp_group)
    if size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for _, _, p in unique_params(model):
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)  # (sum of numels,)
        dist.all_reduce(flat, group=dp_group)
        flat.div_(size)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def apply_fsdp(model: nn.Module, dp_mesh, reshard_after_forward: bool, bf16: bool) -> nn.Module:
    """Shard the (materialised, identically initialised) stage over ``dp_mesh``, one FSDP unit per decoder layer.
    With ``bf16`` the gathered weights are bf16 and gradients are reduced in fp32 (MixedPrecisionPolicy)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    # The root unit holds the embedding, final norm and LM head; it is needed again right after forward (the
    # backward starts there), so it is never resharded after forward.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    return model
