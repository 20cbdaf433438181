"""AdamW with decoupled weight decay (Loshchilov & Hutter 2019), warmup + cosine LR, global grad-norm clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package
from engine.config import TrainConfig
from engine.model.shards import local as _local
from engine.model.shards import tp_dim


def unique_params(model: nn.Module):
    """(module, attr, param) for each distinct trainable parameter; a tied weight is yielded once."""
    seen: set[int] = set()
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                yield module, attr, p


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Two groups, as nanoGPT/Megatron: matrices (and embeddings) decay, norm weights and biases do not."""
    decay, no_decay = [], []
    for _, _, p in unique_params(model):
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, **adamw_implementation(decay + no_decay)
    )


def adamw_implementation(params: list) -> dict:
    """The fastest AdamW torch offers for these parameters: ``fused=True`` (one kernel a tensor, reading each
    parameter, gradient and moment once, no temporaries) where they all sit on one device type torch has fused
    kernels for (CUDA, and CPU since torch 2.4: 3-4x faster than foreach there on the tiny model), else
    ``foreach=True`` (multi-tensor ops, a temporary per parameter; torch's CPU default is the per-tensor loop). All
    do the same arithmetic up to rounding (fused against the loop: an ulp), DTensor (FSDP2) parameters included.
    The planner prices the one chosen (engine/planning/dp.py ``step_buffers``, ``ADAMW``)."""
    kinds = {p.device.type for p in params}
    if len(kinds) == 1 and kinds <= {"cuda", "cpu"}:
        return {"fused": True}
    return {"foreach": True}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based): linear warmup to cfg.lr over warmup_steps, then cosine decay to
    lr * min_lr_ratio at cfg.steps (Loshchilov & Hutter 2017, without restarts). A pure function of the step, so
    a resumed run needs no scheduler state."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# Elements per pow().sum() on CPU: bounds its temporary (16 MiB in fp32) on a large embedding's gradient.
SQUARES_CHUNK = 2**22


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum_i ||t_i||^2 (fp32 scalar). CUDA: one multi-tensor norm (torch._foreach_norm: a kernel per few hundred
    tensors, where a pow and a sum per tensor launch hundreds of tiny kernels; its tree reduction is accurate in
    fp32). CPU: pow().sum() per tensor (per SQUARES_CHUNK elements), whose cascade sum is as accurate as fp64
    (measured 4e-8 relative on the tiny model's gradients, as the fp64 norm) at a quarter of its time: CPU's norm
    kernel accumulates in its output dtype without pairwise summation (1e-6 relative error in fp32 on 262k values),
    and its fp64 form converts every gradient to fp64 first."""
    if tensors[0].device.type != "cpu":
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)  # one scalar per tensor
        return torch.stack(norms).pow(2).sum()
    parts = [c.float().pow(2).sum() for t in tensors for c in t.reshape(-1).split(SQUARES_CHUNK)]
    return torch.stack(parts).sum()


def global_grad_norm(
    model: nn.Module,
    tp_rank: int,
    group,
    exclude: tuple = (),
    dp_group=None,
    device=None,
    experts: tuple = (),
    ep_group=None,
) -> torch.Tensor:
    """L2 norm of the whole model's gradient across tensor- and pipeline-parallel ranks.

    Sharded parameters (those a module lists in ``tp_dims``) contribute their local shard on every tp rank;
    replicated ones (norm weights) hold the same gradient on every tp rank and are counted once, on tp rank 0.
    ``group`` spans all ranks holding different parts of the model (tp x pp); dp replicas are not summed.
    ``exclude``: parameters counted elsewhere (the last stage's copy of a tied embedding).
    ``dp_group``: set when gradients are sharded over dp (FSDP); each rank then holds a different part.
    ``experts``: expert-parallel weights (engine/parallel/ep/), each ep rank holding other experts: their squares
    are summed over ``ep_group`` (then over tp x pp with the rest: tp-sharded experts count on every tp rank).
    ``device``: where the norm is reduced (the context's device: NCCL reduces only device tensors, and under FSDP's
    CPU offload the gradients are on the host); default the parameters' device.
    """
    sharded, replicated, expert = [], [], []
    skip, expert_ids = {id(p) for p in exclude}, {id(p) for p in experts}
    for module, attr, p in unique_params(model):
        if p.grad is None or id(p) in skip:
            continue
        if id(p) in expert_ids:  # tp-replicated: counted on tp rank 0; tp-sharded (tp/moe.py): on every rank
            if tp_rank == 0 or tp_dim(module, attr) is not None:
                expert.append(_local(p.grad).detach())
            continue
        is_sharded = tp_dim(module, attr) is not None
        (sharded if is_sharded else replicated).append(_local(p.grad).detach())
    device = device or next(model.parameters()).device
    total = torch.zeros((), device=device, dtype=torch.float32)
    if sharded:
        total = total + sum_of_squares(sharded).to(device)
    if replicated and tp_rank == 0:
        total = total + sum_of_squares(replicated).to(device)
    if ep_group is not None:  # every ep rank joins, with or without expert gradients
        spread = sum_of_squares(expert).to(device) if expert else torch.zeros_like(total)
        with oplog.logged("all-reduce", ep_group, "grad norm", 4):
            dist.all_reduce(spread, group=ep_group)
        total = total + spread
    for g in (group, dp_group):
        if g is not None and dist.get_world_size(g) > 1:
            with oplog.logged("all-reduce", g, "grad norm", 4):
                dist.all_reduce(total, group=g)
    return total.sqrt()


@torch.no_grad()
def clip_gradients(
    model: nn.Module,
    max_norm: float,
    tp_rank: int,
    group,
    exclude: tuple = (),
    dp_group=None,
    device=None,
    experts: tuple = (),
    ep_group=None,
) -> float:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_ does, but with
    the norm of the whole distributed model. Returns the norm before clipping; max_norm <= 0 only measures."""
    norm = global_grad_norm(model, tp_rank, group, exclude, dp_group, device, experts, ep_group)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [_local(p.grad) for _, _, p in unique_params(model) if p.grad is not None]
        if grads:  # one multi-tensor multiply (every gradient of a stage lives on the stage's device)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm.item()
