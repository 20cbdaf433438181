"""dp_mode=fsdp: torch FSDP2 ``fully_shard`` on each decoder layer, then the root (as torchtitan's apply_fsdp), over
  the dp sub-mesh (Rajbhandari et al. 2020, "ZeRO"; Zhao et al. 2023, "PyTorch FSDP"). Parameters, gradients and
  optimizer state are sharded over dp; ``reshard_after_forward=True`` frees the gathered weights after each
  forward (ZeRO-3), ``False`` keeps them to the backward (ZeRO-2-like: one all-gather per step instead of two).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from engine.checkpoint.state import TorchState
from engine.config import Config
from engine.parallel.dp.base import DataParallel, TorchOptimizerMixin
from engine.parallel.support import reshard_after_forward


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


class FSDP(TorchOptimizerMixin, DataParallel):
    """The stage sharded over dp; gradients are reduce-scattered in the last micro-batch's backward only (they
    accumulate unsharded before it, as DDP's no_sync does)."""

    sharded_grads = True

    def __init__(self, model: nn.Module, cfg: Config, ctx):
        super().__init__(cfg, ctx)
        self.module = apply_fsdp(model, ctx.mesh["dp"], reshard_after_forward(cfg, ctx.pp), cfg.train.dtype == "bf16")
        self._build_optimizer()

    def before_backward(self, is_last: bool, chunk: int = 0) -> None:
        self.module.set_requires_gradient_sync(is_last)

    def checkpoint_state(self):
        for module in self.module.modules():  # a forward-only pass (evaluation) can leave the root unsharded,
            if isinstance(module, FSDPModule):  # with plain tensors in place of the sharded DTensor parameters
                module.reshard()
        return TorchState(self.module, self.optimizer, self.ctx, fsdp=True)
