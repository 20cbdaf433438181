"""A tied input embedding and LM head split over pipeline stages (Megatron's embedding group).

With ``model.tie_embeddings`` and pp > 1 the embedding lives on the first stage and the LM head on the last, so the
weight exists twice: the last stage's ``lm_head.weight`` is a copy initialised equal to the embedding. After each
step's backward the two copies' gradients are summed over ``ctx.embed_group`` (first and last stage of each
(dp, tp) pipeline), so both take the same update and stay equal; the copy is left out of the gradient norm (its
gradient is counted once, on the first stage) and out of checkpoints (read back from the embedding's pieces).
"""

from __future__ import annotations

from torch import nn

from engine.config import Config
from engine.kinds.schedules import SCHEDULES


def split_over_stages(cfg: Config, ctx) -> bool:
    """True when the tied weight exists on two stages: pp > 1, unless the schedule places its chunks in a V
    (zbv), whose rank 0 holds both the embedding and the LM head, one parameter as at pp = 1."""
    return cfg.model.tie_embeddings and ctx.pp > 1 and not SCHEDULES[cfg.parallel.schedule].vshape


def stage_copy(model: nn.Module, cfg: Config, ctx) -> nn.Parameter | None:
    """This stage's copy of a weight tied across stages (the embedding on the first stage, the LM head on the
    last), or None where there is none to sync."""
    if not split_over_stages(cfg, ctx):
        return None
    if ctx.is_first_stage:
        return model.model.embed_tokens.weight
    if ctx.is_last_stage:
        return model.lm_head.weight
    return None


def counted_elsewhere(model: nn.Module, cfg: Config, ctx) -> tuple:
    """Parameters whose gradient another stage already counts in the global norm: the last stage's copy."""
    if split_over_stages(cfg, ctx) and ctx.is_last_stage:
        return (model.lm_head.weight,)
    return ()
