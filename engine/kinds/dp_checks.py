"""Each dp mode's own configuration checks, which its DpModeSpec (engine/kinds/dp_modes.py) points at: the
checks of the keys only it reads (world-size free, called by engine/config_checks.py), what it says when another
mode is given one of its keys, and its refusals of a layout (called by engine/parallel/layout/checks.py). No torch."""

from __future__ import annotations

from engine.errors import ConfigError
from engine.kinds.ds_config import DEFAULTS as DS_STAGES
from engine.kinds.ds_config import check_overlap_comm, offload_of, read_user_config
from engine.kinds.offload import OFFLOADS
from engine.kinds.schedules import CHUNK_BACKWARD, LAST_W, SCHEDULES


def refuse_ddp_key(cfg, key: str) -> str:
    p = cfg.parallel
    return (
        f"parallel.{key}={getattr(p, key)} is a DDP communication hook and needs parallel.dp_mode=ddp (got "
        f"{p.dp_mode}); use {key}=none"
    )


def check_ddp(cfg) -> None:
    """DDP's communication hook runs in its reducer, which a schedule that splits the backward bypasses."""
    p = cfg.parallel
    if p.grad_compression != "none" and SCHEDULES[p.schedule].split_w:  # its reduction runs after the last W
        hooked = " or ".join(name for name, s in SCHEDULES.items() if not s.split_w)
        raise ConfigError(
            f"parallel.grad_compression={p.grad_compression} is not supported with parallel.schedule="
            f"{p.schedule} (DDP's reducer does not run there: the gradients are all-reduced after the "
            f"last W); use grad_compression=none, or schedule {hooked}"
        )


def refuse_fsdp_key(cfg, key: str) -> str:
    p = cfg.parallel
    return (
        f"parallel.{key}={getattr(p, key)} is read only with parallel.dp_mode=fsdp (got {p.dp_mode}); remove it "
        f"or set dp_mode=fsdp"
    )


def check_fsdp(cfg) -> None:
    p = cfg.parallel
    if OFFLOADS[p.offload].optimizer and not OFFLOADS[p.offload].params:
        raise ConfigError(
            f"parallel.offload={p.offload} with parallel.dp_mode=fsdp is not available (FSDP2's "
            f"CPUOffloadPolicy offloads parameters, gradients and the step together); use "
            f"offload=optimizer_and_params, or dp_mode=zero for the optimizer alone"
        )


def fsdp_unsharded_grads(cfg) -> bool:
    """Whether fsdp accumulates a step's gradients unsharded, reduce-scattering them once (engine/parallel/dp/fsdp.py
    FSDP.before_backward; engine/planning/dp.py FSDPModel): parallel.fsdp_grad_accumulation=unsharded, and always
    under a schedule that splits the backward (W adds the weight gradients after the B's, outside autograd)."""
    return cfg.parallel.fsdp_grad_accumulation == "unsharded" or SCHEDULES[cfg.parallel.schedule].split_w


def check_fsdp_layout(cfg, layout) -> None:
    """In a V (zbv) rank 0's two model chunks, each its own FSDP root unit, both hold a tied embedding, which is
    then not reduced right (measured at pp 2 x dp 2: grad norm off by 0.23, against 7e-8 untied)."""
    p = cfg.parallel
    if SCHEDULES[p.schedule].vshape and cfg.model.tie_embeddings:
        raise ConfigError(
            f"parallel.dp_mode=fsdp with parallel.schedule={p.schedule} and model.tie_embeddings=true "
            f"is not supported: rank 0's two model chunks (embedding and LM head) are two FSDP root "
            f"units holding one tied weight; use model.tie_embeddings=false or dp_mode=ddp"
        )


def refuse_zero_key(cfg, key: str) -> str:
    p = cfg.parallel
    if key == "zero_stage":
        return (
            f"parallel.zero_stage={p.zero_stage} needs parallel.dp_mode=zero, not {p.dp_mode}; fsdp shards "
            f"like ZeRO-3 (reshard_after_forward=true)"
        )
    return (
        f"parallel.{key}={getattr(p, key)!r} is read only with parallel.dp_mode=zero (got {p.dp_mode}); remove "
        f"it or set dp_mode=zero"
    )


