"""dp_mode=fsdp: torch FSDP2 ``fully_shard`` on each decoder layer, then the root (as torchtitan's apply_fsdp), over
  the dp sub-mesh (Rajbhandari et al. 2020, "ZeRO"; Zhao et al. 2023, "PyTorch FSDP"). Parameters, gradients and
  optimizer state are sharded over dp; ``reshard_after_forward=True`` frees the gathered weights after each
  forward (ZeRO-3), ``False`` keeps them to the backward (ZeRO-2-like: one all-gather per step instead of two).
  ``parallel.offload=optimizer_and_params``: FSDP2's CPUOffloadPolicy keeps the sharded weights, gradients and
  AdamW state in host memory and steps there (ZeRO-Offload's idea, Ren et al. 2021); each unit's shard is copied
  to the device for its all-gather and its reduced gradient back to the host.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from engine.checkpoint.state import TorchState
from engine.config import Config
from engine.parallel.dp.base import DataParallel, TorchOptimizerMixin
from engine.parallel.support import reshard_after_forward


def apply_fsdp(model: nn.Module, dp_mesh, reshard_after_forward: bool, bf16: bool,
               offload: OffloadPolicy | None = None) -> nn.Module:
    """Shard the (materialised, identically initialised) stage over ``dp_mesh``, one FSDP unit per decoder layer.
    With ``bf16`` the gathered weights are bf16 and gradients are reduced in fp32 (MixedPrecisionPolicy);
    ``offload``: CPUOffloadPolicy, or None to keep everything on the device."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    kw = {"mp_policy": policy, "offload_policy": offload or OffloadPolicy()}
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **kw)
    # The root unit holds the embedding, final norm and LM head; it is needed again right after forward (the
    # backward starts there), so it is never resharded after forward.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **kw)
    return model


class FSDP(TorchOptimizerMixin, DataParallel):
    """The stage sharded over dp; gradients are reduce-scattered in the last micro-batch's backward only (they
    accumulate unsharded before it, as DDP's no_sync does)."""

    sharded_grads = True

    def __init__(self, model: nn.Module, cfg: Config, ctx):
        super().__init__(cfg, ctx)
        # Pinned host memory only where there is a CUDA device to copy to and from (pinning needs CUDA).
        offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") \
            if cfg.parallel.offload == "optimizer_and_params" else None
        self.module = apply_fsdp(model, ctx.grad_mesh, reshard_after_forward(cfg, ctx.pp), cfg.train.dtype == "bf16",
                                 offload)
        self._build_optimizer()  # on the host shards under offload: torch's foreach AdamW steps there

    def before_backward(self, is_last: bool, chunk: int = 0) -> None:
        self.module.set_requires_gradient_sync(is_last)

    def checkpoint_state(self):
        for module in self.module.modules():  # a forward-only pass (evaluation) can leave the root unsharded,
            if isinstance(module, FSDPModule):  # with plain tensors in place of the sharded DTensor parameters
                module.reshard()
        return TorchState(self.module, self.optimizer, self.ctx, fsdp=True)
