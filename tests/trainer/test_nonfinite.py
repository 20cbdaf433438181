"""A finite loss with NaN gradients skips the update, and a checkpoint never holds NaN/inf, in every dp mode.

Issue 17, case 1: with ``--train.lr 1e30`` the loss of step 2 was finite but the gradient norm NaN; the update
was applied and ``step_000002`` held 117 of 119 non-finite tensors. Here the two faults are injected directly:
NaN gradients behind a finite loss (an identity whose backward multiplies by NaN, after the final norm), and an
infinite learning rate for one step (finite loss and norm, non-finite weights and moments after the update).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math

import pytest
import torch

from engine.checkpoint.checkpointer import list_checkpoints
from engine.config import load
from engine.parallel.layout.context import ParallelContext
from engine.trainer import Trainer
from tests.dist import run_ranks
from tests.shrunk import FIVE_STEPS
from tests.trainer.modes import MODES, snapshot


class NanGradient(torch.autograd.Function):
    """Identity forward; backward returns NaN: the loss stays finite, every gradient before it is NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def nonfinite_run(argv: list[str]) -> dict:
    """Rank function: step 1 clean and saved; step 2 NaN gradients; step 3 at lr inf, then try to save."""
    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    poison = {"on": False}
    if trainer.ctx.is_last_stage:
        trainer.model.model.norm.register_forward_hook(
            lambda module, args, out: NanGradient.apply(out) if poison["on"] else out
        )
    records = [trainer.train_step(trainer.next_local_batch())]
    first = trainer.checkpointer.save(trainer.parts, trainer.position)
    before = snapshot(trainer)
    poison["on"] = True
    records.append(trainer.train_step(trainer.next_local_batch()))
    after = snapshot(trainer)
    poison["on"] = False
    trainer.cfg.train.lr = float("inf")  # past validation: the update makes weights and moments non-finite
    records.append(trainer.train_step(trainer.next_local_batch()))
    poisoned = any(not torch.isfinite(p).all() for p in snapshot(trainer).values())
    with contextlib.redirect_stdout(io.StringIO()) as said:
        refused = trainer.checkpointer.save(trainer.parts, trainer.position)
    trainer.checkpointer.finish()
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    return {
        "records": records,
        "first": str(first),
        "refused": refused,
        "said": said.getvalue(),
        "unchanged": unchanged,
        "poisoned": poisoned,
    }


@pytest.mark.parametrize("mode", list(MODES))
def test_nan_gradients_skip_the_update_and_never_reach_a_checkpoint(tmp_path, mode):
    if mode.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    ckpt = tmp_path / "ckpt"
    argv = [
        *FIVE_STEPS,
        *MODES[mode],
        "--parallel.dp",
        "2",
        "--train.out_dir",
        str(tmp_path),
        "--checkpoint.dir",
        str(ckpt),
    ]
    got = run_ranks(nonfinite_run, 2, argv, timeout_s=300)[0]
    loss, norm = got["records"][1]["loss"], got["records"][1]["grad_norm"]
    assert math.isfinite(loss) and not math.isfinite(norm), (loss, norm)
    assert got["unchanged"], "the update of a step with NaN gradients was applied"
    assert got["records"][1].get("skipped_steps") == 1
    assert got["poisoned"], "lr=inf did not make the weights non-finite: the test injects nothing"
    assert got["refused"] is None
    # one line on rank 0, naming the first rank that holds them and how many more do (lr inf reached both)
    said = got["said"].splitlines()
    assert len(said) == 1 and said[0].startswith("checkpoint: not saving step 3: rank 0 holds NaN/inf values in "), said
    assert said[0].endswith(" (and on 1 more ranks); the latest checkpoint stays step_000001"), said
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_000001"]
    assert (ckpt / "latest").read_text().strip() == "step_000001"
    assert not list(ckpt.glob("step_*.tmp-*")), "a refused save left its temporary directory"