def check_zero(cfg) -> None:
    """DeepSpeed's parameter offload is ZeRO-3's; the ds_config file is read now, so a missing or bad one fails
    before any rank starts, and must agree with parallel.offload."""
    p = cfg.parallel
    if OFFLOADS[p.offload].params and p.zero_stage != 3:
        raise ConfigError(
            f"parallel.offload=optimizer_and_params needs parallel.zero_stage=3 (DeepSpeed offloads "
            f"parameters only in ZeRO-3; got zero_stage={p.zero_stage}); use offload=optimizer, or "
            f"zero_stage=3"
        )
    if p.ds_config:
        read_user_config(p.ds_config)
        check_overlap_comm(p.zero_stage, p.ds_config)
    if p.zero_stage in DS_STAGES:
        offload_of(p.zero_stage, p.ds_config or None, p.offload)  # the file and parallel.offload agree


def check_zero_supported(cfg, ctx) -> None:
    """Refuse, naming the combination, what engine/parallel/dp/zero.py cannot run correctly (``ctx``: has pp)."""
    p = cfg.parallel
    if p.zero_stage not in (1, 2, 3):
        raise ConfigError(f"parallel.dp_mode=zero needs parallel.zero_stage 1, 2 or 3, got {p.zero_stage}")
    if ctx.pp > 1 and cfg.model.tie_embeddings and (p.zero_stage != 1 or cfg.train.dtype != "fp32"):
        raise ConfigError(
            f"parallel.dp_mode=zero with zero_stage={p.zero_stage}, train.dtype={cfg.train.dtype}, "
            "parallel.pp>1 and model.tie_embeddings=true is not supported: the first and last stage's "
            "embedding gradients must be summed before DeepSpeed reduces them, which only ZeRO-1 in "
            "fp32 allows (ZeRO-2/3 reduce-scatter during backward; bf16 ZeRO-1 moves them into its "
            "fp32 buffers); use zero_stage=1 with train.dtype=fp32, or dp_mode=ddp"
        )
    if ctx.pp > 1 and p.zero_stage == 3:
        # Measured with DeepSpeed 0.19.8: ZeRO-3's parameter coordinator checks its module trace against rank 0 of
        # the whole job (a world-group broadcast at the first forward), which stages holding different layers
        # reach at different times: the job hangs.
        raise ConfigError(
            "parallel.dp_mode=zero with zero_stage=3 and parallel.pp>1 is not supported (DeepSpeed's "
            "ZeRO-3 compares module traces across all ranks and hangs under pipeline stages); "
            "use zero_stage 1 or 2, or dp_mode=fsdp"
        )
    check_zero_schedule(cfg)


def check_zero_schedule(cfg) -> None:
    """ZeRO under the schedules that split the stage (a sync after each chunk's last backward: interleaved,
    engine/parallel/dp/zero.py ChunkRunner) or its backward (a sync after the last W: zero bubble): what DeepSpeed
    0.19.8 cannot do, named (read from its source; the parity matrix measured each refused case wrong and each
    accepted one right)."""
    p, bf16 = cfg.parallel, cfg.train.dtype == "bf16"
    sync = SCHEDULES[p.schedule].grad_sync
    if sync == CHUNK_BACKWARD and p.zero_stage == 2 and not bf16 and offload_of(2, p.ds_config or None, p.offload)[0]:
        raise ConfigError(
            f"parallel.schedule={p.schedule} with parallel.dp_mode=zero, zero_stage=2, the optimizer "
            "offloaded and train.dtype=fp32 is not supported: DeepSpeed's fp32 ZeRO-Offload adds each "
            "gradient to its host accumulator from the step's second backward on "
            "(DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu, micro_step_id > 0), which "
            "assumes every parameter had a gradient in the first; a later model chunk's first gradient "
            "then adds the previous step's; use train.dtype=bf16, zero_stage=1, offload=none, or "
            "schedule 1f1b"
        )
    if sync == LAST_W and (p.zero_stage != 1 or bf16):
        why = (
            (
                "ZeRO-2 reduce-scatters each gradient in the hooks autograd fires as it accumulates "
                "(DeepSpeedZeroOptimizer.reduce_ready_partitions_and_remove_grads)"
            )
            if p.zero_stage != 1
            else (
                "bf16 ZeRO-1 accumulates into fp32 param.grad_accum from the hooks autograd fires as it accumulates "
                "(DeepSpeedZeroOptimizer._fill_param_grad_accum_attribute)"
            )
        )
        raise ConfigError(
            f"parallel.schedule={p.schedule} with parallel.dp_mode=zero, zero_stage={p.zero_stage} and "
            f"train.dtype={cfg.train.dtype} is not supported: DeepSpeed's {why}, and W adds the linears' "
            f"weight gradients outside autograd, where no hook fires; use zero_stage=1 with "
            f"train.dtype=fp32, dp_mode=ddp or fsdp, or schedule 1f1b"
        )
