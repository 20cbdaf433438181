"""Autograd-aware collectives for tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", Sec. 3, Fig. 3).

Each function is named for what it does forward / backward and takes the process group it acts on. A group of
size one makes every collective an identity, so the tp=1 model runs no communication at all.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of the last dim: (..., n) -> (..., n/tp)."""
    size = _size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's chunk along the last dim: (..., n/tp) -> (..., n)."""
    size = _size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToParallel(torch.autograd.Function):
    """Identity forward, all-reduce backward: Megatron's ``f``, in front of a column-parallel layer."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """All-reduce forward, identity backward: Megatron's ``g``, after a row-parallel layer."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    """All-gather the last dim forward, keep this rank's chunk backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToParallel(torch.autograd.Function):
    """Keep this rank's chunk of the last dim forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def copy_to_parallel(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceFromParallel.apply(x, group)


def gather_from_parallel(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherFromParallel.apply(x, group)


def scatter_to_parallel(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ScatterToParallel.apply(x, group)
