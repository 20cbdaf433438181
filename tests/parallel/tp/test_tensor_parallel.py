"""Tensor parallelism against a single-process reference built from the same full weights.

Each TP layer and the whole model at tp = 2 and 4 must give the tp = 1 outputs, loss and every gradient
(fp32; relative error <= 1e-5, measured as max|a - b| / max|b|).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.config import Config
from engine.model import transformer as model_lib
from engine.model.fused import by_hf_name
from engine.model.init import materialize
from engine.parallel.layout.context import ParallelContext
from engine.parallel.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from tests.dist import run_ranks
from tests.numerics import rel_err

REL = 1e-5


def _chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]


def _seeded(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _layers_rank() -> dict:
    """Run every TP layer and its nn reference on identical inputs; return the worst relative errors."""
    group, errs = dist.group.WORLD, {}
    x = _seeded(2, 5, 16, seed=1).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    w = _seeded(24, 16, seed=2)  # full (out, in)
    dy = _seeded(2, 5, 24, seed=3)

    col = ColumnParallelLinear(16, 24, group)
    col.weight.data.copy_(_chunk(w, 0))
    col(x).backward(_chunk(dy, -1))
    y_ref = F.linear(x_ref, w.requires_grad_())
    y_ref.backward(dy)
    errs["column.out"] = rel_err(col(x.detach()), _chunk(y_ref.detach(), -1))
    errs["column.dx"] = rel_err(x.grad, x_ref.grad)
    errs["column.dw"] = rel_err(col.weight.grad, _chunk(w.grad, 0))
    gathered = ColumnParallelLinear(16, 24, group, gather_output=True)
    gathered.weight.data.copy_(_chunk(w, 0))
    xg = x.detach().clone().requires_grad_()
    out = gathered(xg)
    out.backward(dy)
    errs["column_gather.out"] = rel_err(out.detach(), y_ref.detach())
    errs["column_gather.dx"] = rel_err(xg.grad, x_ref.grad)

    for parallel_input in (True, False):
        w2 = _seeded(24, 16, seed=4).requires_grad_()
        row = RowParallelLinear(16, 24, group, input_is_parallel=parallel_input)
        row.weight.data.copy_(_chunk(w2.detach(), 1))
        xr = x.detach().clone().requires_grad_()
        xin = _chunk(xr, -1) if parallel_input else xr
        out = row(xin)
        out.backward(dy)
        x2 = x.detach().clone().requires_grad_()
        ref = F.linear(x2, w2)
        ref.backward(dy)
        errs[f"row{parallel_input}.out"] = rel_err(out, ref)
        # With a sharded input each rank owns (and gets the gradient of) only its chunk of x.
        got_dx, want_dx = (_chunk(xr.grad, -1), _chunk(x2.grad, -1)) if parallel_input else (xr.grad, x2.grad)
        errs[f"row{parallel_input}.dx"] = rel_err(got_dx, want_dx)
        errs[f"row{parallel_input}.dw"] = rel_err(row.weight.grad, _chunk(w2.grad, 1))

    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(5))
    table = _seeded(32, 8, seed=6).requires_grad_()
    emb = VocabParallelEmbedding(32, 8, group)
    emb.weight.data.copy_(_chunk(table.detach(), 0))
    d_emb = _seeded(2, 7, 8, seed=7)
    out = emb(ids)
    out.backward(d_emb)
    ref = F.embedding(ids, table)
    ref.backward(d_emb)
    errs["embedding.out"] = rel_err(out, ref)
    errs["embedding.dw"] = rel_err(emb.weight.grad, _chunk(table.grad, 0))

    logits = _seeded(3, 4, 32, seed=8) * 4
    target = torch.randint(0, 32, (3, 4), generator=torch.Generator().manual_seed(9))
    local = _chunk(logits, -1).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group)
    loss.backward()
    full = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(full.view(-1, 32), target.view(-1))
    ref_loss.backward()
    errs["xent.loss"] = rel_err(loss.detach(), ref_loss.detach())
    errs["xent.dlogits"] = rel_err(local.grad, _chunk(full.grad, -1))

    target[0, :2] = -100  # ignored positions (padding, prompt tokens) count neither in the loss nor the mean
    local = _chunk(logits, -1).clone().requires_grad_()
    vocab_parallel_cross_entropy(local, target, group).backward()
    full = logits.clone().requires_grad_()
    F.cross_entropy(full.view(-1, 32), target.view(-1)).backward()
    errs["xent_ignore.dlogits"] = rel_err(local.grad, _chunk(full.grad, -1))
    return errs


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_match_reference(tp):
    for rank, errs in enumerate(run_ranks(_layers_rank, tp)):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"rank {rank}: relative errors above {REL}: {bad}"


def _model_rank(tp: int, tie: bool, qwen2: bool = False) -> dict:
    """tp-sharded model vs the tp=1 model from the same seed: logits, loss and every parameter gradient. GQA (8
    heads, 4 kv heads); ``qwen2``: q/k/v biases."""
    cfg = Config()
    cfg.model.num_layers, cfg.model.tie_embeddings, cfg.parallel.tp = 2, tie, tp
    cfg.model.attention_bias, cfg.model.family = qwen2, "qwen2" if qwen2 else "llama"
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 4, 4
    ctx = ParallelContext.from_config(cfg)
    ref = materialize(model_lib.build(cfg.model), torch.device("cpu"), seed=7, std=0.02)
    par = materialize(
        apply_tensor_parallel(model_lib.build(cfg.model), ctx.tp_group), torch.device("cpu"), seed=7, std=0.02
    )
    ids = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(11))
    inputs, labels = ids[:, :-1], ids[:, 1:]

    ref_logits = ref(inputs)
    ref_loss = F.cross_entropy(ref_logits.view(-1, ref_logits.shape[-1]), labels.reshape(-1))
    ref_loss.backward()
    logits = par(inputs)
    loss = vocab_parallel_cross_entropy(logits, labels, ctx.tp_group)
    loss.backward()

    errs = {
        "logits": rel_err(logits.detach(), _chunk(ref_logits.detach(), -1)),
        "loss": rel_err(loss.detach(), ref_loss.detach()),
    }

    # Compared per Hugging Face tensor: a fused qkv_proj holds [q_r; k_r; v_r], the tp chunk of each part.
    def tensors(model, grad):
        return by_hf_name(model, {n: (p.grad if grad else p).detach() for n, p in model.named_parameters()})

    ref_w, ref_g, par_w, par_g = tensors(ref, False), tensors(ref, True), tensors(par, False), tensors(par, True)
    assert set(par_w) == set(ref_w)
    for name, (w, module, attr) in par_w.items():
        dim = getattr(module, "tp_dims", {}).get(attr)
        want_w = ref_w[name][0] if dim is None else _chunk(ref_w[name][0], dim)
        want_g = ref_g[name][0] if dim is None else _chunk(ref_g[name][0], dim)
        assert torch.equal(w, want_w), f"initial weight of {name} differs from tp=1"
        errs[f"grad {name}"] = rel_err(par_g[name][0], want_g)
    return errs


@pytest.mark.parametrize("tp,tie,qwen2", [(2, False, False), (4, False, False), (2, True, False), (4, False, True)])
def test_tp_model_matches_tp1(tp, tie, qwen2):
    for rank, errs in enumerate(run_ranks(_model_rank, tp, tp, tie, qwen2)):
        assert len(errs) > 10  # logits, loss and the gradients of every parameter were compared
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"rank {rank}: relative errors above {REL}: {bad}"
