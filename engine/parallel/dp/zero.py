"""DeepSpeed ZeRO stages 1-3 (Rajbhandari et al. 2020) as the data-parallel wrapper of one pipeline stage.

``ZeRO`` (the DataParallel of dp_mode=zero, engine/parallel/dp/base.py) hands our stage module (already
tensor-parallel) and the AdamW of engine/optim.py to
``deepspeed.initialize(..., mpu=ctx)``; ``ds_config`` derives DeepSpeed's config from ours on top of the tunable
settings (built-in defaults per stage, merged with the user's ``parallel.ds_config`` file: kinds/ds_config.py). The step
contract is ours, not DeepSpeed's per-micro-batch one: the trainer runs all m micro-batch forward/backward passes,
then calls ``step(lr)`` once. DeepSpeed is put in caller-owned
accumulation mode (``managed_gradient_accumulation: false``): ``engine.backward`` only accumulates (ZeRO-2/3
still reduce-scatter each micro-batch into the rank's partition, as they always do), and ``engine.step()`` is the
accumulation boundary that finishes the reduction, clips, and applies the update. Our micro-batch losses are
already divided by m, so backward passes ``scale_wrt_gas=False`` (DeepSpeed would divide by m again).

DeepSpeed computes the global grad norm itself (over dp, then its mpu's model-parallel group = tp x pp); it counts
a parameter on every tp rank when it carries ``tensor_model_parallel`` and otherwise only on rank 0 of a group
(tp rank for ZeRO-1/2, tp x pp rank for ZeRO-3). ``mark_parallel_params`` sets that flag so each parameter is
counted exactly once in both formulas. Clipping then scales by min(1, clip / (norm + 1e-6)), as
torch.nn.utils.clip_grad_norm_ and engine.optim.clip_gradients do.

    zero = ZeRO(build_model(cfg, ctx), cfg, ctx)
    for x, y in micro_batches:                       # or through the pipeline executor
        zero.backward(loss_fn(zero.forward(x), y) / m)   # last stage; non-last: zero.backward(out, grad_from_next)
    grad_norm = zero.step(lr_at(step, cfg.train))
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package
from engine.config import Config, ConfigError
from engine.internals import private
from engine.kinds.ds_config import load_base_config, offload_of
from engine.model.shards import tp_dim
from engine.optim import build_optimizer, set_lr, unique_params
from engine.parallel.dp.base import DataParallel
from engine.parallel.dp.zero_state import Zero3State, Zero12State, zero_bytes_held
from engine.parallel.layout.checks import micro_batches_per_step
from engine.parallel.pp.tied import counted_elsewhere, split_over_stages
from engine.parallel.pp.virtual import model_chunks


def ds_config(cfg: Config, ctx, base: dict | None = None) -> dict:
    """DeepSpeed's config: ``base`` (default: the built-in defaults for the stage with parallel.ds_config merged
    over them, engine/kinds/ds_config.py) with every key that our config decides filled in, so batch sizes,
    stage, precision and clipping are never written twice."""
    t, stage = cfg.train, cfg.parallel.zero_stage
    c = copy.deepcopy(base) if base is not None else load_base_config(stage, cfg.parallel.ds_config or None)
    c["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    c["gradient_accumulation_steps"] = micro_batches_per_step(t, ctx.dp)
    # DeepSpeed checks train_batch_size = micro * accumulation * its dp size, which is dp x cp (ctx's mpu): the cp
    # ranks of a dp rank run the same rows (other tokens), so they count as cp copies; resolve_layout checked it.
    c["train_batch_size"] = t.global_batch_size * getattr(ctx, "cp", 1)
    c["managed_gradient_accumulation"] = False  # the trainer owns the boundary: m backwards, then one step()
    c["gradient_clipping"] = float(t.grad_clip)
    c["zero_allow_untested_optimizer"] = True  # torch.optim.AdamW as client optimizer (no FusedAdam build)
    # The engine picks the offload optimizer (offload_optimizer below): DeepSpeed must not refuse torch's AdamW.
    c["zero_force_ds_cpu_optimizer"] = False
    zero = c.setdefault("zero_optimization", {})
    zero["stage"] = stage
    # parallel.offload, or the file's own offload keys (checked to agree at load): the device is cpu; pinned host
    # memory (faster copies) only where there is a CUDA device to copy to.
    pin = getattr(getattr(ctx, "device", None), "type", "cpu") == "cuda"
    for key, on in zip(("offload_optimizer", "offload_param"), zero_offload(cfg)):
        if on:
            zero[key] = {"pin_memory": pin, **zero.get(key, {}), "device": "cpu"}
    c["bf16"] = {**c.get("bf16", {}), "enabled": t.dtype == "bf16"}
    c["fp16"] = {"enabled": False}
    if t.dtype == "bf16":
        # Accumulate micro-batch gradients in fp32, as the ddp path does (bf16 weights, fp32 master + grads).
        c.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    return c


def zero_offload(cfg: Config) -> tuple[bool, bool]:
    """(optimizer offloaded, parameters offloaded) under dp_mode zero (engine/kinds/ds_config.py offload_of)."""
    return offload_of(cfg.parallel.zero_stage, cfg.parallel.ds_config or None, cfg.parallel.offload)


def cpu_adam_built() -> bool:
    """DeepSpeedCPUAdam's op is installed with DeepSpeed or already JIT-built in torch's extension cache, so
    loading it costs no compilation."""
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    return bool(installed_ops.get("cpu_adam")) or os.path.exists(
        os.path.join(_get_build_directory("cpu_adam", verbose=False), "cpu_adam.so")
    )


def offload_optimizer(model: nn.Module, t) -> torch.optim.Optimizer:
    """The optimizer of ZeRO-Offload (Ren et al. 2021): DeepSpeed's vectorised host AdamW, DeepSpeedCPUAdam in
    AdamW mode (decoupled weight decay, as torch.optim.AdamW), over build_optimizer's two groups, when its C++ op
    builds here (JIT, cached under ~/.cache/torch_extensions); else torch's AdamW, which DeepSpeed then steps on
    the host partitions (its documented fallback, zero_force_ds_cpu_optimizer=false, set by ds_config)."""
    fallback = build_optimizer(model, t)
    if os.environ.get("ENGINE_CPU_ADAM_BUILD", "1") == "0" and not cpu_adam_built():
        # The test suite (tests/conftest.py): never a first JIT build inside a test (455 s on 2 cores).
        warnings.warn("DeepSpeedCPUAdam is not built and ENGINE_CPU_ADAM_BUILD=0: torch AdamW steps on the host")
        return fallback
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in fallback.param_groups]
        return DeepSpeedCPUAdam(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps, adamw_mode=True)
    except Exception as e:  # the op cannot be built or loaded (no compiler, no ninja, no headers)
        warnings.warn(f"DeepSpeedCPUAdam unavailable ({type(e).__name__}: {e}); torch AdamW steps on the host")
        return fallback


def mark_parallel_params(model: nn.Module, tp_rank: int) -> None:
    """Tag parameters so DeepSpeed's grad norm counts each exactly once: tp-sharded ones on every rank
    (``tensor_model_parallel``), replicated ones (norms) on tp rank 0 only. Without the tag DeepSpeed counts a
    sharded weight only on tp rank 0 and, in ZeRO-3, a replicated one only on model-parallel rank 0 (stage 0)."""
    for module, attr, p in unique_params(model):
        dim = tp_dim(module, attr)
        p.tensor_model_parallel = dim is not None or tp_rank == 0
        if dim is not None:
            p.partition_dim, p.partition_stride = dim, 1


def _import_deepspeed():
    """DeepSpeed, or one line saying how to install it. Checked here, where ZeRO first needs it, not in the layout
    check: planning a ZeRO layout (launch/plan.py) must not need DeepSpeed installed."""
    try:
        import deepspeed
    except ImportError as e:  # the quick start's plain `pip install -e .` leaves it out
        raise ConfigError(
            f"parallel.dp_mode=zero needs DeepSpeed, which cannot be imported ({e}); install it with "
            f'pip install -e ".[deepspeed]", or use parallel.dp_mode=ddp or fsdp'
        ) from None
    return deepspeed


def _ensure_deepspeed_comm(backend: str) -> None:
    import deepspeed
    import deepspeed.comm as ds_comm

    # deepspeed.initialize asserts that LOCAL_RANK is set, which only launchers do: a plain `python
    # launch/pretrain.py` (one process) has none. 0 is also what env_rank_info read in its absence.
    os.environ.setdefault("LOCAL_RANK", "0")
    if not ds_comm.is_initialized():
        # Wraps the process group the context already made (gloo on CPU, nccl on CUDA); never starts a new one.
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


class ChunkRunner(nn.Module):
    """The stage as DeepSpeed's one wrapped module under virtual stages: ``forward(x, chunk)`` runs model chunk
    ``chunk`` (engine/parallel/pp/virtual.py). Its only submodule is the stage (parameter names prefixed
    ``stage.``); the chunks share the stage's modules and are kept out of the module tree."""

    def __init__(self, stage: nn.Module, chunks: list[nn.Module]):
        super().__init__()
        self.stage = stage
        self.__dict__["chunks"] = chunks  # not registered: their parameters are the stage's

    def forward(self, x, chunk: int = 0, **kwargs):
        return self.chunks[chunk](x, **kwargs)


