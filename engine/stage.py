"""The stage a rank trains, built in the documented order, and the pipeline executors that run it.

Order of construction (docs/architecture.md, "The order in which parallelism is applied"): meta-device model ->
this pipeline stage's layers -> tensor parallel -> expert parallel -> context parallel attention -> materialise and
initialise ->
activation checkpointing -> compile; data parallelism wraps the result (engine/parallel/dp/, in the trainer).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import Config
from engine.model import transformer as model_lib
from engine.model.compile import apply_compile
from engine.model.init import materialize
from engine.model.recompute import apply_activation_checkpointing
from engine.parallel import ep
from engine.parallel.cp.apply import apply_context_parallel
from engine.parallel.layout.context import ParallelContext
from engine.parallel.pp import schedule as sched
from engine.parallel.pp.executor import PipelineExecutor, split_stage
from engine.parallel.tp.layers import apply_tensor_parallel
from engine.planning.balance import layer_counts


def wire_dtype(p2p_dtype: str, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of activations and their gradients between pipeline stages (parallel.p2p_dtype): the stage
    output's own (the weights' dtype) under auto, bf16 when asked (train.dtype bf16, checked by the config)."""
    return torch.bfloat16 if p2p_dtype == "bf16" else param_dtype


def build_model(cfg: Config, ctx: ParallelContext) -> nn.Module:
    """The local part of the model on ctx.device, initialised identically at every layout (before dp)."""
    model = model_lib.build(cfg.model, device="meta")
    split_stage(model, ctx.pp, ctx.pp_rank, layer_counts(cfg, ctx.pp), *sched.chunking(cfg.parallel))
    apply_tensor_parallel(model, ctx.tp_group, cfg.parallel.sequence_parallel, cfg.parallel.tp_comm_overlap)
    ep.apply_expert_parallel(model, ctx)  # this rank's experts (a slice of dim 0), all-to-all dispatch
    apply_context_parallel(model, cfg.parallel.cp_mode, ctx.group("cp"), ctx.size("cp"))  # attention across cp
    materialize(model, ctx.device, cfg.train.seed, cfg.model.init_std)
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:  # after activation checkpointing, before data parallelism (engine/model/compile.py)
        apply_compile(model)
    return model


def build_executors(
    cfg: Config, ctx: ParallelContext, model: nn.Module, micro_batches: int, waiting
) -> tuple[PipelineExecutor, PipelineExecutor]:
    """The training and the evaluation (forward-only) executor of ``model``'s stage under parallel.schedule.
    ``waiting``: the timer's context for stalls on receives (pp_wait)."""
    t, p = cfg.train, cfg.parallel
    # Between stages: (b, s/cp, h), or (b, s/(cp tp), h) under sequence parallelism (the residual stream is
    # sharded), in parallel.p2p_dtype: the weights' dtype (auto), or bf16, half the p2p bytes of fp32 weights.
    # A stage casts its input back to its weights' dtype (Trainer.stage_forward; ZeRO bf16 weights are bf16).
    param_dtype = next(model.parameters()).dtype
    s_local = t.seq_len // ctx.size("cp") // (ctx.tp if p.sequence_parallel else 1)
    shape, dtype = (t.micro_batch_size, s_local, cfg.model.hidden_size), wire_dtype(p.p2p_dtype, param_dtype)
    executor = PipelineExecutor(
        ctx, p.schedule, micro_batches, shape, dtype, virtual_stages=p.virtual_stages, stage=model, waiting=waiting
    )
    eval_executor = PipelineExecutor(
        ctx, p.schedule, micro_batches, shape, dtype, forward_only=True, virtual_stages=p.virtual_stages
    )
    return executor, eval_executor
