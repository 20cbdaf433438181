"""The step's mixture-of-experts metrics (engine/model/moe.py records them per layer and micro-batch):

- ``moe_aux_loss`` / ``moe_z_loss``: the load-balancing and router z-losses of the step, each the mean over MoE
  layers, micro-batches and dp x cp ranks of the per-micro-batch value (what the gradient minimises, times its
  coef; under cp each rank's value averages to the micro-batch's: engine/model/moe.py);
- ``moe_tokens_per_expert_min`` / ``_max`` / ``_cv``: token copies each expert received in the step, summed over
  MoE layers, micro-batches and dp x cp ranks (each cp rank counts its own tokens), and their coefficient of
  variation (std / mean over experts; 0 = even);
- ``moe_dropped_tokens``: token copies over capacity (model.moe_capacity_factor), summed likewise; 0 when dropless.
Sums over pipeline stages (each holds its own layers) and dp x cp ranks: E + 3 numbers that ride in the trainer's
one step agreement all-reduce (engine/trainer.py ``agree``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import Config
from engine.model.moe import moe_blocks, moe_layer_count, set_loss_scale


def dense_notice(cfg: Config) -> str | None:
    """The line saying that an MoE family's model without MoE layers trains as the dense model it is."""
    m = cfg.model
    if not m.num_experts or moe_layer_count(m):
        return None
    return (
        f"model.moe_layers={m.moe_layers!r}: no layer of this {m.family} model has experts, so it trains as the "
        f"dense model it is (every layer's MLP of intermediate_size={m.intermediate_size}; no router, no MoE losses)"
    )


def weigh_losses(model: nn.Module, cfg: Config, micro_batches: int) -> None:
    """Give the stage's MoE blocks the step's loss coefficients and micro-batch count (engine/model/moe.py
    set_loss_scale), so their losses' gradients are those of the mean ``collect`` reports."""
    set_loss_scale(model, cfg.model, cfg.train.moe_aux_loss_coef, cfg.train.moe_z_loss_coef, micro_batches)


def local_sums(model: nn.Module, cfg: Config, device) -> torch.Tensor | None:
    """This rank's (3 + E,) float64 sums of the step (aux, z, dropped, token counts per expert), None when no layer
    has experts; clears the blocks' records. The trainer sums them over pp and dp x cp in its step agreement."""
    if not moe_layer_count(cfg.model):
        return None
    sums = torch.zeros(3 + cfg.model.num_experts, dtype=torch.float64, device=device)
    for block in moe_blocks(model):
        for r in block.records:
            sums[0] += r["aux"].double()
            sums[1] += r["z"].double()
            sums[2] += r["dropped"]
            sums[3:] += r["counts"].double()
        block.records.clear()
    return sums


def collect(sums: torch.Tensor, cfg: Config, ctx, micro_batches: int) -> dict:
    """The step's MoE metrics from ``local_sums`` summed over pipeline stages and dp x cp ranks."""
    layers = moe_layer_count(cfg.model)
    mean_over = layers * micro_batches * ctx.grad_size  # a cp rank's aux and z average to the micro-batch's
    counts = sums[3:]
    return {
        "moe_aux_loss": (sums[0] / mean_over).item(),
        "moe_z_loss": (sums[1] / mean_over).item(),
        "moe_tokens_per_expert_min": int(counts.min()),
        "moe_tokens_per_expert_max": int(counts.max()),
        "moe_tokens_per_expert_cv": (counts.std(unbiased=False) / counts.mean().clamp(min=1)).item(),
        "moe_dropped_tokens": int(sums[2]),
    }


def step_loss(lm_loss: float, sums: torch.Tensor | None, cfg: Config, ctx, micro_batches: int) -> tuple[float, dict]:
    """The step's objective, the loss the gradient follows: cross-entropy + moe_aux_loss_coef * aux +
    moe_z_loss_coef * z, and the MoE metrics with ``lm_loss`` (cross-entropy alone); (lm_loss, {}) when dense
    (``sums`` None: ``local_sums`` of a model without MoE layers, an MoE family's included, whose means over zero
    layers were 0/0: a NaN loss every step)."""
    if sums is None:
        return lm_loss, {}
    moe = {**collect(sums, cfg, ctx, micro_batches), "lm_loss": lm_loss}
    t = cfg.train
    return lm_loss + t.moe_aux_loss_coef * moe["moe_aux_loss"] + t.moe_z_loss_coef * moe["moe_z_loss"], moe