class ZeRO(DataParallel):
    """One pipeline stage under DeepSpeed ZeRO. DeepSpeed's forward registers the hooks its backward relies on;
    ``backward`` per micro-batch, ``step(lr)`` once per global batch."""

    def __init__(self, model: nn.Module, cfg: Config, ctx, config: dict | None = None):
        super().__init__(cfg, ctx)
        deepspeed = _import_deepspeed()
        _ensure_deepspeed_comm(ctx.backend)
        mark_parallel_params(model, ctx.tp_rank)
        for copy_ in counted_elsewhere(model, cfg, ctx):
            copy_.ds_pipe_replicated = True  # the tied LM-head copy: counted once in the norm, on the first stage
        self.offload = zero_offload(cfg)
        optimizer = offload_optimizer(model, cfg.train) if self.offload[0] else build_optimizer(model, cfg.train)
        self.config = config if config is not None else ds_config(cfg, ctx)
        # Virtual stages: DeepSpeed's forward runs the one module it wraps, so it wraps one that runs a chunk.
        self.chunked = cfg.parallel.virtual_stages > 1
        wrapped = (
            ChunkRunner(model, model_chunks(model, ctx.pp, ctx.pp_rank, cfg.parallel.virtual_stages))
            if self.chunked
            else model
        )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=wrapped, optimizer=optimizer, config=self.config, mpu=ctx
        )
        self.module = self.engine.module.stage if self.chunked else self.engine.module
        self.stage = cfg.parallel.zero_stage
        # DeepSpeed releases without caller-owned accumulation (or a config asking for DeepSpeed's own) count
        # micro-steps; before_backward() then marks the boundary by hand.
        managed = getattr(self.engine, "managed_gradient_accumulation", None)
        self.managed = managed is None or bool(managed())
        if self.managed and split_over_stages(cfg, ctx):
            raise ConfigError(
                "model.tie_embeddings with parallel.pp>1 under dp_mode=zero needs DeepSpeed's "
                "managed_gradient_accumulation=false (DeepSpeed >= 0.19.8 here)"
            )

    def forward(self, x, chunk: int = 0, **kwargs):
        if self.chunked:
            kwargs["chunk"] = chunk
        return self.engine(x, **kwargs)  # under bf16 the weights themselves are bf16: no autocast

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def backward(self, output: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Last stage: ``output`` is the micro-batch loss, already divided by the number of micro-batches (so
        ``scale_wrt_gas=False``: DeepSpeed would divide again). Other stages: DeepSpeed's backward takes a scalar,
        so it runs on (out * grad).sum(), whose gradient with respect to out is grad. The executor may have freed
        the sent output's storage; its value does not matter (mul saves only grad), so zeros stand in for it
        for this backward alone."""
        if grad is None:
            self.engine.backward(output, scale_wrt_gas=False)
            return
        if output.numel() != grad.numel():
            output.data = torch.zeros_like(grad, dtype=output.dtype)  # (mbs, s, h), freed with the graph
        self.engine.backward((output * grad).sum(), scale_wrt_gas=False)

    def before_backward(self, is_last: bool, chunk: int = 0) -> None:
        """In caller-owned accumulation mode (the default here) step() is the boundary and this does nothing.
        In DeepSpeed's managed mode its micro-step counter assumes one engine.step() per micro-batch, which our
        one step per global batch breaks, so the boundary is set by hand: the last backward reduces (ZeRO-1)
        and the following step() applies the update."""
        if self.managed:
            self.engine.set_gradient_accumulation_boundary(is_last)

    def all_reduce_grad(self, param: nn.Parameter, group) -> None:
        """Sum ``param``'s accumulated gradient over ``group`` before ``step()``: the two copies of a tied
        embedding on the first and last pipeline stage. ZeRO-1 only, where gradients stay on the parameters
        until step() reduces them; ZeRO-2/3 have already reduce-scattered them (refused in layout/checks.py)."""
        if self.stage != 1:
            raise RuntimeError(f"all_reduce_grad needs ZeRO-1 (gradients still whole), not ZeRO-{self.stage}")
        opt = self.engine.optimizer
        grad = private(opt, "deepspeed", "get_param_gradient_attribute")(param)
        if grad is None:  # not reached through the model this step: contribute zeros
            accum = private(opt, "deepspeed", "use_grad_accum_attribute")
            attr = "grad_accum" if accum else "grad"
            dtype = private(opt, "deepspeed", "gradient_accumulation_dtype") if accum else param.dtype
            grad = torch.zeros_like(param, dtype=dtype)
            setattr(param, attr, grad)
        with oplog.logged("all-reduce", group, "tied embedding", grad.numel() * grad.element_size()):
            dist.all_reduce(grad, group=group)

    def step(self, lr: float) -> float:
        """Set lr on every param group, reduce (ZeRO-1) or finish reducing (ZeRO-2/3) the accumulated gradients,
        clip to train.grad_clip and update. Returns the global grad norm before clipping, as DeepSpeed computed it
        (over dp and the tp x pp group); DeepSpeed skips the update itself when it is not finite."""
        set_lr(self.engine.optimizer, lr)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def skip(self) -> None:
        """DeepSpeed is stepped at lr 0: its step() is what clears its gradient partitions, and it skips the update
        itself when the gradient norm is not finite (as it is after a NaN loss)."""
        self.step(0.0)

    def bytes_held(self) -> dict[str, int]:
        return zero_bytes_held(self)

    def checkpoint_state(self):
        return Zero3State(self) if self.stage == 3 else Zero12State(self)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """DeepSpeed's fp32 master weights, whole over dp (the bf16 module weights are their rounding)."""
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().float().clone() for n, p in self.module.named_parameters()}
