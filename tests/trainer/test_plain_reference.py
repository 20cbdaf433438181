"""The single-process Trainer (the reference of every parity test) against a plain PyTorch loop written here.

Every parity test compares a layout with the same Trainer at one process, so a bug in what they share (the loss
scaling over micro-batches, the LR schedule, the grad-norm clipping, the optimizer groups) would pass them all.
This loop shares none of it: the same model module and initial weights, the same batches, then
``torch.nn.functional.cross_entropy`` per micro-batch divided by the number of micro-batches, ``torch.optim.AdamW``
with decay on matrices only, the norm summed in float64 with ``torch.nn.utils.clip_grads_with_norm_``, and a warmup +
cosine schedule written out below
(Loshchilov & Hutter 2017: linear warmup over ``warmup`` updates to ``lr``, then cosine to ``lr * min_ratio`` at the
last update). Compared: loss and pre-clip grad norm at every step (rel <= 1e-5) and every parameter at the end,
with clipping off and on (a threshold below every step's norm).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.config import load
from engine.data.feed import BatchFeed
from engine.model import transformer as model_lib
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.dist import run_ranks
from tests.parity.runner import BASE

STEPS = 6  # with warmup 2: two warmup updates, then four on the cosine


def hand_lr(update: int, lr: float, warmup: int, steps: int, min_ratio: float) -> float:
    """LR of the ``update``-th optimizer update, counted from 1."""
    if update <= warmup:
        return lr * update / warmup
    done = (update - 1 - warmup) / (steps - warmup)  # 0 at the first cosine update
    return lr * min_ratio + (lr - lr * min_ratio) * (1 + math.cos(math.pi * done)) / 2


def plain_loop(cfg, init: dict, batches: list[torch.Tensor]) -> dict:
    t = cfg.train
    model = model_lib.build(cfg.model, device="cpu")
    model.load_state_dict(init)
    params = [p for p in model.parameters()]  # a tied weight appears once
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.adam_eps,
    )
    losses, norms = [], []
    for update, batch in enumerate(batches, start=1):
        micro = batch.split(t.micro_batch_size)
        total = 0.0
        for mb in micro:
            logits = model(mb[:, :-1])  # (mbs, s, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten()) / len(micro)
            loss.backward()
            total += loss.item()
        # The norm in float64: torch's fp32 vector_norm (inside clip_grad_norm_) is off by ~1e-5 relative here,
        # as large as the bound, while a float64 sum is exact to ~1e-16. Clipping then uses torch's formula.
        norm = torch.stack([p.grad.double().pow(2).sum() for p in params]).sum().sqrt()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, norm)
        for group in opt.param_groups:
            group["lr"] = hand_lr(update, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(norm.item())
    return {"loss": losses, "grad_norm": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def both(argv: list[str]) -> tuple[dict, dict]:
    """Rank function (world 1): the Trainer's run and the plain loop's, from the same weights and batches."""
    cfg = load(argv)
    ctx = ParallelContext.from_config(cfg)
    trainer = Trainer(cfg, ctx)
    init = {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
    feed = BatchFeed(cfg, ctx, trainer.tokenizer)  # a second reader of the same sequence of global batches
    batches = [feed.next_train() for _ in range(cfg.train.steps)]
    history = trainer.fit()
    got = {
        "loss": [r["loss"] for r in history],
        "grad_norm": [r["grad_norm"] for r in history],
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
    }
    return got, plain_loop(cfg, init, batches)


@pytest.mark.parametrize("clip", [0.0, 0.5])
@pytest.mark.parametrize("tied", [False, True])
def test_trainer_matches_plain_pytorch_loop(tmp_path, clip, tied):
    argv = [
        *BASE,
        "--train.steps",
        str(STEPS),
        "--train.grad_clip",
        str(clip),
        "--model.tie_embeddings",
        str(tied).lower(),
        "--train.out_dir",
        str(tmp_path),
    ]
    got, want = run_ranks(both, 1, argv)[0]
    for key in ("loss", "grad_norm"):
        worst = max(abs(g - w) / abs(w) for g, w in zip(got[key], want[key]))
        assert len(got[key]) == STEPS and worst <= 1e-5, f"{key}: {got[key]} vs plain loop {want[key]}"
    if clip:
        assert min(want["grad_norm"]) > clip  # clipping really acted at every step
    assert set(got["params"]) == set(want["params"])
    for name, p in want["params"].items():
        err = ((got["params"][name] - p).norm() / p.norm()).item()
        assert err <= 1e-5, f"{name} differs from the plain loop by rel {err:.1e}"
