"""One step of a tiny MoE model on tp ranks against one process (_compare), and the experts' parameters a rank holds
(_held): shared by the MoE tp tests and Qwen3-MoE's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.config import ModelConfig, load
from engine.model import transformer as model_lib
from engine.model.fused import by_hf_name
from engine.model.init import materialize
from engine.model.moe import moe_blocks
from engine.parallel.tp.layers import apply_tensor_parallel, vocab_parallel_cross_entropy
from engine.planning.planner import stage_params

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    num_experts=4,
    experts_per_token=2,
)


FAMILIES = {
    "mixtral": ModelConfig(**SHAPE, family="mixtral"),
    "qwen2_moe": ModelConfig(
        **SHAPE,
        family="qwen2_moe",
        moe_intermediate_size=24,
        moe_shared_expert_size=16,
        moe_layers=[1],
        moe_norm_topk_prob=False,
        attention_bias=True,
    ),
    "olmoe": ModelConfig(**SHAPE, family="olmoe"),
}


# Measured at tp 2 (fp32): loss <= 1.1e-7, gradients <= 1.8e-6 relative to the largest element of each; the bound
# leaves room for another reduction order, far below a wrong collective (>= 1e-2: a missing or doubled term).
REL = 1e-5


def _step(cfg: ModelConfig, group, sp: bool) -> tuple[torch.Tensor, dict]:
    """(loss, {HF name: (gradient, tp dim or None)}) of one fp32 step on 16 tokens, aux and z losses on."""
    model = model_lib.build(cfg, device="meta")
    if group is not None:
        apply_tensor_parallel(model, group, sequence_parallel=sp)
    materialize(model, torch.device("cpu"), seed=0, std=0.1)
    for block in moe_blocks(model):
        block.aux_coef, block.z_coef = 0.5, 0.05  # large: the router's gradient is mostly theirs
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], group)
    loss.backward()
    grads = by_hf_name(model, {n: p.grad for n, p in model.named_parameters()})
    return loss.detach(), {
        name: (g, getattr(m, "tp_dims", {}).get(attr) if getattr(m, "tp_size", 1) > 1 else None)
        for name, (g, m, attr) in grads.items()
    }


def _compare(cfg: ModelConfig, sp: bool) -> dict:
    """Rank function: the worst relative error of the tp step of ``cfg`` against its tp-1 step, per name."""
    loss1, whole = _step(cfg, None, False)
    loss, mine = _step(cfg, dist.group.WORLD, sp)
    rank, size = dist.get_rank(), dist.get_world_size()
    errors = {"loss": ((loss - loss1).abs() / loss1.abs()).item()}
    assert set(mine) == set(whole), set(mine) ^ set(whole)
    for name, (g, dim) in mine.items():
        want = whole[name][0] if dim is None else whole[name][0].chunk(size, dim)[rank]
        errors[name] = ((g - want).abs().max() / want.abs().max()).item()
    return errors


def _held(model: ModelConfig) -> tuple[int, int]:
    """Rank function: (parameters this tp rank holds of ``model``, what the planner says it holds)."""
    cfg = load(["--config", "configs/tiny.yaml", "--parallel.tp", "2"])
    cfg.model = model
    model = apply_tensor_parallel(model_lib.build(cfg.model), dist.group.WORLD)
    planned = stage_params(cfg, 2, 1, 0)
    return model_lib.count_params(model), planned["layers"] + planned["root"]
