"""Data-parallel gradient synchronisation over the dp group.

``allreduce_gradients`` averages every gradient across dp replicas once per global batch (after the last
micro-batch), through one flat buffer per dtype so that a step issues few collectives. gloo has no AVG op, so it
is a SUM followed by a division.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

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
