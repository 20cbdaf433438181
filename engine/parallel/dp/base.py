"""The data-parallel interface: what the trainer asks of a dp mode, and the torch-optimizer half ddp and fsdp share.

A ``DataParallel`` wraps one pipeline stage (already tensor-parallel and initialised) over the dp group and owns
everything that differs between dp modes: the forward call (autocast or DeepSpeed's bf16 weights), which backward
of a step reduces gradients, the backward itself, summing a gradient over another group (the tied embedding),
the update, dropping a step's gradients, the bytes the rank holds, and what it holds for a checkpoint. The trainer
calls these in this order every step and never asks which mode it is:

    dp = build(stage, cfg, ctx)                        # engine/parallel/dp/__init__.py: the registry
    for each micro-batch's backward:                   # run by the pipeline executor
        dp.before_backward(is_last, chunk); dp.backward(output, grad)
    dp.last_weight(store, key, chunk)                  # zero bubble: each chunk's last W
    dp.all_reduce_grad(tied_weight, embed_group)       # pp > 1 with tied embeddings
    dp.reduce_gradients()                              # the exposed part of the dp reduction (often nothing)
    norm = dp.step(lr)                                 # or dp.skip() after a NaN loss

A new mode is a subclass in a file of its own, its planner model and one DpModeSpec in the registry
(docs/architecture.md, "A new dp mode", names every file).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package
from engine.config import Config
from engine.metrics.memory import tensor_bytes_held
from engine.model.shards import local
from engine.optim import build_optimizer, clip_gradients, set_lr
from engine.parallel.ep import expert_parameters
from engine.parallel.pp.executor import backward_from
from engine.parallel.pp.tied import counted_elsewhere


class DataParallel:
    """One dp mode over one pipeline stage. Subclasses set ``module`` (the stage, unwrapped: the names and
    parameters a checkpoint sees) and ``optimizer``."""

    module: nn.Module
    optimizer: torch.optim.Optimizer

    def __init__(self, cfg: Config, ctx):
        self.cfg, self.ctx = cfg, ctx

    # ---- forward and backward of one micro-batch ------------------------------------------------------------
    def autocast(self):
        """bf16 autocast for train.dtype=bf16 (fp32 weights and gradients, bf16 matmuls), as Megatron's O2-less
        mixed precision; a mode that holds bf16 weights itself overrides forward instead."""
        if self.cfg.train.dtype == "bf16":
            return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, x: torch.Tensor, chunk: int = 0, **kwargs) -> torch.Tensor:
        """Forward of model chunk ``chunk`` (virtual stages; 0 is the whole stage where a mode has one chunk)."""
        with self.autocast():
            return self.module(x, **kwargs)  # (mbs, s, V/tp) on the last stage, (mbs, s, h) elsewhere

    def before_backward(self, is_last: bool, chunk: int = 0) -> None:
        """Called before each micro-batch's backward; ``is_last``: the step's last one of model chunk ``chunk``,
        where its gradients are reduced over dp (the others only accumulate). A schedule that defers weight
        gradients never passes is_last=True: the chunk's gradients are complete after its last W (last_weight)."""

    def last_weight(self, store, key, chunk: int = 0) -> None:
        """Zero bubble: run model chunk ``chunk``'s last W (``store.flush(key)``,
        engine/parallel/autograd/weight_grad.py), after which its gradients are complete; a mode that reduces per
        chunk starts that here."""
        store.flush(key)

    def backward(self, output: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Backward of one micro-batch: from the loss (grad None, last stage) or from the stage output (whose
        storage may have been freed after it was sent) and the gradient received from the next stage."""
        backward_from(output, grad)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    # ---- between the last backward and the update -----------------------------------------------------------
    def all_reduce_grad(self, param: nn.Parameter, group) -> None:
        """Sum ``param``'s accumulated gradient (this rank's part of it) over ``group``; zeros if it has none."""
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = local(param.grad)
        on_device = grad.to(self.ctx.device)  # FSDP's CPU offload keeps it on the host; NCCL reduces device tensors
        with oplog.logged("all-reduce", group, "tied embedding", on_device.numel() * on_device.element_size()):
            dist.all_reduce(on_device, group=group)
        if on_device is not grad:
            grad.copy_(on_device)

    def reduce_gradients(self) -> None:
        """Finish the dp reduction that did not overlap with backward (timed as the ``dp_comm`` phase)."""

    def step(self, lr: float) -> float:
        """Clip by the global gradient norm and update at ``lr``; returns the norm before clipping. A NaN/inf
        norm leaves the weights unchanged (and is returned)."""
        raise NotImplementedError

    def skip(self) -> None:
        """Drop this step's gradients without updating (a NaN/inf loss)."""
        raise NotImplementedError

    # ---- what the rank holds ----------------------------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Name -> fp32 copy of every parameter of the stage, whole over dp (tp-local): what the optimizer steps.
        A collective when parameters are sharded over dp: every rank of the dp group must call it."""
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in self.module.named_parameters()
        }

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the distinct storages this rank holds for params, grads and optimizer state (engine/metrics/
        memory.py), counted between the last backward and the update."""
        raise NotImplementedError

    def checkpoint_state(self):
        """The object that reads and writes this rank's part of every parameter and Adam moment
        (engine/parallel/dp/state.py: held, writes, state_names, get, set, prepare, finish, adam_step)."""
        raise NotImplementedError


class TorchOptimizerMixin:
    """The update for modes that keep torch parameters and a torch AdamW (ddp, fsdp): clip_gradients with the
    norm over tp x pp (and over dp when gradients are sharded over it), then AdamW. The last stage's copy of a
    tied embedding is left out of the norm (its gradient is counted on the first stage): looked up on ``module``
    at each step, so a wrapper that replaces the parameters (FSDP's fully_shard) cannot leave a stale one."""

    sharded_grads = False  # True when each dp rank holds a different part of the gradient (FSDP)
    zero_grad_to_none = True  # False keeps gradient storage between steps (DDP's bucket views)

    def _build_optimizer(self) -> None:
        self.optimizer = build_optimizer(self.module, self.cfg.train)

    def step(self, lr: float) -> float:
        ctx = self.ctx
        exclude = counted_elsewhere(self.module, self.cfg, ctx)
        # Each expert counted once. Replicated gradients (ddp): every ep rank holds other experts whole, their
        # squares summed over ep. Sharded (fsdp): every dp rank holds its own piece of its ep rank's experts (one
        # expert-dp shard), so the sum of local squares over dp x cp, as for the dense shards, covers them once.
        experts = () if self.sharded_grads else tuple(p for _, p in expert_parameters(self.module))
        norm = clip_gradients(
            self.module,
            self.cfg.train.grad_clip,
            ctx.tp_rank,
            ctx.mp_group,
            exclude,
            dp_group=ctx.grad_group if self.sharded_grads else None,
            device=ctx.device,
            experts=experts,
            ep_group=ctx.group("ep") if experts else None,
        )
        if math.isfinite(norm):
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.zero_grad_to_none)
        return norm

    def skip(self) -> None:
        self.optimizer.zero_grad(set_to_none=self.zero_grad_to_none)

    def bytes_held(self) -> dict[str, int]:
        return tensor_bytes_held(self.module, self.optimizer)
