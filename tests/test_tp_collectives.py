"""Collectives per decoder layer under tensor parallelism, counted on the torch.distributed calls themselves.

One forward and one backward of one decoder layer at tp = 2 (GQA, Qwen2 q/k/v biases), with every
torch.distributed collective wrapped to count its calls. Megatron's layout (Shoeybi et al. 2019, Sec. 3): forward
one all-reduce after each row-parallel layer (o_proj, down_proj) = 2; backward one all-reduce in front of each
column-parallel GEMM. With q/k/v and gate/up each fused into one GEMM (engine/model/fused.py) that is 2, where
separate q, k, v, gate and up linears ran 5 (measured with this test on the code before the fusion, commit
c38bd66). Under full activation checkpointing backward also recomputes o_proj's forward all-reduce: 3 (was 6,
measured the same way). Not down_proj's: torch's non-reentrant checkpoint stops recomputing once the last tensor
backward needs (down_proj's input) is back, and nothing needs the block's output.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.config import Config
from engine.model import transformer as model_lib
from engine.model.init import materialize
from engine.model.rope import rope_cos_sin
from engine.parallel.context import ParallelContext
from engine.parallel.tensor import apply_tensor_parallel
from tests.dist import run_ranks

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "barrier")


def _count_rank(recompute: str) -> dict:
    cfg = Config()
    cfg.model.num_layers, cfg.model.attention_bias, cfg.model.family = 1, True, "qwen2"
    cfg.model.num_heads, cfg.model.num_kv_heads = 4, 2
    cfg.parallel.tp = 2
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 2, 2
    ctx = ParallelContext.from_config(cfg)
    model = materialize(apply_tensor_parallel(model_lib.build(cfg.model), ctx.tp_group), torch.device("cpu"),
                        seed=3, std=0.02)
    layer = model.model.layers["0"]
    layer.recompute = recompute
    s = 8
    x = torch.randn(2, s, cfg.model.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    cos, sin = rope_cos_sin(cfg.model, torch.arange(s), x.dtype)
    counts = {"forward": {}, "backward": {}}
    phase = ["forward"]
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            counts[phase[0]][name] = counts[phase[0]].get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        out = layer(x, cos, sin)  # (b, s, h)
        phase[0] = "backward"
        out.sum().backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts


@pytest.mark.parametrize("recompute,backward", [("none", 2), ("full", 3)])
def test_collectives_per_layer_at_tp2(recompute, backward):
    """Full activation checkpointing repeats o_proj's forward all-reduce in backward (engine/model/recompute.py)."""
    for rank, counts in enumerate(run_ranks(_count_rank, 2, recompute)):
        want = {"forward": {"all_reduce": 2}, "backward": {"all_reduce": backward}}
        assert counts == want, f"rank {rank}: {counts}"
