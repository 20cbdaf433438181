"""Expert parallelism (parallel.ep; issue 26): the experts of every MoE layer split over the ep ranks, ep consecutive
ranks of the data ranks dp x cp in dp-major order (engine/parallel/layout/mesh.py split_along), as Megatron's
expert-data-parallel layout carves ep from dp x cp.

Applied like tensor parallelism, after the stage split and before materialisation (engine/stage.py build_model):
each ep rank keeps experts [e E/ep, (e+1) E/ep) of the stacked (E, ...) weights, a slice of dim 0 with
``first_expert`` = e E/ep, so initialisation (engine/model/init.py) and checkpoints see the global per-expert HF
names, and its ``Experts`` becomes ``ExpertParallelExperts`` (engine/parallel/ep/dispatch.py: all-to-all dispatch
and combine). The router and everything else stay replicated over dp x cp.

Gradients: the loss is the mean over the dp x cp ranks of each rank's loss L_r (a cp rank's L_r is the mean over its
s/cp tokens of each row; engine/trainer.py mean_over_data), so the gradient of an expert weight is
(1/(dp cp)) sum_r dL_r/dW. Backward through the combine and dispatch already sums over the ep group the terms of the
ranks that sent it tokens; summing that over the expert-dp group (the dp cp / ep ranks holding the same experts) and
dividing by dp cp, the factor the dense gradients get, completes it (``reduce_expert_gradients`` under ddp; under
fsdp each MoE layer's experts are an FSDP unit over the expert-dp mesh whose reduce-scatter sums and divides by the
same, engine/parallel/dp/fsdp.py). The gradient norm counts each expert once: the squares of the expert gradients
are summed over the ep group (ddp; fsdp's dp x cp sum of its shards' squares already does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package
from engine.model.moe import Experts
from engine.parallel.ep.dispatch import ExpertParallelExperts


def apply_expert_parallel(model: nn.Module, ctx) -> None:
    """Keep this rank's slice of every MoE layer's experts (``model`` still on the meta device)."""
    ep = ctx.size("ep")
    if ep == 1:
        return
    rank = ctx.axis_rank("ep")
    for module in model.modules():
        if type(module) is not Experts:
            continue
        local = module.gate_up_proj.shape[0] // ep
        for attr in ("gate_up_proj", "down_proj"):
            full = getattr(module, attr)  # (E, rows, cols) on meta
            setattr(module, attr, nn.Parameter(full[rank * local : (rank + 1) * local].clone()))
        module.first_expert = rank * local
        module.__class__ = ExpertParallelExperts
        module.ep_group, module.ep_size = ctx.group("ep"), ep


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name relative to ``model``, parameter) of every expert-parallel weight: reduced over expert-dp, not dp."""
    return [
        (f"{name}.{attr}", p)
        for name, m in model.named_modules()
        if isinstance(m, ExpertParallelExperts)
        for attr, p in m.named_parameters(recurse=False)
    ]


def expert_grad_divisor(ctx) -> int:
    """What the expert gradients summed over expert-dp are divided by: dp x cp, the ranks the loss is averaged over
    and the dense gradients' divisor (module docstring); FSDP's expert units divide by it too (dp/fsdp.py)."""
    return ctx.grad_size


def reduce_expert_gradients(model: nn.Module, ctx) -> None:
    """Sum expert gradients over the expert-dp group and divide by dp x cp (module docstring). A rank whose experts got
    no token has no gradient: zeros, so every rank issues the same collectives."""
    params = [p for _, p in expert_parameters(model)]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # (sum of numels,)
    group = ctx.group("edp")
    if group is not None:
        with oplog.logged("all-reduce", group, "grad sync", flat.numel() * flat.element_size()):
            dist.all_reduce(flat, group=group)
    flat.div_(expert_grad_divisor(ctx))
    for p, part in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(part.view_as(p.grad))
