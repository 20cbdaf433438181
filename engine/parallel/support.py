"""Which (layout, dp mode, dtype, embedding) combinations this build runs: the one place that refuses the rest.

Called by ``context.resolve_layout``, so a refused combination fails before any process group exists, and by the
planner's search. The list of refusals, with the reason for each, is also stated independently in
tests/parity/matrix.py and shown in the README ("What is proven").
"""
from __future__ import annotations

from engine.config import Config, ConfigError


def check_supported(cfg: Config, layout) -> None:
    """Refuse, with the combination named, what this build cannot run. ``layout`` has ``tp``, ``pp``, ``dp``."""
    if cfg.parallel.dp_mode == "zero":
        check_zero_supported(cfg, layout)
    elif cfg.parallel.zero_stage:
        raise ConfigError(f"parallel.zero_stage={cfg.parallel.zero_stage} needs parallel.dp_mode=zero, not "
                          f"{cfg.parallel.dp_mode}; fsdp shards like ZeRO-3 (reshard_after_forward=true)")


def reshard_after_forward(cfg: Config, pp: int) -> bool:
    """FSDP's parallel.reshard_after_forward: true, false, or auto. Under pp > 1 each weight would be gathered once
    per micro-batch forward and again per backward, so auto keeps it gathered from forward to backward there."""
    return {"true": True, "false": False, "auto": pp == 1}[cfg.parallel.reshard_after_forward]


def check_zero_supported(cfg: Config, ctx) -> None:
    """Refuse, naming the combination, what engine/parallel/dp/zero.py cannot run correctly."""
    p = cfg.parallel
    if p.zero_stage not in (1, 2, 3):
        raise ConfigError(f"parallel.dp_mode=zero needs parallel.zero_stage 1, 2 or 3, got {p.zero_stage}")
    if ctx.pp > 1 and cfg.model.tie_embeddings and (p.zero_stage != 1 or cfg.train.dtype != "fp32"):
        raise ConfigError(f"parallel.dp_mode=zero with zero_stage={p.zero_stage}, train.dtype={cfg.train.dtype}, "
                          "parallel.pp>1 and model.tie_embeddings=true is not supported: the first and last stage's "
                          "embedding gradients must be summed before DeepSpeed reduces them, which only ZeRO-1 in "
                          "fp32 allows (ZeRO-2/3 reduce-scatter during backward; bf16 ZeRO-1 moves them into its "
                          "fp32 buffers); use zero_stage=1 with train.dtype=fp32, or dp_mode=ddp")
    if ctx.pp > 1 and p.zero_stage == 3:
        # Measured with DeepSpeed 0.19.8: ZeRO-3's parameter coordinator checks its module trace against rank 0 of
        # the whole job (a world-group broadcast at the first forward), which stages holding different layers
        # reach at different times: the job hangs.
        raise ConfigError("parallel.dp_mode=zero with zero_stage=3 and parallel.pp>1 is not supported (DeepSpeed's "
                          "ZeRO-3 compares module traces across all ranks and hangs under pipeline stages); "
                          "use zero_stage 1 or 2, or dp_mode=fsdp")
