"""dp_mode=fsdp: torch FSDP2 ``fully_shard`` on each decoder layer, then the root (as torchtitan's apply_fsdp), over
the dp sub-mesh (Rajbhandari et al. 2020, "ZeRO"; Zhao et al. 2023, "PyTorch FSDP"). Parameters, gradients and
optimizer state are sharded over dp; ``reshard_after_forward=True`` frees the gathered weights after each
forward (ZeRO-3), ``False`` keeps them to the backward (ZeRO-2-like: one all-gather per step instead of two).
``parallel.offload=optimizer_and_params``: FSDP2's CPUOffloadPolicy keeps the sharded weights, gradients and
AdamW state in host memory and steps there (ZeRO-Offload's idea, Ren et al. 2021); each unit's shard is copied
to the device for its all-gather and its reduced gradient back to the host.
Expert parallelism (parallel.ep > 1): each MoE layer's experts are a unit of their own over the expert-dp mesh,
sharded before their layer's unit (``shard_experts``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from engine.config import Config
from engine.internals import private
from engine.kinds.dp_checks import fsdp_unsharded_grads
from engine.kinds.offload import OFFLOADS
from engine.parallel.dp.base import DataParallel, TorchOptimizerMixin
from engine.parallel.dp.state import TorchState
from engine.parallel.ep import expert_grad_divisor
from engine.parallel.ep.dispatch import ExpertParallelExperts
from engine.parallel.layout.checks import reshard_after_forward
from engine.parallel.pp.schedule import chunking
from engine.parallel.pp.virtual import model_chunks


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    reshard_after_forward: bool,
    bf16: bool,
    offload: OffloadPolicy | None = None,
    roots: list[nn.Module] | None = None,
    experts: tuple | None = None,
) -> nn.Module:
    """Shard the (materialised, identically initialised) stage over ``dp_mesh``, one FSDP unit per decoder layer.
    With ``bf16`` the gathered weights are bf16 and gradients are reduced in fp32 (MixedPrecisionPolicy);
    ``offload``: CPUOffloadPolicy, or None to keep everything on the device. ``roots``: the modules run as the
    stage's virtual stages (engine/parallel/pp/virtual.py model_chunks; default the stage itself), each a root unit
    over its own layers, as torchtitan shards each pipeline model part separately. ``experts``: (expert-dp mesh,
    gradient divisor) under expert parallelism (``shard_experts``)."""
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    kw = {"mp_policy": policy, "offload_policy": offload or OffloadPolicy()}
    for layer in model.model.layers.values():
        if experts is not None:  # before its layer: the layer's unit then leaves the experts' weights out
            shard_experts(layer, *experts, reshard_after_forward=reshard_after_forward, **kw)
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **kw)
    # A root unit holds the embedding, final norm and LM head of its chunk; it is needed again right after
    # forward (the backward starts there), so it is never resharded after forward.
    for root in roots or [model]:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, **kw)
    return model


def shard_experts(layer: nn.Module, edp_mesh, divisor: int, **kw) -> None:
    """Each expert-parallel experts module of ``layer`` its own FSDP unit over the expert-dp mesh (the ranks holding
    the same experts), as torchtitan shards MoE experts over its "dp_shard_mod_ep" mesh. Its reduce-scatter must
    sum over expert-dp and divide by dp x cp (engine/parallel/ep/__init__.py, the loss is averaged over dp x cp): FSDP
    would average over its own mesh (edp = dp cp / ep ranks), ep times too large. Over several ranks summed, then
    divided
    after the collective (force_sum: gloo has no PREMUL_SUM); over one rank FSDP skips the collective and divides
    its copy, where force_sum would divide a second time (torch 2.13 foreach_reduce). Unused weights (a rank whose
    experts got no token) are reduce-scattered as zeros, so every expert-dp rank issues the same collectives."""
    for module in layer.modules():
        if isinstance(module, ExpertParallelExperts):
            fully_shard(module, mesh=edp_mesh, **kw)
            module.set_gradient_divide_factor(float(divisor))
            module.set_force_sum_reduction_for_comms(edp_mesh.size() > 1)
            module.set_reduce_scatter_unused_params(True)


class FSDP(TorchOptimizerMixin, DataParallel):
    """The stage sharded over dp. ``parallel.fsdp_grad_accumulation=sharded`` (the default, as torchtitan's):
    every micro-batch's backward reduce-scatters each unit's gradients as it completes them (FSDP2's post-backward
    with gradient sync on), adding them into the sharded fp32 gradient, so a rank holds 4 bytes per parameter / dp
    between micro-batches (one unit's unsharded gradient at a time inside a backward). ``unsharded``: they are
    reduce-scattered in the last micro-batch's backward only and accumulate unsharded before it (4 bytes per
    parameter, as DDP's no_sync: m times fewer reduce-scatters). Either way each unit reshards its parameters after
    its backward (FSDP2's reshard_after_backward, left at its default), so the gathered weights between micro-batches
    are the same.

    Virtual stages (interleaved): each model chunk is a root unit of its own, whose gradients are reduce-scattered
    in each of that chunk's backwards (sharded) or in its last (unsharded). Zero bubble: no backward completes a
    gradient (W adds the linears' weight gradients later, outside autograd), so gradient sync stays off in every B
    (the gradients accumulate unsharded under either setting) and each chunk's units are reduced by hand right
    after its last W (``last_weight``), as torch.distributed.pipelining's ``perform_reduce_grad``
    (stage.py) does for FSDP after its last W: ``post_backward`` of every param group, then the root's final
    callback."""

    sharded_grads = True

    def __init__(self, model: nn.Module, cfg: Config, ctx):
        super().__init__(cfg, ctx)
        # Pinned host memory only where there is a CUDA device to copy to and from (pinning needs CUDA).
        offload = (
            CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if OFFLOADS[cfg.parallel.offload].params else None
        )
        self.chunks = model_chunks(model, ctx.pp, ctx.pp_rank, *chunking(cfg.parallel))
        experts = (ctx.mesh_for("edp"), expert_grad_divisor(ctx)) if ctx.size("ep") > 1 else None
        self.module = apply_fsdp(
            model,
            ctx.mesh_for("dp_cp"),
            reshard_after_forward(cfg, ctx.pp),
            cfg.train.dtype == "bf16",
            offload,
            self.chunks,
            experts,
        )
        self._build_optimizer()  # on the host shards under offload: torch's foreach AdamW steps there

    def forward(self, x, chunk: int = 0, **kwargs):
        with self.autocast():
            return self.chunks[chunk](x, **kwargs)  # the stage itself without virtual stages

    def before_backward(self, is_last: bool, chunk: int = 0) -> None:
        """Gradient sync on in every backward (sharded), or in the chunk's last (unsharded). A schedule that
        splits the backward never passes is_last: its B's leave the gradient incomplete (``last_weight``)."""
        self.chunks[chunk].set_requires_gradient_sync(is_last or not fsdp_unsharded_grads(self.cfg))

    def last_weight(self, store, key, chunk: int = 0) -> None:
        """The chunk's last W, then its reduce-scatter (every dp rank runs the same W's: the same order)."""
        store.flush(key)
        root = self.chunks[chunk]
        root.set_requires_gradient_sync(True)
        state = private(root, "torch", "_get_fsdp_state")()
        for unit in private(private(state, "torch", "_state_ctx"), "torch", "all_states"):
            for group in private(unit, "torch", "_fsdp_param_groups"):
                # Under bf16 compute a B's post-backward moved the gradients it had into fp32 accumulators, but a
                # weight whose W's all ran after the last B (pp - 1 - stage of them, ZB-H1) still holds W's bf16
                # sum: both into fp32, or the reduce-scatter refuses the mix (no-ops in fp32 and for the rest).
                for param in private(group, "torch", "fsdp_params"):
                    param.accumulate_unsharded_grad_if_needed()
                    param.to_accumulated_grad_if_needed()
                group.post_backward()  # reduce-scatters what the B's and W's accumulated unsharded
        private(state, "torch", "_root_post_backward_final_callback")()  # waits for them; states back to idle

    def train(self, mode: bool = True) -> None:
        super().train(mode)
        if mode:  # back from an evaluation or the resume check's probe: the parameters as training left them
            self.reshard()

    def reshard(self) -> None:
        """A forward-only pass (evaluation, the probe) leaves a root unit (reshard_after_forward=False) unsharded,
        with plain bf16/fp32 tensors in place of the sharded DTensor parameters: anything reading the parameters
        then (a save, the replica check, a test's comparison) would see those."""
        for root in self.chunks:
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def checkpoint_state(self):
        self.reshard()
        return TorchState(self.module, self.optimizer, self.ctx, fsdp=True)
